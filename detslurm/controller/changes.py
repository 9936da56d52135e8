"""What changed since the last tick: the memory that lets a tick cost what changed, not size.

A tick used to load every trial and run, open every run's event files and rebuild the
searcher, whatever had happened. This module remembers, between ticks of one controller:

* per run, the scheduler's last answer and a stamp of its event files (the events dir's inode
  and mtime, each known file's inode and size): a run whose answer and stamp are both the same
  as after its last successful reconcile has nothing to ingest or decide, and is not touched;
* per experiment, a fingerprint of the rows other writers change (``det e pause``, ``det t
  kill``, edits: states, configs, searcher state, ops): an experiment with no changed run and
  the same fingerprint as the end of its last full step needs no transitions, file sync or
  submission.

It is only a cache. The store, the experiment dirs and Slurm stay the truth: a new controller
(a restarted daemon) starts with empty memory and does one full tick, and a full tick runs
anyway every ``FULL_EVERY_S`` as a backstop against anything a stamp cannot see.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import String, Text, select, type_coerce
from sqlalchemy.orm import Session

from detslurm.controller.executor import JobStatus
from detslurm.protocol import RunPaths, SearcherOps
from detslurm.protocol.paths import EVENTS_DIR
from detslurm.store.models import Experiment, Trial, TrialRun

# A full tick at least this often, whatever the stamps say: cheap insurance against a change a
# stamp cannot show (a file rewritten in place to the same size, a dir changed within one mtime
# tick on a coarse-clock file server).
FULL_EVERY_S = 300.0
# A directory modified this recently may change again within the same mtime tick (1 s on some
# file servers): its listing is not trusted until it has been quiet this long.
RACY_S = 2.0

# (inode, mtime ns) of the events dir, then (name, inode, size) of each event file; None when
# the dir does not exist yet.
Stamp = tuple[tuple[int, int], tuple[tuple[str, int, int], ...]] | None


@dataclass(frozen=True)
class RunMark:
    """A run as its last successful reconcile left it."""

    status: JobStatus | None
    stamp: Stamp


def stamp_events(run_dir: str, last: Stamp = None, clock: Callable[[], float] = time.time) -> Stamp:
    """The events dir's stamp: stats only, nothing is opened. The dir is listed again only
    when it changed since ``last`` (the run's previous stamp) or may still change unseen."""
    # Plain strings, not pathlib: this runs for every active run on every tick. The name is
    # protocol's constant, so the two sides still cannot drift.
    events = os.path.join(run_dir, EVENTS_DIR)
    try:
        st = os.stat(events)
    except (FileNotFoundError, NotADirectoryError):
        return None
    here = (st.st_ino, st.st_mtime_ns)
    racy = abs(clock() - st.st_mtime_ns / 1e9) < RACY_S
    if last is not None and last[0] == here and not racy:
        names = [f[0] for f in last[1]]
    else:
        names = [p.name for p in RunPaths.from_run_dir(Path(run_dir)).event_files()]
    files: list[tuple[str, int, int]] = []
    for name in names:
        try:
            f = os.stat(os.path.join(events, name))
        except OSError:
            continue  # gone since the listing: the dir's mtime moved too
        files.append((name, f.st_ino, f.st_size))
    return here, tuple(files)


def experiment_fingerprint(s: Session, exp_id: int) -> str:
    """A digest of what other writers change in an experiment's rows (compared, never shown).
    JSON columns are read as their stored text: nothing is decoded."""
    h = hashlib.blake2b(digest_size=16)
    # Core rows on the session's connection, enums as their stored text: the ORM's row
    # processing would cost more than the rest of an idle tick.
    conn = s.connection()
    exp = conn.execute(
        select(
            type_coerce(Experiment.state, String),
            Experiment.archived,
            Experiment.resource_pool,
            type_coerce(Experiment.config, Text),
            type_coerce(Experiment.searcher_state, Text),
        ).where(Experiment.id == exp_id)
    ).one_or_none()
    h.update(repr(tuple(exp) if exp is not None else None).encode())
    trials = select(
        Trial.id,
        type_coerce(Trial.state, String),
        Trial.early_stopped,
        Trial.restarts,
        Trial.run_count,
        Trial.ops_completed,
        Trial.ops_closed,
        Trial.ops_idle,
        type_coerce(Trial.searcher_ops, Text),
        Trial.searcher_metric,
        Trial.latest_checkpoint,
        Trial.exit_reason,
    ).where(Trial.experiment_id == exp_id)
    # Rows as plain tuples: a Row's own repr costs ten times more.
    h.update(repr([tuple(r) for r in conn.execute(trials.order_by(Trial.id))]).encode())
    runs = (
        select(TrialRun.id, type_coerce(TrialRun.state, String), TrialRun.job_id, TrialRun.exit_reason)
        .join(Trial)
        .where(Trial.experiment_id == exp_id)
        .where(~TrialRun.state.in_(["EXITED", "LOST"]))
        .order_by(TrialRun.id)
    )
    h.update(repr([tuple(r) for r in conn.execute(runs)]).encode())
    return h.hexdigest()


@dataclass
class TickMemory:
    """Run marks and experiment fingerprints of one controller (see the module doc)."""

    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    runs: dict[int, RunMark] = field(default_factory=dict)
    # exp id -> fingerprint after its last full step, when that step left it unchanged.
    steady: dict[int, str] = field(default_factory=dict)
    last_full: float = float("-inf")
    # What the ops and best-validation files were last written (or read back) as: a full step
    # rewrites only those that differ, and reads none that it wrote itself.
    ops_files: dict[int, SearcherOps] = field(default_factory=dict)
    best_files: dict[int, float] = field(default_factory=dict)

    def full_due(self) -> bool:
        """Whether this tick must be a full one (the periodic backstop); resets the timer."""
        now = self.clock()
        if now - self.last_full >= FULL_EVERY_S:
            self.last_full = now
            self.runs.clear()
            self.steady.clear()
            self.ops_files.clear()
            self.best_files.clear()
            return True
        return False

    def stamp(self, run_pk: int, run_dir: str) -> Stamp:
        old = self.runs.get(run_pk)
        return stamp_events(run_dir, old.stamp if old else None, self.wall)

    def unchanged(self, run_pk: int, status: JobStatus | None, stamp: Stamp) -> bool:
        old = self.runs.get(run_pk)
        return old is not None and old.status == status and old.stamp == stamp

    def remember(self, run_pk: int, status: JobStatus | None, stamp: Stamp) -> None:
        self.runs[run_pk] = RunMark(status, stamp)

    def forget(self, run_pks: Iterable[int]) -> None:
        for pk in run_pks:
            self.runs.pop(pk, None)

    def forget_experiment(self, exp_id: int) -> None:
        self.steady.pop(exp_id, None)
