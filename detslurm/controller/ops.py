"""User operations on experiments and trials: state changes the controller then carries out."""

from __future__ import annotations

import shutil
from pathlib import Path

from detslurm.controller.controller import current_user
from detslurm.errors import NotFoundError, StateError
from detslurm.store import Store
from detslurm.store.models import Experiment, ExperimentState, RunState, Trial, TrialState


def _own(exp: Experiment) -> None:
    if exp.owner != current_user() and current_user() != "root":
        raise StateError(f"experiment {exp.id} belongs to {exp.owner}; you can only change your own experiments")


def _get(store_session: object, exp_id: int) -> Experiment:
    from sqlalchemy.orm import Session

    assert isinstance(store_session, Session)
    exp = store_session.get(Experiment, exp_id)
    if exp is None:
        raise NotFoundError("experiment", exp_id)
    _own(exp)
    return exp


def pause(store: Store, exp_id: int) -> None:
    with store.tx() as s:
        exp = _get(s, exp_id)
        st = ExperimentState(exp.state)
        if st == ExperimentState.PAUSED:
            return
        if st != ExperimentState.ACTIVE:
            raise StateError(f"experiment {exp_id} is in incompatible state {st.value}")
        exp.state = ExperimentState.PAUSED.value


def activate(store: Store, exp_id: int) -> None:
    with store.tx() as s:
        exp = _get(s, exp_id)
        st = ExperimentState(exp.state)
        if st == ExperimentState.ACTIVE:
            return
        if st != ExperimentState.PAUSED:
            raise StateError(f"experiment {exp_id} is in incompatible state {st.value}")
        exp.state = ExperimentState.ACTIVE.value


def cancel(store: Store, exp_id: int) -> None:
    with store.tx() as s:
        exp = _get(s, exp_id)
        st = ExperimentState(exp.state)
        if st.is_terminal or st.is_stopping:
            return
        exp.state = ExperimentState.STOPPING_CANCELED.value


def kill(store: Store, exp_id: int) -> None:
    with store.tx() as s:
        exp = _get(s, exp_id)
        st = ExperimentState(exp.state)
        if st.is_terminal or st == ExperimentState.STOPPING_KILLED:
            return
        exp.state = ExperimentState.STOPPING_KILLED.value


def kill_trial(store: Store, trial_id: int) -> None:
    with store.tx() as s:
        t = s.get(Trial, trial_id)
        if t is None:
            raise NotFoundError("trial", trial_id)
        _own(t.experiment)
        if TrialState(t.state).is_terminal:
            return
        t.state = TrialState.STOPPING_KILLED.value


def delete(store: Store, exp_id: int) -> None:
    with store.tx() as s:
        exp = _get(s, exp_id)
        if not ExperimentState(exp.state).is_terminal:
            raise StateError(f"experiment {exp_id} is {exp.state}; kill it or wait for it to end before deleting")
        busy = [r for t in exp.trials for r in t.runs if r.state in (RunState.QUEUED.value, RunState.RUNNING.value)]
        if busy:
            raise StateError(f"experiment {exp_id} still has running trial runs")
        from detslurm.store.models import Checkpoint

        for t in exp.trials:
            for ck in s.query(Checkpoint).filter(Checkpoint.trial_id == t.id):
                if ck.storage_path:
                    shutil.rmtree(Path(ck.storage_path), ignore_errors=True)
        exp_dir = Path(exp.exp_dir)
        s.delete(exp)
    shutil.rmtree(exp_dir, ignore_errors=True)
