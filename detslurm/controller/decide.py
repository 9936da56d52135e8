"""Trial-run exit -> trial decision (Determined's trial lifecycle rules)."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session

from detslurm.controller.apply import apply_actions, note
from detslurm.controller.config import stored_config
from detslurm.controller.executor import ExitCause, JobState, JobStatus
from detslurm.searcher import EXIT_ERRORED, EXIT_INVALID_HP, EXIT_USER_CANCELED, Action, SearchMethod
from detslurm.store.models import Checkpoint, Experiment, ExperimentState, RunState, Trial, TrialRun, TrialState

# Ends that spend none of the trial's restarts: the cluster's doing (a preemption, a dead node), or
# ours (a controller that died between creating a run and submitting it). Everything else that
# ends a run without the trial's acknowledgment (a crash, a time limit hit before it could
# checkpoint, a job that vanished) counts against max_restarts, as in Determined.
SPENDS_NO_RESTART = frozenset({ExitCause.PREEMPTED, ExitCause.NODE_FAILURE, ExitCause.NEVER_STARTED})


# Node failures in a row that spend no restart; from the next one on each spends one, as a crash.
NODE_FAILURES_FREE = 3


def _node_failures_in_a_row(trial: Trial) -> int:
    """How many of the trial's last ended runs, this one included, lost their node."""
    n = 0
    for r in sorted(trial.runs, key=lambda r: r.run_id, reverse=True):
        if r.end_time is None:
            continue  # a run not ended yet (there is none while deciding; kept for safety)
        if r.exit_reason != ExitCause.NODE_FAILURE.value:
            break
        n += 1
    return n


# Preemptions in a row, none of whose runs saved a checkpoint, that spend no restart; from the
# next one on each spends one. A trial stopped every time before it can checkpoint makes no
# progress however often it is resubmitted: a checkpoint that always fails at the time limit's
# warning, say. And the stop is known from the run's signals file, which the trial can write.
PREEMPTIONS_WITHOUT_CHECKPOINT_FREE = 3


def _preemptions_without_checkpoint(session: Session, trial: Trial) -> int:
    """How many of the trial's last ended runs, this one included, were preempted (or stopped)
    without saving a checkpoint."""
    saved = set(session.scalars(select(Checkpoint.run_id).where(Checkpoint.trial_id == trial.id)))
    n = 0
    for r in sorted(trial.runs, key=lambda r: r.run_id, reverse=True):
        if r.end_time is None:
            continue
        if r.exit_reason != ExitCause.PREEMPTED.value or r.run_id in saved:
            break
        n += 1
    return n


def _free_streak_over(session: Session, trial: Trial, cause: ExitCause) -> str | None:
    """Why this end, otherwise free, spends a restart: it is one of too many in a row that
    would resubmit the trial forever at no cost. A trial that takes its node down every time
    (an OOM that kills the node, a bad driver); one stopped every time before it checkpoints."""
    if cause == ExitCause.NODE_FAILURE and _node_failures_in_a_row(trial) > NODE_FAILURES_FREE:
        return f"more than {NODE_FAILURES_FREE} node failures in a row: this one spends a restart"
    free = PREEMPTIONS_WITHOUT_CHECKPOINT_FREE
    if cause == ExitCause.PREEMPTED and _preemptions_without_checkpoint(session, trial) > free:
        return f"more than {free} preemptions in a row without a checkpoint saved: this one spends a restart"
    return None


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
    if trial.state.is_terminal:
        return
    trial.state = state
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
    """0.37 searcher operations: every ValidateAfter is done and the searcher has closed the trial."""
    return bool(trial.searcher_ops) and trial.ops_closed and trial.ops_completed >= len(trial.searcher_ops)


def _after_ack(session: Session, exp: Experiment, trial: Trial, searcher: SearchMethod) -> None:
    """A zero exit after an acknowledged stop request: preempted, paused, or out of ops."""
    if ops_done(trial):
        finish_trial(session, exp, trial, TrialState.COMPLETED, searcher)
    elif exp.state == ExperimentState.PAUSED or trial.state == TrialState.PAUSED:
        trial.state = TrialState.PAUSED
        note(session, trial.id, "trial paused after checkpointing")
    elif trial.ops_idle:
        note(session, trial.id, "no searcher operation for now; the trial resumes if promoted")
    else:
        note(session, trial.id, "trial was preempted; it will resume from its latest checkpoint")


def _after_failure(session: Session, exp: Experiment, trial: Trial, run: TrialRun, searcher: SearchMethod) -> None:
    max_restarts = stored_config(exp).max_restarts
    trial.restarts += 1
    how = _how_it_ended(run)
    # Strictly greater, as in Determined: max_restarts 5 allows five restarts, so the sixth failure
    # ends the trial.
    if trial.restarts > max_restarts:
        finish_trial(
            session,
            exp,
            trial,
            TrialState.ERROR,
            searcher,
            EXIT_ERRORED,
            f"trial exceeded max restarts ({max_restarts}); its last run failed {how}",
        )
        return
    note(
        session,
        trial.id,
        f"trial failed {how} (restart {trial.restarts}/{max_restarts}); resuming from the latest checkpoint",
        "WARNING",
    )
    if exp.state == ExperimentState.PAUSED:
        trial.state = TrialState.PAUSED


def _how_it_ended(run: TrialRun) -> str:
    """A run's end in words: its exit code when it has one, else what the executor saw (a
    process gone without an exit record has no code to show)."""
    if run.exit_code is not None:
        return f"with exit code {run.exit_code}"
    cause = ExitCause.parse(run.exit_reason)
    return f"without an exit code ({cause.text if cause is not None else 'no exit record'})"


def _record_exit(trial: Trial, run: TrialRun, status: JobStatus) -> ExitCause:
    """Note how the run ended. The trial's own report (InvalidHP, recorded while ingesting its
    events) says more than the scheduler's view of the same exit, so it is kept."""
    run.state = RunState.EXITED if status.state == JobState.EXITED else RunState.LOST
    run.exit_code = status.exit_code
    run.end_time = _now()
    cause = ExitCause.parse(run.exit_reason)
    if cause == ExitCause.CANCELED_BY_DETSLURM and status.cause != ExitCause.CANCELED_BY_USER:
        # `det e pause` marked this queued run before its `scancel --state=PENDING`, but the job had
        # started by then (Slurm left it alone): it ended some other way, which is what counts.
        cause = None
    if cause is None:
        cause = status.cause or (ExitCause.COMPLETED if status.exit_code == 0 else ExitCause.FAILED)
        if cause == ExitCause.CANCELED_BY_USER and trial.state in (
            TrialState.STOPPING_KILLED,
            TrialState.STOPPING_ERROR,
        ):
            cause = ExitCause.CANCELED_BY_DETSLURM  # our own scancel (det e kill / det t kill, a failed search)
    run.exit_reason = cause.value
    return cause


def _after_stop_request(
    session: Session, exp: Experiment, trial: Trial, ok: bool, code: int | None, searcher: SearchMethod
) -> None:
    """The run ended while the trial was being stopped by a user or by an experiment error."""
    state = trial.state
    if state == TrialState.STOPPING_KILLED:
        # A kill ends the trial whatever the exit code: the process was killed, so a non-zero code is
        # expected, not a failure.
        finish_trial(session, exp, trial, TrialState.CANCELED, searcher, EXIT_USER_CANCELED, "trial killed")
    elif state == TrialState.STOPPING_CANCELED:
        final = TrialState.CANCELED if ok else TrialState.ERROR
        why = "trial canceled" if ok else f"trial canceled; exit code {code}"
        finish_trial(session, exp, trial, final, searcher, EXIT_USER_CANCELED, why)
    else:
        # STOPPING_ERROR: the experiment is failing, and its trials end as errors too, as in Determined.
        why = f"stopped: experiment {exp.id} failed (det experiment describe {exp.id} says why)"
        finish_trial(session, exp, trial, TrialState.ERROR, searcher, EXIT_ERRORED, why)


_STOPPING = (TrialState.STOPPING_KILLED, TrialState.STOPPING_CANCELED, TrialState.STOPPING_ERROR)


def decide_exit(
    session: Session, exp: Experiment, trial: Trial, run: TrialRun, status: JobStatus, searcher: SearchMethod
) -> None:
    """A run ended: complete, pause, restart (spending a restart or not) or fail its trial."""
    cause = _record_exit(trial, run, status)
    ok = status.exit_code == 0
    if trial.state in _STOPPING:
        _after_stop_request(session, exp, trial, ok, status.exit_code, searcher)
    elif cause == ExitCause.CANCELED_BY_DETSLURM and status.cause == ExitCause.CANCELED_BY_USER:
        # Our own scancel of a job still waiting in the queue (`det e pause`, or a pool move Slurm
        # could not make in place): nothing ran, so nothing is lost and no restart is spent; the
        # trial resumes on `det e activate`, or at once in its new pool.
        if exp.state == ExperimentState.PAUSED:
            note(session, trial.id, "queued job canceled at once: the experiment was paused before it started")
            trial.state = TrialState.PAUSED
        else:
            note(session, trial.id, f"queued job canceled before it started; resubmitting in pool {exp.resource_pool}")
    elif status.cause == ExitCause.CANCELED_BY_USER:
        # scancel from outside detslurm (ours goes through STOPPING_KILLED above): the user's call.
        why = ExitCause.CANCELED_BY_USER.text
        finish_trial(session, exp, trial, TrialState.CANCELED, searcher, EXIT_USER_CANCELED, why)
    elif cause == ExitCause.UNSCHEDULABLE:
        # Never restarted: the same request would pend for the same reason forever.
        # The executor's detail says why in words, with the scheduler's own code.
        why = f"the job can never start: {status.detail or 'the scheduler refuses it'}; it was canceled"
        finish_trial(session, exp, trial, TrialState.ERROR, searcher, EXIT_ERRORED, why)
    elif cause == ExitCause.IMAGE_UNAVAILABLE:
        # Not retried: every restart would pull the same missing image (the runtime's own
        # message is in the trial's logs, written by the batch shell).
        why = f"{cause.text} (environment.image); not retried: the runtime's message is in the trial's logs"
        finish_trial(session, exp, trial, TrialState.ERROR, searcher, EXIT_ERRORED, why)
    elif cause == ExitCause.INVALID_HP:
        why = "trial reported invalid hyperparameters"
        finish_trial(session, exp, trial, TrialState.COMPLETED, searcher, EXIT_INVALID_HP, why)
    elif (trial.early_stopped and (ok or run.preempt_acked)) or (ok and not run.preempt_acked):
        # Done: it finished its work, or the searcher stopped it and it exited cleanly.
        finish_trial(session, exp, trial, TrialState.COMPLETED, searcher)
    elif ok:
        _after_ack(session, exp, trial, searcher)
    elif trial.early_stopped:
        why = f"trial exited with code {status.exit_code} after the searcher stopped it"
        finish_trial(session, exp, trial, TrialState.COMPLETED, searcher, None, why)
    elif (msg := _free_streak_over(session, trial, cause)) is not None:
        # Free ends that would repeat forever without spending anything (see _free_streak_over).
        note(session, trial.id, msg, "WARNING")
        _after_failure(session, exp, trial, run, searcher)
    elif cause in SPENDS_NO_RESTART:
        # Preempted or lost its node before it could checkpoint: resume from the latest
        # checkpoint without spending one of the trial's restarts.
        msg = f"trial run {run.run_id} ended ({cause.text}); resuming from the latest checkpoint"
        note(session, trial.id, msg, "WARNING")
        if exp.state == ExperimentState.PAUSED:
            trial.state = TrialState.PAUSED
    else:
        _after_failure(session, exp, trial, run, searcher)
