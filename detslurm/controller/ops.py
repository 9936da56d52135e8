"""User operations on experiments and trials: state changes the controller then carries out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from detslurm.errors import NotFoundError, StateError
from detslurm.identity import os_user
from detslurm.protocol import ControlRecord, RunPaths
from detslurm.slurm.parse import experiment_tag
from detslurm.store import Store
from detslurm.store.models import Experiment, ExperimentState, RunState, Trial, TrialState


def _own(exp: Experiment) -> None:
    me = os_user()
    if exp.owner != me and me != "root":
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


def move_to_pool(store: Store, exp_id: int, pool: str, *, tag: str) -> None:
    """Move an experiment to another resource pool: later submissions go there, and its running
    trials checkpoint and stop (the controller resubmits them in the new pool).

    ``tag`` comes from the Slurm job the user named. Job comments carry only a store-local
    experiment id, so the id is trusted only when the tag says the job was submitted from this
    experiment's dir: another store's (or another user's) experiment with the same id is left
    alone (security review L4).
    """
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        if exp is None:
            raise StateError(f"experiment {exp_id} is not in your detslurm store, so it was not moved")
        if tag != experiment_tag(exp.exp_dir):
            raise StateError(
                f"the job is not a trial of experiment {exp_id} of this detslurm store (its comment's tag "
                f"{tag or '(none)'} does not match); it was submitted from another store, so its experiment "
                "was not moved"
            )
        _own(exp)
        # A fresh dict: the JSON column notices a reassignment, not an in-place edit.
        cfg = json.loads(json.dumps(exp.config))
        cfg["resources"]["resource_pool"] = pool
        exp.config = cfg
        exp.resource_pool = pool
        running = [Path(r.run_dir) for t in exp.trials for r in t.runs if r.state == RunState.RUNNING.value]
    for run_dir in running:
        ControlRecord(preempt=True, reason="pool_move").write(RunPaths.from_run_dir(run_dir).control)
