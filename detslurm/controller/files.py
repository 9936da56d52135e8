"""Files the trials read, written by the controller's step: searcher ops, the experiment's best
validation, and the control file that asks a run to stop (pause, cancel, kill, early stop).

A step writes them only for the trials it walks (those whose rows changed, see changes.py):
what a trial reads depends only on its own row, its runs and the experiment's state.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from detslurm.controller.changes import TickMemory, trials_to_step
from detslurm.controller.config import stored_config
from detslurm.controller.submit import ACTIVE_RUN
from detslurm.protocol import BadRecord, BestValidation, ControlRecord, ExpPaths, RunPaths, SearcherOps
from detslurm.store.models import Experiment, ExperimentState, Trial, TrialState


def sync_files(s: Session, exp: Experiment, only: frozenset[int] | None, memory: TickMemory) -> None:
    """Write what the trials in ``only`` (None: all) should read, and the best validation.

    Ops and best-validation files are not fsynced: a step rewrites them from the store whenever
    they differ. (The control file is written once, so it is.)"""
    layout = ExpPaths(Path(exp.exp_dir))
    state = exp.state
    for t in trials_to_step(s, exp, only):
        if t.searcher_ops:
            _sync_ops(layout, t, memory)
        reason = stop_reason(state, t)
        for r in t.runs:
            if r.state not in ACTIVE_RUN or not reason:
                continue
            control = RunPaths.from_run_dir(Path(r.run_dir)).control
            if not control.exists():
                ControlRecord(preempt=True, reason=reason).write(control)
    best = best_metric(s, exp)
    if best is not None and memory.best_files.get(exp.id) != best:
        if _read_or_none(BestValidation.read, layout.best_validation) != BestValidation(best):
            BestValidation(best).write(layout.best_validation)
        memory.best_files[exp.id] = best


def _sync_ops(layout: ExpPaths, t: Trial, memory: TickMemory) -> None:
    want = SearcherOps(
        ops=tuple(t.searcher_ops),
        completed=t.ops_completed,
        closed=t.ops_closed,
        idle_after=t.ops_completed if t.ops_idle else -1,
    )
    # Read back only when this controller has not written it as wanted: at 10,000 trials
    # reading every ops file would be most of a full step.
    if memory.ops_files.get(t.id) != want:
        if _read_or_none(SearcherOps.read, layout.ops_file(t.id)) != want:
            want.write(layout.ops_file(t.id))
        memory.ops_files[t.id] = want


def best_metric(s: Session, exp: Experiment) -> float | None:
    """The best searcher metric of any of the experiment's trials: one aggregate, no trial loaded."""
    best = func.min if stored_config(exp).searcher.smaller_is_better else func.max
    value = s.scalar(select(best(Trial.searcher_metric)).where(Trial.experiment_id == exp.id))
    return None if value is None else float(value)


def stop_reason(state: ExperimentState, t: Trial) -> str | None:
    """Why the trial's live runs should stop now, as the control file says it; None: they run on."""
    if t.early_stopped:
        return "early_stop"
    if t.state in (TrialState.STOPPING_CANCELED, TrialState.STOPPING_ERROR):
        return "cancel"
    if t.state == TrialState.STOPPING_KILLED.value:
        # scancel normally ends the job first; while slurmctld is down the file is what still
        # reaches the trial, which then stops at its next checkpoint.
        return "kill"
    if state == ExperimentState.PAUSED:
        return "pause"
    return None


def _read_or_none(read: Callable[[Path], Any], path: Path) -> Any:
    """A record the trial side could have clobbered: unreadable counts as absent (rewritten)."""
    try:
        return read(path)
    except BadRecord:
        return None
