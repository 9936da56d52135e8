"""The controller's files in the trials' dirs: what the trials read, written by the step
(searcher ops, the experiment's best validation, the control file that asks a run to stop:
pause, cancel, kill, early stop), each run's dir and secret before its submission, and the
job-id marker. The trials own those dirs: whatever one put at these names (a symlink, a FIFO,
a directory) fails that one file or run, and is never followed or waited on.

A step writes them only for the trials it walks (those whose rows changed, see changes.py):
what a trial reads depends only on its own row, its runs and the experiment's state.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from detslurm.controller.changes import TickMemory, trials_to_step
from detslurm.controller.config import stored_config
from detslurm.controller.executor import RunSpec
from detslurm.controller.submit import ACTIVE_RUN
from detslurm.protocol import BadRecord, BestValidation, ControlRecord, ExpPaths, RunPaths, SearcherOps
from detslurm.protocol.secret import RunSecretError, ensure_run_secrets
from detslurm.store.models import Experiment, ExperimentState, Trial, TrialState
from detslurm.util import atomic_write_text, open_regular

log = logging.getLogger("detslurm.controller")


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
                _written(ControlRecord(preempt=True, reason=reason), control)
    best = best_metric(s, exp)
    if best is not None and memory.best_files.get(exp.id) != best:
        current = _read_or_none(BestValidation.read, layout.best_validation)
        if current != BestValidation(best) and not _written(BestValidation(best), layout.best_validation):
            return
        memory.best_files[exp.id] = best


def _written(record: ControlRecord | BestValidation | SearcherOps, path: Path) -> bool:
    """Write ``record`` to ``path``; False, logged, when that failed. The run dirs are the trials' own: a
    directory a trial put at the name, or a dir it made unwritable, fails this one file (retried
    at the next step that needs it), never the experiment's step."""
    try:
        record.write(path)
    except OSError as e:
        log.warning("could not write %s: %s", path, e)
        return False
    return True


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
        path = layout.ops_file(t.id)
        if _read_or_none(SearcherOps.read, path) != want and not _written(want, path):
            return
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


def write_marker(path: Path, job_id: str) -> None:
    """The job id, in the run dir first: a controller killed before the store commit finds it
    there. A failed write (quota, full disk) must not fail the submission: the job exists, the
    store records it below, and a crash before that is recovered by the job's identity."""
    try:
        # Replaced by a rename, never written through: the trial owns the run dir, and a symlink
        # or a FIFO it put at this name must neither redirect nor block the write.
        atomic_write_text(path, job_id, mode=0o600, durable=False)
    except OSError as e:
        log.warning("could not write %s (%s); the store records job %s", path, e, job_id)


def read_marker(path: Path) -> str | None:
    """The job id a submission noted in its run dir, if it could (see ``write_marker``). An
    unreadable marker (the write failed half-way, a directory in its place) is no job id: the
    run is then found by its identity in the queue, never by guessing."""
    try:
        opened = open_regular(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        if opened is None:
            return None
        with opened[0] as f:
            raw = f.read(65)  # a job id is short: a longer file is no marker of ours
        if len(raw) > 64:
            return None
        text = raw.decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if re.fullmatch(r"\d+(_\d+)?", text) else None


def prepare_runs(
    specs: list[tuple[int, RunSpec]],
) -> tuple[list[tuple[int, RunSpec]], list[tuple[int, RunSpec, str | Exception]]]:
    """Each run's dir and secret, durable before sbatch (a resubmitted run keeps its checked
    secret): the runs ready to submit, and those that could not be made ready, with why. The
    run dirs are the trials' to write: what one trial left in its next run's place fails that
    run only, never the experiment's submission."""
    try:
        for _, spec in specs:
            # makedirs, not Path.mkdir(parents=True): it finds the missing levels by stat and
            # makes only those, where the latter's failed attempts cost a round trip each on NFS.
            os.makedirs(spec.run_dir, exist_ok=True)
        ensure_run_secrets([spec.run_dir for _, spec in specs])  # all at once: one batch of fsyncs
        return specs, []
    except (OSError, RunSecretError):
        pass
    ready: list[tuple[int, RunSpec]] = []
    failed: list[tuple[int, RunSpec, str | Exception]] = []
    for pk, spec in specs:
        try:
            os.makedirs(spec.run_dir, exist_ok=True)
            ensure_run_secrets([spec.run_dir])
            ready.append((pk, spec))
        except (OSError, RunSecretError) as e:
            failed.append((pk, spec, e))
    return ready, failed
