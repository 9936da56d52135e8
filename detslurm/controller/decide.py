"""Trial-run exit -> trial decision (Determined's lifecycle rules, reference §6)."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy.orm import Session

from detslurm.controller.apply import apply_actions, note
from detslurm.controller.executor import JobState, JobStatus
from detslurm.searcher import EXIT_ERRORED, EXIT_INVALID_HP, EXIT_USER_CANCELED, Action, SearchMethod
from detslurm.store.models import Experiment, ExperimentState, RunState, Trial, TrialRun, TrialState

# Ends that spend none of the trial's restarts: the cluster's doing, or ours (a controller that
# died between creating a run and submitting it).
NOT_THE_TRIALS_FAULT = ("preempted", "node failure", "never started")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def finish_trial(
    session: Session,
    exp: Experiment,
    trial: Trial,
    state: TrialState,
    searcher: SearchMethod,
    early_reason: str | None = None,
    why: str | None = None,
) -> None:
    """Move a trial to a terminal state and tell the searcher, exactly once."""
    if TrialState(trial.state).is_terminal:
        return
    trial.state = state.value
    trial.end_time = _now()
    trial.exit_reason = why
    if why:
        note(session, trial.id, why, "ERROR" if state == TrialState.ERROR else "INFO")
    actions: list[Action] = []
    if early_reason is not None:
        actions += searcher.trial_exited_early(trial.request_id, early_reason)
    actions += searcher.trial_exited(trial.request_id)
    apply_actions(session, exp, searcher, actions)


def ops_done(trial: Trial) -> bool:
    return bool(trial.searcher_ops) and trial.ops_closed and trial.ops_completed >= len(trial.searcher_ops)


def _after_ack(session: Session, exp: Experiment, trial: Trial, searcher: SearchMethod) -> None:
    """A zero exit after an acknowledged stop request: preempted, paused, or out of ops."""
    if ops_done(trial):
        finish_trial(session, exp, trial, TrialState.COMPLETED, searcher)
    elif exp.state == ExperimentState.PAUSED.value or trial.state == TrialState.PAUSED.value:
        trial.state = TrialState.PAUSED.value
        note(session, trial.id, "trial paused after checkpointing")
    elif trial.ops_idle:
        note(session, trial.id, "no searcher operation for now; the trial resumes if promoted")
    else:
        note(session, trial.id, "trial was preempted; it will resume from its latest checkpoint")


def _after_failure(session: Session, exp: Experiment, trial: Trial, run: TrialRun, searcher: SearchMethod) -> None:
    max_restarts = int(exp.config.get("max_restarts", 5))
    trial.restarts += 1
    code = run.exit_code
    if trial.restarts > max_restarts:
        finish_trial(
            session,
            exp,
            trial,
            TrialState.ERROR,
            searcher,
            EXIT_ERRORED,
            f"trial exceeded max restarts ({max_restarts}); last exit code {code}",
        )
        return
    note(
        session,
        trial.id,
        f"trial failed with exit code {code} (restart {trial.restarts}/{max_restarts}); "
        "resuming from the latest checkpoint",
        "WARNING",
    )
    if exp.state == ExperimentState.PAUSED.value:
        trial.state = TrialState.PAUSED.value


def decide_exit(
    session: Session, exp: Experiment, trial: Trial, run: TrialRun, status: JobStatus, searcher: SearchMethod
) -> None:
    run.state = RunState.EXITED.value if status.state == JobState.EXITED else RunState.LOST.value
    run.exit_code = status.exit_code
    run.end_time = _now()
    if status.reason and not run.exit_reason:
        run.exit_reason = status.reason[:64]
    ok = status.exit_code == 0
    state = TrialState(trial.state)
    if state == TrialState.STOPPING_KILLED:
        finish_trial(session, exp, trial, TrialState.CANCELED, searcher, EXIT_USER_CANCELED, "trial killed")
    elif state == TrialState.STOPPING_CANCELED:
        finish_trial(
            session,
            exp,
            trial,
            TrialState.CANCELED if ok else TrialState.ERROR,
            searcher,
            EXIT_USER_CANCELED,
            "trial canceled" if ok else f"trial canceled; exit code {status.exit_code}",
        )
    elif state == TrialState.STOPPING_ERROR:
        finish_trial(session, exp, trial, TrialState.ERROR, searcher, EXIT_ERRORED)
    elif status.reason == "canceled":
        # scancel from outside detslurm (ours goes through STOPPING_KILLED above): the user's call.
        finish_trial(
            session,
            exp,
            trial,
            TrialState.CANCELED,
            searcher,
            EXIT_USER_CANCELED,
            "the Slurm job was canceled outside detslurm (scancel)",
        )
    elif run.exit_reason == "INVALID_HP":
        finish_trial(
            session,
            exp,
            trial,
            TrialState.COMPLETED,
            searcher,
            EXIT_INVALID_HP,
            "trial reported invalid hyperparameters",
        )
    elif trial.early_stopped and (ok or run.preempt_acked) or ok and not run.preempt_acked:
        finish_trial(session, exp, trial, TrialState.COMPLETED, searcher)
    elif ok:
        _after_ack(session, exp, trial, searcher)
    elif trial.early_stopped:
        finish_trial(
            session,
            exp,
            trial,
            TrialState.COMPLETED,
            searcher,
            None,
            f"trial exited with code {status.exit_code} after the searcher stopped it",
        )
    elif status.reason in NOT_THE_TRIALS_FAULT:
        # Preempted or lost its node before it could checkpoint: resume from the latest
        # checkpoint without spending one of the trial's restarts.
        note(
            session,
            trial.id,
            f"trial run {run.run_id} ended ({status.reason}); resuming from the latest checkpoint",
            "WARNING",
        )
        if exp.state == ExperimentState.PAUSED.value:
            trial.state = TrialState.PAUSED.value
    else:
        _after_failure(session, exp, trial, run, searcher)
