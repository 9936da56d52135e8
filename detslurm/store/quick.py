"""The read commands' fast path: the few queries of `det e list` (and the reconcile check every
read command makes) on a SQLite store, with the standard library's sqlite3 only.

Importing SQLAlchemy and mapping the models costs about 0.25 s of every `det` call, more than
the query it serves; `det e list` of 10k experiments has 0.3 s in all (issue 15). This module
opens the store only when its schema is already current (one SELECT of the Alembic stamp,
the same check ``Store.migrate`` makes first): an older schema, another database or a missing
file gets None, and the caller takes the ORM path, which migrates. It never writes.

The SQL here names columns of ``detslurm.store.models``; tests compare its answers with the
ORM's on the same store.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from detslurm.store.fs import warn_if_network_db

# The newest migration's revision. A test checks it against alembic's scripts; knowing it here
# lets every CLI call see an up-to-date store without importing alembic or SQLAlchemy.
HEAD_REVISION = "0003_preempt2"

# Experiment states that have ended (models.ExperimentState.is_terminal; a test keeps them equal).
TERMINAL_EXPERIMENT_STATES = ("CANCELED", "COMPLETED", "ERROR")
# The same for trials (models.TrialState.is_terminal).
TERMINAL_TRIAL_STATES = ("CANCELED", "COMPLETED", "ERROR")


class ExperimentRow(NamedTuple):
    """The columns of `det e list`."""

    id: int
    owner: str
    name: str
    parent_id: int | None
    state: str
    progress: float
    start_time: datetime | None
    end_time: datetime | None
    resource_pool: str
    archived: bool


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///`` URL; None for other databases and in-memory stores."""
    if not url.startswith("sqlite:///"):
        return None
    path = url.split("///", 1)[-1]
    # Query parameters and :memory: are left to SQLAlchemy's parsing (the ORM path).
    return None if not path or path == ":memory:" or "?" in path else Path(path)


class QuickStore:
    """A read-only sqlite3 connection to a store whose schema is current."""

    def __init__(self, con: sqlite3.Connection) -> None:
        self._con = con

    @classmethod
    def open(cls, url: str) -> QuickStore | None:
        """The store at ``url`` for fast reads, or None where the ORM path must answer."""
        path = sqlite_path(url)
        if path is None or not path.is_file():
            return None
        warn_if_network_db(path)  # the same warning open_store gives (once per process)
        try:
            # mode=ro: this path never writes, whatever a bug might ask. 30 s: the ORM's busy wait.
            con = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=30)
        except sqlite3.Error:
            return None
        try:
            row = con.execute("SELECT version_num FROM alembic_version").fetchone()
        except sqlite3.Error:  # no stamp yet (a new store) or unreadable: the ORM path says why
            row = None
        if row is None or row[0] != HEAD_REVISION:
            con.close()
            return None
        return cls(con)

    def close(self) -> None:
        self._con.close()

    def has_unfinished(self, executor: str, owner: str) -> bool:
        """``views.has_unfinished``: whether some experiment of this executor and owner has not ended."""
        marks = ",".join("?" * len(TERMINAL_EXPERIMENT_STATES))
        row = self._con.execute(
            f"SELECT 1 FROM experiments WHERE executor = ? AND owner = ? AND state NOT IN ({marks}) LIMIT 1",
            (executor, owner, *TERMINAL_EXPERIMENT_STATES),
        ).fetchone()
        return row is not None

    def trial_logs(self, trial_id: int, owner: str | None) -> tuple[list[TrialRunLog], list[TrialNote]] | None:
        """``trial_id``'s runs and notes, by run and by note id; None when there is no such
        trial of ``owner`` (any owner's for None), so that the caller reports it "not found"
        exactly as the ORM path does. Read in one transaction: a consistent view."""
        with self._con:  # BEGIN ... COMMIT around the three SELECTs
            self._con.execute("BEGIN")
            found, runs, notes = _trial_queries(self._con, trial_id)
        if found is None or (owner is not None and found != owner):
            return None
        return runs, notes

    def describe(self, exp_id: int, owner: str | None, limit: int) -> Described | None:
        """`det e describe`'s table data, each trial's last ``limit`` workloads; None where the
        ORM path must answer: no such experiment of ``owner`` (it says "not found"), or a run's
        stop time was measured (its warning needs the typed config and Slurm)."""
        with self._con:  # one read transaction: a consistent view
            self._con.execute("BEGIN")
            if _measured_stops(self._con, exp_id):
                return None
            exp, trials, work = _describe_queries(self._con, exp_id, limit)
        if exp is None or (owner is not None and exp[1] != owner):
            return None
        i, own, name, state, progress, desc, t0, t1, pool, archived, config = exp
        cfg = json.loads(config)
        # The keys views.experiment_dict gives the table (JSON columns read as SQLAlchemy reads them).
        e = {
            "id": i,
            "name": name,
            "owner": own,
            "state": state,
            "progress": float(progress),
            "description": desc,
            "start_time": _when(t0),
            "end_time": _when(t1),
            "resource_pool": pool,
            "archived": bool(archived),
            "labels": cfg.get("labels", []),
        }
        shown = [
            DescribedTrial(
                tid,
                eid,
                st,
                json.loads(hp),
                _when(a),
                _when(b),
                why,
                runner,
                bool(q) and st not in TERMINAL_TRIAL_STATES,
            )
            for tid, eid, st, hp, a, b, why, runner, q in trials
        ]
        workloads = {
            tid: (
                [Workload(step, group, _when(at), json.loads(m)) for step, group, at, m in rows[:limit]][::-1],
                len(rows) > limit,
            )
            for tid, rows in work.items()
        }
        return Described(e, (cfg.get("searcher") or {}).get("metric"), shown, workloads)

    def experiment_names(self, ids: set[int], owner: str | None) -> dict[int, tuple[str, str]]:
        """id -> (name, experiment dir) of ``owner``'s experiments among ``ids`` (`det job list`)."""
        out: dict[int, tuple[str, str]] = {}
        wanted = sorted(ids)
        # In slices: SQLite allows a bounded number of parameters in one statement.
        for k in range(0, len(wanted), 500):
            part = wanted[k : k + 500]
            sql = f"SELECT id, name, exp_dir FROM experiments WHERE id IN ({','.join('?' * len(part))})"
            args: list[object] = list(part)
            if owner is not None:
                sql += " AND owner = ?"
                args.append(owner)
            out.update({i: (n, d) for i, n, d in self._con.execute(sql, args)})
        return out

    def detached_runs(self, job_ids: list[str], owner: str | None) -> list[tuple[str | None, int, int, str]]:
        """(job id, trial id, experiment id, experiment name) of ``owner``'s detached runs with
        one of ``job_ids``, oldest run first (``views.detached_job_names``' query)."""
        rows: list[tuple[int, str | None, int, int, str]] = []
        for k in range(0, len(job_ids), 500):
            part = job_ids[k : k + 500]
            sql = (
                "SELECT r.id, r.job_id, t.id, e.id, e.name FROM trial_runs r JOIN trials t ON r.trial_id = t.id "
                "JOIN experiments e ON t.experiment_id = e.id WHERE r.executor = 'detached' "
                f"AND r.job_id IN ({','.join('?' * len(part))})"
            )
            args: list[object] = list(part)
            if owner is not None:
                sql += " AND e.owner = ?"
                args.append(owner)
            rows += self._con.execute(sql, args).fetchall()
        return [(job, t, e, name) for _, job, t, e, name in sorted(rows)]

    def experiment_rows(self, owner: str | None, include_archived: bool = False) -> list[ExperimentRow]:
        """``views.experiment_rows``: the listed columns of ``owner``'s experiments (every
        owner's for None, root's --all-users), by id."""
        where, args = [], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if not include_archived:
            where.append("archived = 0")
        sql = (
            "SELECT id, owner, name, parent_id, state, progress, start_time, end_time, resource_pool, archived "
            "FROM experiments" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id"
        )
        return [
            ExperimentRow(i, o, n, p, st, float(pr), _when(t0), _when(t1), pool, bool(arch))
            for i, o, n, p, st, pr, t0, t1, pool, arch in self._con.execute(sql, args)
        ]


class DescribedTrial(NamedTuple):
    """The columns of one trial in `det e describe`'s table (``views.trial_dict``'s names)."""

    id: int
    experiment_id: int
    state: str
    hparams: Any
    start_time: datetime | None
    end_time: datetime | None
    exit_reason: str | None
    runner_state: str | None
    queued: bool  # not ended, and a run waits in Slurm's queue: runner_state is its reason


class Workload(NamedTuple):
    """One metric report as `det e describe` shows it (``views.Workload``)."""

    steps_completed: int
    group: str
    report_time: datetime | None
    metrics: Any


class Described(NamedTuple):
    """What `det e describe` prints: the experiment's columns (``views.experiment_dict``'s
    names), its trials by id, and each trial's last workloads with whether it has earlier ones."""

    experiment: dict[str, Any]
    searcher_metric: Any  # the config's searcher.metric, named in the workloads' header
    trials: list[DescribedTrial]
    workloads: dict[int, tuple[list[Workload], bool]]


_EXPERIMENT_COLUMNS = (
    "id, owner, name, state, progress, description, start_time, end_time, resource_pool, archived, config"
)


def _describe_queries(con: sqlite3.Connection, exp_id: int, limit: int) -> tuple[Any, list[Any], dict[int, Any]]:
    exp = con.execute(f"SELECT {_EXPERIMENT_COLUMNS} FROM experiments WHERE id = ?", (exp_id,)).fetchone()
    trials = con.execute(
        "SELECT id, experiment_id, state, hparams, start_time, end_time, exit_reason, runner_state, "
        "EXISTS (SELECT 1 FROM trial_runs r WHERE r.trial_id = trials.id AND r.state = 'QUEUED') "
        "FROM trials WHERE experiment_id = ? ORDER BY id",
        (exp_id,),
    ).fetchall()
    work: dict[int, Any] = {}
    for t in trials:
        # views.recent_metrics' query: from the end of the (trial, step) index, one row past the limit.
        work[t[0]] = con.execute(
            'SELECT steps_completed, "group", report_time, metrics FROM metrics WHERE trial_id = ? AND archived = 0 '
            "ORDER BY steps_completed DESC, id DESC LIMIT ?",
            (t[0], max(limit, 0) + 1),
        ).fetchall()
    return exp, trials, work


def _measured_stops(con: sqlite3.Connection, exp_id: int) -> bool:
    row = con.execute(
        "SELECT 1 FROM trial_runs r JOIN trials t ON r.trial_id = t.id WHERE t.experiment_id = ? "
        "AND r.preempt_stop_s IS NOT NULL LIMIT 1",
        (exp_id,),
    ).fetchone()
    return row is not None


class TrialRunLog(NamedTuple):
    """Where one run of a trial wrote its output, and when it ran (`det t logs`)."""

    run_id: int
    log_path: str
    start: datetime | None  # its start, or its submission while it never started
    end: datetime | None


class TrialNote(NamedTuple):
    """A controller note on a trial (a trial_log_entries row)."""

    time: datetime
    level: str
    message: str


def _trial_queries(con: sqlite3.Connection, trial_id: int) -> tuple[str | None, list[TrialRunLog], list[TrialNote]]:
    row = con.execute(
        "SELECT e.owner FROM trials t JOIN experiments e ON e.id = t.experiment_id WHERE t.id = ?", (trial_id,)
    ).fetchone()
    runs = [
        TrialRunLog(r, p, _when(t0 or t1), _when(t2))
        for r, p, t0, t1, t2 in con.execute(
            "SELECT run_id, log_path, start_time, submit_time, end_time FROM trial_runs WHERE trial_id = ? "
            "ORDER BY run_id",
            (trial_id,),
        )
    ]
    notes = [
        TrialNote(_when(t) or datetime.min, level, msg)
        for t, level, msg in con.execute(
            "SELECT time, level, message FROM trial_log_entries WHERE trial_id = ? ORDER BY id", (trial_id,)
        )
    ]
    return (None if row is None else str(row[0])), runs, notes


def _when(value: str | None) -> datetime | None:
    # SQLAlchemy's SQLite DateTime stores "YYYY-MM-DD HH:MM:SS.ffffff" without an offset and reads
    # it back naive; fromisoformat gives the same naive datetime (fmt_time reads naive as UTC).
    return None if value is None else datetime.fromisoformat(value)


def experiment_filter_rows(
    rows: Sequence[ExperimentRow], *, states: Sequence[str] = (), name: str | None = None
) -> list[ExperimentRow]:
    """`det e list` filters: any of ``states``, and a name containing ``name`` (case-insensitive)."""
    wanted = {st.upper() for st in states}
    return [
        r for r in rows if (not wanted or str(r.state) in wanted) and (name is None or name.lower() in r.name.lower())
    ]
