"""A step's experiment-level state: what the experiment's state asks of its trials.

A pause parks idle trials and an activation resumes them; a stopping experiment (canceled,
killed, failing, its search done) stops its trials, killing the jobs of those killed; trials
whose work is done end; once nothing of the experiment is live, it ends too, and its
checkpoints are garbage collected by its policy (gc.py).
"""

from __future__ import annotations

import functools

from sqlalchemy import select
from sqlalchemy.orm import Session

from detslurm.controller.changes import TickMemory, trials_to_step
from detslurm.controller.decide import finish_trial, ops_done
from detslurm.controller.executor import Executor
from detslurm.controller.gc import Doomed, collect_garbage, remove_dirs
from detslurm.controller.reconcile import load_searcher, trial_work
from detslurm.controller.submit import ACTIVE_RUN
from detslurm.searcher import SearchMethod
from detslurm.store import Store
from detslurm.store.models import Experiment, ExperimentState, Trial, TrialRun, TrialState, utcnow

_FINAL = {
    ExperimentState.STOPPING_CANCELED: ExperimentState.CANCELED,
    ExperimentState.STOPPING_KILLED: ExperimentState.CANCELED,
    ExperimentState.STOPPING_COMPLETED: ExperimentState.COMPLETED,
    ExperimentState.STOPPING_ERROR: ExperimentState.ERROR,
}
# What a stopping experiment asks of each of its live trials.
_STOPPING_TARGET = {
    ExperimentState.STOPPING_CANCELED: TrialState.STOPPING_CANCELED,
    ExperimentState.STOPPING_COMPLETED: TrialState.STOPPING_CANCELED,
    ExperimentState.STOPPING_KILLED: TrialState.STOPPING_KILLED,
    ExperimentState.STOPPING_ERROR: TrialState.STOPPING_ERROR,
}


def kill_stopping(store: Store, executor: Executor, exp_id: int) -> None:
    with store.tx() as s:
        q = (
            select(TrialRun.job_id)
            .join(Trial)
            .where(Trial.experiment_id == exp_id)
            .where(TrialRun.state.in_(ACTIVE_RUN))
            # A failing experiment's trials are killed too, as Determined kills them: asked to
            # checkpoint, a script that ignores preemption would keep it STOPPING_ERROR for hours.
            .where(Trial.state.in_((TrialState.STOPPING_KILLED, TrialState.STOPPING_ERROR)))
        )
        jobs = [j for j in s.scalars(q) if j]
    if jobs:
        executor.kill_many(jobs)  # one scancel for all of them


def transitions(store: Store, memory: TickMemory, exp_id: int, only: frozenset[int] | None) -> None:
    """Trial transitions for the trials in ``only`` (None: all), then the experiment's end."""
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None, f"experiment {exp_id} vanished during a tick"
        # Loaded only when a trial ends (most steps end none): at 10,000 trials its state is large.
        searcher = _OnDemand(exp, memory)
        state = exp.state
        for t in trials_to_step(s, exp, only):
            busy = any(r.state in ACTIVE_RUN for r in t.runs)
            _trial_transition(s, exp, state, t, busy, searcher)
        s.flush()
        if not _any_live(s, exp_id):
            final = _FINAL.get(state)
            if final is None and state == ExperimentState.ACTIVE and searcher().book.shut_down:
                final = ExperimentState.COMPLETED
            if final is not None:
                exp.state = final
                exp.end_time = utcnow()
                # An experiment that failed or was canceled shows how far it got: its trials'
                # ends since the last reconcile (a kill, a stop) count as they are now.
                done = final == ExperimentState.COMPLETED
                exp.progress = 1.0 if done else searcher().progress(functools.partial(trial_work, s, exp_id))
        kept = searcher.loaded
        if kept is not None:
            exp.searcher_state = saved = kept.state_dict()
    if kept is not None:
        memory.keep_searcher(exp_id, kept, saved, exp.config)  # committed
    doomed: list[Doomed] = []
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None, f"experiment {exp_id} vanished during a tick"
        if exp.state.is_terminal:
            doomed = collect_garbage(s, exp)
    remove_dirs(doomed)


class _OnDemand:
    """The experiment's searcher, taken from the memory (or the store) on first use."""

    def __init__(self, exp: Experiment, memory: TickMemory) -> None:
        self.exp = exp
        self.memory = memory
        self.loaded: SearchMethod | None = None

    def __call__(self) -> SearchMethod:
        if self.loaded is None:
            self.loaded = self.memory.take_searcher(self.exp, load_searcher)
        return self.loaded


def _trial_transition(
    s: Session, exp: Experiment, state: ExperimentState, t: Trial, busy: bool, searcher: _OnDemand
) -> None:
    ts = t.state
    if ts.is_terminal:
        return
    if state in _STOPPING_TARGET:
        target = _STOPPING_TARGET[state]
        if busy:
            if ts != TrialState.STOPPING_KILLED:
                t.state = target
        else:
            final = TrialState.ERROR if target == TrialState.STOPPING_ERROR else TrialState.CANCELED
            finish_trial(s, exp, t, final, searcher(), "USER_CANCELED")
    elif ts in (TrialState.STOPPING_KILLED, TrialState.STOPPING_CANCELED) and not busy:
        finish_trial(s, exp, t, TrialState.CANCELED, searcher(), "USER_CANCELED", "trial killed")
    elif state == ExperimentState.PAUSED and ts == TrialState.ACTIVE and not busy:
        t.state = TrialState.PAUSED
    elif state == ExperimentState.ACTIVE and ts == TrialState.PAUSED:
        t.state = TrialState.ACTIVE
    elif not busy and (ops_done(t) or t.early_stopped):
        finish_trial(s, exp, t, TrialState.COMPLETED, searcher())


def _any_live(s: Session, exp_id: int) -> bool:
    """Whether a trial of the experiment has not ended, or a run of it is still active: two
    indexed queries that stop at the first row, instead of walking every trial."""
    ended = [st for st in TrialState if st.is_terminal]
    trial = select(Trial.id).where(Trial.experiment_id == exp_id).where(Trial.state.not_in(ended)).limit(1)
    if s.scalar(trial) is not None:
        return True
    run = select(TrialRun.id).join(Trial).where(Trial.experiment_id == exp_id).where(TrialRun.state.in_(ACTIVE_RUN))
    return s.scalar(run.limit(1)) is not None
