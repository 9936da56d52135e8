"""User operations on experiments and trials: state changes the controller then carries out.

Every operation acts only inside the caller's :class:`Scope` (default: the caller's own
experiments, by the OS's name for the uid). Another user's experiment is "not found", exactly
like a missing one; root reaches other users' experiments only with an explicit all-users
scope (`det --all-users`), and even then only changes rows: the owner's daemon carries it out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from detslurm.controller.executor import ExitCause
from detslurm.controller.gc import Doom, remove_checkpoint, remove_own_dir
from detslurm.controller.submit import ACTIVE_RUN
from detslurm.errors import StateError
from detslurm.expconf.view import merge_config
from detslurm.identity import Scope, os_user
from detslurm.protocol import ControlRecord, RunPaths
from detslurm.slurm.parse import experiment_tag
from detslurm.store import Store
from detslurm.store.models import Checkpoint, Experiment, ExperimentState, RunState, Trial, TrialRun, TrialState
from detslurm.views import get_experiment, get_trial

log = logging.getLogger("detslurm.ops")


def _get(s: Session, exp_id: int, scope: Scope | None) -> Experiment:
    return get_experiment(s, exp_id, scope or Scope.mine())


def _driven(s: Session, exp_id: int, scope: Scope | None) -> Experiment:
    """An experiment detslurm runs. A detached one (the user's own script, recorded through
    core_v2) has no controller to carry out a state change: refused, saying what works."""
    exp = _get(s, exp_id, scope)
    if exp.executor == "detached":
        raise StateError(
            f"experiment {exp_id} is detached (your own script using core_v2): detslurm records it but does "
            "not run it; stop its job with scancel, and requeue or rerun the script to continue it"
        )
    return exp


def pause(store: Store, exp_id: int, scope: Scope | None = None) -> None:
    """Pause an active experiment (``scope`` None: the caller's own experiments)."""
    with store.tx() as s:
        exp = _driven(s, exp_id, scope)
        st = exp.state
        # Idempotent, as Determined's pause: a second `det e pause` (or a retry) is not an error.
        if st == ExperimentState.PAUSED:
            return
        if st != ExperimentState.ACTIVE:
            raise StateError(f"experiment {exp_id} is in incompatible state {st.value}")
        # Only the row changes here: the controller's next tick asks the running trials to
        # checkpoint and stop (preemption), so no Slurm call happens in the CLI.
        exp.state = ExperimentState.PAUSED


def activate(store: Store, exp_id: int, scope: Scope | None = None) -> None:
    """Resume a paused experiment; its owner's daemon (or local driver) submits its trials."""
    with store.tx() as s:
        exp = _driven(s, exp_id, scope)
        st = exp.state
        if st == ExperimentState.ACTIVE:
            return
        if st != ExperimentState.PAUSED:
            raise StateError(f"experiment {exp_id} is in incompatible state {st.value}")
        exp.state = ExperimentState.ACTIVE


def cancel(store: Store, exp_id: int, scope: Scope | None = None) -> None:
    """Stop an experiment, letting its trials checkpoint first (Determined's cancel)."""
    with store.tx() as s:
        exp = _driven(s, exp_id, scope)
        st = exp.state
        # A cancel never downgrades a kill already in progress (a stopping state stays as it is).
        if st.is_terminal or st.is_stopping:
            return
        exp.state = ExperimentState.STOPPING_CANCELED


def kill(store: Store, exp_id: int, scope: Scope | None = None) -> None:
    """Stop an experiment now: its jobs are cancelled without waiting for checkpoints."""
    with store.tx() as s:
        exp = _driven(s, exp_id, scope)
        st = exp.state
        # A kill does override a cancel in progress: the user wants it gone now, without waiting
        # for the checkpoints a cancel lets the trials write.
        if st.is_terminal or st == ExperimentState.STOPPING_KILLED:
            return
        exp.state = ExperimentState.STOPPING_KILLED
        # The trials too, in this transaction (the next tick would do it): a job that `det e kill`
        # cancels at once must read as our kill when the controller sees it end, not as an scancel
        # from outside detslurm.
        for t in exp.trials:
            if not t.state.is_terminal:
                t.state = TrialState.STOPPING_KILLED


class Canceller(Protocol):
    """What `det e kill/pause` needs from the executor to reach queued jobs at once."""

    def kill_many(self, job_ids: Sequence[str]) -> None: ...

    def cancel_pending(self, job_ids: Sequence[str]) -> None: ...


def kill_jobs_now(
    store: Store, exp_id: int, canceller: Canceller, scope: Scope | None = None, trial_id: int | None = None
) -> list[str]:
    """After :func:`kill` (or :func:`kill_trial`, given ``trial_id``): cancel the live jobs of
    the killed trials now, in one call, instead of waiting for the next tick. Only the owner's
    process touches the jobs (root's --all-users changes rows; the owner's daemon cancels)."""
    with store.read() as s:
        exp = _get(s, exp_id, scope)
        if exp.owner != os_user():
            return []
        # Only trials marked killed: a kill that found the trial already ended leaves nothing to do.
        killed = [t for t in exp.trials if t.state == TrialState.STOPPING_KILLED and trial_id in (None, t.id)]
        jobs = [r.job_id for t in killed for r in t.runs if r.state in ACTIVE_RUN and r.job_id]
    if jobs:
        canceller.kill_many(jobs)
    return jobs


def cancel_queued_now(store: Store, exp_id: int, canceller: Canceller, scope: Scope | None = None) -> list[str]:
    """After :func:`pause`: jobs still waiting in the queue are canceled at once (Determined
    kills an allocation that has not started yet); running ones get the control file at the next
    tick and checkpoint. The runs are marked first, so the controller reads their end as this
    pause (no restart spent) and not as someone's scancel."""
    with store.tx() as s:
        exp = _get(s, exp_id, scope)
        if exp.owner != os_user() or exp.state != ExperimentState.PAUSED:
            return []
        runs = [r for t in exp.trials for r in t.runs if r.state == RunState.QUEUED and r.job_id]
        for r in runs:
            r.exit_reason = ExitCause.CANCELED_BY_DETSLURM.value
        jobs = [str(r.job_id) for r in runs]
    if not jobs:
        return []
    try:
        # --state=PENDING on Slurm's side: a job that started since the last poll is left alone,
        # and it sees the pause in its control file instead.
        canceller.cancel_pending(jobs)
    except Exception:
        _unmark(store, jobs)
        raise
    return jobs


def _unmark(store: Store, jobs: list[str]) -> None:
    """The cancel did not reach Slurm: the runs are ordinary queued runs again."""
    with store.tx() as s:
        q = select(TrialRun).where(TrialRun.job_id.in_(jobs)).where(TrialRun.state == RunState.QUEUED)
        for r in s.scalars(q):
            if r.exit_reason == ExitCause.CANCELED_BY_DETSLURM.value:
                r.exit_reason = None


def kill_trial(store: Store, trial_id: int, scope: Scope | None = None) -> None:
    """Stop one trial now; the searcher sees it as ended early."""
    with store.tx() as s:
        t: Trial = get_trial(s, trial_id, scope or Scope.mine())
        _driven(s, t.experiment_id, scope)
        if t.state.is_terminal:
            return
        t.state = TrialState.STOPPING_KILLED


def delete(store: Store, exp_id: int, scope: Scope | None = None) -> None:
    """Delete an ended experiment: its rows in one transaction, then (after the commit, so a big
    tree on NFS never holds the store's write lock) its checkpoints and its dir.

    Only ``<storage base>/<uuid>`` is removed for a checkpoint, never the path the trial
    reported. Only the owner deletes: root's --all-users would otherwise remove, as
    root, directories named by rows that anyone with the database password can edit."""
    with store.tx() as s:
        exp = _get(s, exp_id, scope)
        if exp.owner != os_user():
            raise StateError(f"experiment {exp_id} belongs to {exp.owner}; only its owner can delete it and its files")
        if not exp.state.is_terminal:
            raise StateError(f"experiment {exp_id} is {exp.state}; kill it or wait for it to end before deleting")
        # A terminal experiment may still have a job Slurm has not ended yet (a kill just issued):
        # deleting its dir now would pull files from under a running process.
        busy = [r for t in exp.trials for r in t.runs if r.state in (RunState.QUEUED, RunState.RUNNING)]
        if busy:
            raise StateError(f"experiment {exp_id} still has running trial runs")
        q = select(Checkpoint).join(Trial).where(Trial.experiment_id == exp.id)
        # Collected inside the transaction (the rows and the run dirs holding the keys are gone
        # after it), removed after the commit.
        doom = Doom(s, exp)
        dirs = [d for ck in s.scalars(q) if (d := doom(ck)) is not None]
        exp_dir = Path(exp.exp_dir)
        s.delete(exp)
    for d in dirs:
        remove_checkpoint(d)
    remove_own_dir(exp_dir)


def move_to_pool(store: Store, exp_id: int, pool: str, *, tag: str, scope: Scope | None = None) -> None:
    """Move an experiment to another resource pool: later submissions go there, and its running
    trials checkpoint and stop (the controller resubmits them in the new pool).

    ``tag`` comes from the Slurm job the user named. Job comments carry only a store-local
    experiment id, so the id is trusted only when the tag says the job was submitted from this
    experiment's dir: another store's (or another user's) experiment with the same id is left
    alone.
    """
    with store.tx() as s:
        exp = _tagged(s, exp_id, tag, scope)
        running = _set_pool(exp, pool)
    _preempt(running)


def replace_queued_job(
    store: Store,
    exp_id: int,
    pool: str,
    job_id: str,
    *,
    tag: str,
    cancel_pending: Callable[[Sequence[str]], None],
    scope: Scope | None = None,
) -> None:
    """:func:`move_to_pool`, and the queued job ``job_id`` of one of its trials canceled while
    still pending, so that the controller resubmits the trial in the new pool: for what
    `scontrol update` cannot change on a pending job. The run is marked first, as a pause marks
    them, so its end reads as detslurm's own cancel of a job that never ran (no restart spent);
    if the cancel does not reach Slurm, the run and the experiment are as they were."""
    with store.tx() as s:
        exp = _tagged(s, exp_id, tag, scope)
        if exp.owner != os_user():
            raise StateError(f"experiment {exp_id} belongs to {exp.owner}; only its owner's det cancels its jobs")
        run = next((r for t in exp.trials for r in t.runs if r.job_id == job_id), None)
        if run is None or run.state != RunState.QUEUED:
            raise StateError(
                f"job {job_id} is not a queued run of experiment {exp_id} (it may have started since); nothing changed"
            )
        config, old_pool = exp.config, exp.resource_pool
        running = _set_pool(exp, pool)
        run.exit_reason = ExitCause.CANCELED_BY_DETSLURM.value
    try:
        cancel_pending([job_id])
    except Exception:
        with store.tx() as s:
            exp = _tagged(s, exp_id, tag, scope)
            exp.config, exp.resource_pool = config, old_pool
        _unmark(store, [job_id])
        raise
    _preempt(running)


def _tagged(s: Session, exp_id: int, tag: str, scope: Scope | None) -> Experiment:
    """The experiment whose dir the job comment's ``tag`` names (see :func:`move_to_pool`)."""
    exp = s.get(Experiment, exp_id)
    if exp is None or not (scope or Scope.mine()).sees(exp.owner):
        raise StateError(f"experiment {exp_id} is not in your detslurm store, so it was not moved")
    if tag != experiment_tag(exp.exp_dir):
        raise StateError(
            f"the job is not a trial of experiment {exp_id} of this detslurm store (its comment's tag "
            f"{tag or '(none)'} does not match); it was submitted from another store, so its experiment "
            "was not moved"
        )
    return exp


def _set_pool(exp: Experiment, pool: str) -> list[Path]:
    """Set the experiment's pool; the run dirs of its running trials, to preempt after the commit."""
    # A fresh dict: the JSON column notices a reassignment, not an in-place edit.
    exp.config = merge_config(exp.config, {"resources": {"resource_pool": pool}})
    exp.resource_pool = pool
    if exp.owner != os_user():
        # Root moving another user's experiment (--all-users) changes its rows only: writing
        # files as root into run dirs named by editable rows is not safe. Its running trials
        # move when they next restart.
        log.warning("experiment %d belongs to %s: its running trials were not preempted", exp.id, exp.owner)
        return []
    return [Path(r.run_dir) for t in exp.trials for r in t.runs if r.state == RunState.RUNNING]


def _preempt(run_dirs: list[Path]) -> None:
    for run_dir in run_dirs:
        # Written after the commit: the trial checkpoints and exits, and the controller resubmits it
        # with the new pool read from the updated config; it is a preemption, not a failure.
        ControlRecord(preempt=True, reason="pool_move").write(RunPaths.from_run_dir(run_dir).control)
