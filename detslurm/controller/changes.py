"""What changed since the last tick: the memory that lets a tick cost what changed, not size.

A tick used to load every trial and run, open every run's event files and rebuild the
searcher, whatever had happened. This module remembers, between ticks of one controller:

* per run, the scheduler's last answer and a stamp of its event files (the events dir's inode
  and mtime, each known file's inode and size): a run whose answer and stamp are both the same
  as after its last successful reconcile has nothing to ingest or decide, and is not touched;
* per experiment, a snapshot of the rows other writers change (``det e pause``, ``det t
  kill``, edits: states, configs, searcher state, ops), one entry per trial, as the last step
  began: the next step walks only the trials whose rows (or runs) differ from it, all of them
  only when the experiment's own row changed, and none when nothing did.

A step's own writes (a trial finished, a run submitted) show as differences at the next tick,
which looks at those trials again: every trial the snapshot holds has been stepped with those
very rows.

It is only a cache. The store, the experiment dirs and Slurm stay the truth: a new controller
(a restarted daemon) starts with empty memory and does one full tick, and a full tick runs
anyway every ``FULL_EVERY_S`` as a backstop against anything a stamp cannot see.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import String, Text, select, type_coerce
from sqlalchemy.orm import Session

from detslurm.controller.executor import JobStatus
from detslurm.protocol import RunPaths, SearcherOps
from detslurm.protocol.paths import EVENTS_DIR
from detslurm.searcher import SearchMethod
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
    except OSError:  # none yet, or a loop or a mode the trial left there: no events to see
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


# A row as plain values (a Row's own comparison and repr cost more than a tuple's).
Values = tuple[Any, ...]


@dataclass(frozen=True)
class Changes:
    """Which trials an experiment's step must look at: ``everything`` after a change of the
    experiment's own row (a pause touches every trial), else only ``trials``; ``any`` is false
    when nothing the step reads changed at all."""

    everything: bool
    trials: frozenset[int] = frozenset()
    searcher: bool = False

    @property
    def any(self) -> bool:
        return self.everything or bool(self.trials) or self.searcher

    @property
    def only(self) -> frozenset[int] | None:
        """The trials to walk, or None for all of them."""
        return None if self.everything else self.trials


EVERYTHING = Changes(everything=True)


@dataclass(frozen=True)
class ExperimentSnapshot:
    """What other writers (and the step's own writes) change in an experiment's rows, kept per
    trial so that a step can walk only the trials that changed. JSON columns are read as their
    stored text: nothing is decoded."""

    experiment: Values | None
    searcher: str | None
    trials: dict[int, Values]
    # trial id -> its runs that have not ended, in id order.
    runs: dict[int, tuple[Values, ...]]

    @classmethod
    def take(cls, s: Session, exp_id: int) -> ExperimentSnapshot:
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
        runs = (
            select(TrialRun.trial_id, TrialRun.id, type_coerce(TrialRun.state, String), TrialRun.job_id)
            .add_columns(TrialRun.exit_reason)
            .join(Trial)
            .where(Trial.experiment_id == exp_id)
            .where(~TrialRun.state.in_(["EXITED", "LOST"]))
            .order_by(TrialRun.id)
        )
        by_trial: dict[int, tuple[Values, ...]] = {}
        for r in conn.execute(runs):
            row = tuple(r)
            by_trial[row[0]] = by_trial.get(row[0], ()) + (row,)
        return cls(
            experiment=tuple(exp[:4]) if exp is not None else None,
            searcher=exp[4] if exp is not None else None,
            trials={r[0]: tuple(r) for r in conn.execute(trials)},
            runs=by_trial,
        )

    def changes_since(self, old: ExperimentSnapshot | None) -> Changes:
        """What changed since ``old`` (None: unknown, so everything)."""
        if old is None or old.experiment != self.experiment:
            return EVERYTHING
        # New and changed trials, trials whose runs changed, and those whose last run ended;
        # a trial that is gone has nothing left to step.
        trials = {t for t, v in self.trials.items() if old.trials.get(t) != v}
        trials.update(t for t, v in self.runs.items() if old.runs.get(t) != v)
        trials.update(t for t in old.runs if t not in self.runs and t in self.trials)
        return Changes(everything=False, trials=frozenset(trials), searcher=self.searcher != old.searcher)


@dataclass(frozen=True)
class KeptSearcher:
    """A searcher as the last committed transaction left it, with the state and config that
    transaction read or wrote (as the store gives them back: decoded JSON)."""

    searcher: SearchMethod
    state: Any
    config: Any


@dataclass
class TickMemory:
    """Run marks and experiment fingerprints of one controller (see the module doc)."""

    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    runs: dict[int, RunMark] = field(default_factory=dict)
    # exp id -> its rows as its last step began (that step looked at every change before it).
    snapshots: dict[int, ExperimentSnapshot] = field(default_factory=dict)
    last_full: float = float("-inf")
    # What the ops and best-validation files were last written (or read back) as: a full step
    # rewrites only those that differ, and reads none that it wrote itself.
    ops_files: dict[int, SearcherOps] = field(default_factory=dict)
    best_files: dict[int, float] = field(default_factory=dict)
    # exp id -> its searcher, so that a step does not rebuild it (a 10,000-point grid) for one event.
    searchers: dict[int, KeptSearcher] = field(default_factory=dict)

    def full_due(self) -> bool:
        """Whether this tick must be a full one (the periodic backstop); resets the timer."""
        now = self.clock()
        if now - self.last_full >= FULL_EVERY_S:
            self.last_full = now
            self.runs.clear()
            self.snapshots.clear()
            self.ops_files.clear()
            self.best_files.clear()
            self.searchers.clear()
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
        self.snapshots.pop(exp_id, None)
        self.searchers.pop(exp_id, None)

    def take_searcher(self, exp: Experiment, load: Callable[[Experiment], SearchMethod]) -> SearchMethod:
        """The experiment's searcher: the kept one if the store still holds the state and config
        it was kept with (nobody else wrote them since), else loaded afresh. Taken out of the
        memory: a transaction that fails after changing it must not leave it there."""
        kept = self.searchers.pop(exp.id, None)
        if kept is not None and kept.state == exp.searcher_state and kept.config == exp.config:
            return kept.searcher
        return load(exp)

    def keep_searcher(self, exp_id: int, searcher: SearchMethod, state: dict[str, Any], config: Any) -> None:
        """After the commit of the transaction that used ``searcher`` and stored ``state``."""
        # As the store will give it back (lists for tuples, string keys), and never sharing a
        # list with the searcher, which changes its own lists in place.
        self.searchers[exp_id] = KeptSearcher(searcher, json.loads(json.dumps(state)), config)


# Above this many changed trials one query for all of the experiment's trials is cheaper than
# an IN list (and stays below every database's limit on bound parameters).
MAX_LISTED_TRIALS = 500


def trials_to_step(s: Session, exp: Experiment, only: frozenset[int] | None) -> Iterable[Trial]:
    """The experiment's trials in id order (the order every step has always used), or only
    those in ``only``; their runs come with them in one more query (``Trial.runs`` is selectin)."""
    if only is None:
        # The ORM collection itself: a trial the searcher creates during the walk is walked too.
        return exp.trials
    if len(only) > MAX_LISTED_TRIALS:
        return [t for t in exp.trials if t.id in only]
    if not only:
        return []
    return list(s.scalars(select(Trial).where(Trial.id.in_(sorted(only))).order_by(Trial.id)))
