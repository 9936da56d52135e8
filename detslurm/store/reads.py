"""The read layer: every question the CLI's read commands ask the store, answered by plain SQL
over the models' tables, on SQLite and PostgreSQL alike.

On a SQLite store whose schema is current (the common case: one user, one file) the SQL runs
on the standard library's sqlite3: importing SQLAlchemy and mapping the models would cost about
0.25 s of every `det` call, more than the queries. Elsewhere (PostgreSQL, a SQLite URL with
options, a store that needs migrating first) the same SQL runs on the ORM store's connection
(:meth:`Reads.of_store`), and ``views`` builds its dicts here too: one answer to each question.

The SQL names the tables and columns of ``detslurm.store.models``; tests/unit/store/test_store_reads.py
prepares every statement of :data:`SQL` against the tables the models create and compares the
answers with the ORM's rows. Nothing here writes (the sqlite3 connection is opened read-only).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from detslurm.errors import NotFoundError
from detslurm.expconf.view import ConfigView
from detslurm.store.fs import warn_if_network_db
from detslurm.store.revisions import head_revision
from detslurm.store.states import ExperimentState, RunState, TrialState

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from detslurm.store.db import Store

# One query: (sql, named parameters) -> rows as tuples.
Run = Callable[[str, Mapping[str, object]], list[tuple[Any, ...]]]

_TERMINAL_EXPERIMENT = tuple(st.value for st in ExperimentState if st.is_terminal)
_TERMINAL_TRIAL = frozenset(st.value for st in TrialState if st.is_terminal)

# Each statement once, by name. {ids} is a list of :p0, :p1, ... filled by _in(); {where} and
# {order} are filled from fixed text by the method that uses them, never from input.
_TRIAL_COLUMNS = (
    "t.id, t.experiment_id, t.state, t.hparams, t.seed, t.restarts, t.run_count, t.latest_checkpoint, "
    "t.steps_completed, t.searcher_metric, t.progress, t.start_time, t.end_time, "
    # Computed, not stored: it must agree with what `det t describe --metrics` lists (archived
    # rows excluded); read from the end of the (trial, step) index.
    "(SELECT MAX(m.steps_completed) FROM metrics m WHERE m.trial_id = t.id AND NOT m.archived), "
    "t.early_stopped, t.exit_reason, t.runner_state, "
    "EXISTS (SELECT 1 FROM trial_runs r WHERE r.trial_id = t.id AND r.state = :queued)"
)
_EXPERIMENT_COLUMNS = (
    "e.id, e.name, e.owner, e.state, e.progress, e.description, e.start_time, e.end_time, e.resource_pool, "
    "e.archived, e.config, e.executor, e.exp_dir, e.error_message, e.parent_id, e.context_sha256, e.notes"
)
SQL = {
    "revision": "SELECT version_num FROM alembic_version",
    "unfinished": "SELECT 1 FROM experiments WHERE executor = :executor AND owner = :owner "
    f"AND state NOT IN ({', '.join(f':t{j}' for j in range(len(_TERMINAL_EXPERIMENT)))}) LIMIT 1",
    # Unfinished experiments with a run not ended yet: the local ones whose driver may have died.
    "with_live_runs": "SELECT e.id, e.exp_dir FROM experiments e WHERE e.executor = :executor AND e.owner = :owner "
    f"AND e.state NOT IN ({', '.join(f':t{j}' for j in range(len(_TERMINAL_EXPERIMENT)))}) "
    "AND EXISTS (SELECT 1 FROM trial_runs r JOIN trials t ON r.trial_id = t.id WHERE t.experiment_id = e.id "
    f"AND r.state IN ({', '.join(repr(st.value) for st in RunState if not st.is_terminal)})) ORDER BY e.id",
    "experiment_rows": "SELECT id, owner, name, parent_id, state, progress, start_time, end_time, resource_pool, "
    "archived FROM experiments e WHERE {where} ORDER BY id",
    "experiments": f"SELECT {_EXPERIMENT_COLUMNS} FROM experiments e WHERE {{where}} ORDER BY e.id",
    "trials": f"SELECT {_TRIAL_COLUMNS} FROM trials t JOIN experiments e ON e.id = t.experiment_id "
    "WHERE {where} ORDER BY t.id",
    "runs": "SELECT run_id, state, job_id, exit_code, exit_reason, preempt_acked, preempt_stop_s, log_path, "
    "start_time, end_time, submit_time FROM trial_runs WHERE trial_id = :trial ORDER BY run_id",
    "stops": "SELECT r.trial_id, r.run_id, r.preempt_stop_s FROM trial_runs r JOIN trials t ON r.trial_id = t.id "
    "WHERE t.experiment_id = :exp AND r.preempt_stop_s IS NOT NULL ORDER BY r.trial_id, r.run_id",
    "metrics": 'SELECT "group", steps_completed, metrics, report_time, run_id FROM metrics WHERE trial_id = :trial '
    "AND NOT archived ORDER BY steps_completed, id",
    # From the end of the (trial, step) index, one row past the limit: whether there are more.
    "recent_metrics": 'SELECT steps_completed, "group", report_time, metrics FROM metrics WHERE trial_id = :trial '
    "AND NOT archived ORDER BY steps_completed DESC, id DESC LIMIT :n",
    "checkpoints": "SELECT c.uuid, c.trial_id, t.experiment_id, c.run_id, c.steps_completed, c.state, c.metadata, "
    "c.resources, c.size, c.report_time, c.storage_path, e.config FROM checkpoints c "
    "JOIN trials t ON t.id = c.trial_id JOIN experiments e ON e.id = t.experiment_id "
    "WHERE {where} ORDER BY c.trial_id, c.steps_completed, c.uuid",
    # A checkpoint's metric is the validation reported at its step count (as Determined pairs them).
    "validations": "SELECT c.uuid, m.metrics FROM checkpoints c JOIN trials t ON t.id = c.trial_id "
    "JOIN experiments e ON e.id = t.experiment_id JOIN metrics m ON m.trial_id = c.trial_id "
    "AND m.\"group\" = 'validation' AND m.steps_completed = c.steps_completed AND NOT m.archived "
    "WHERE {where} ORDER BY m.id",
    "batches": "SELECT MAX(m.steps_completed) FROM metrics m WHERE m.trial_id = :trial AND NOT m.archived",
    "trial_owner": "SELECT e.owner FROM trials t JOIN experiments e ON e.id = t.experiment_id WHERE t.id = :trial",
    "notes": "SELECT time, level, message FROM trial_log_entries WHERE trial_id = :trial ORDER BY id",
    "first_trial": "SELECT MIN(t.id) FROM trials t WHERE t.experiment_id = :exp",
    "experiment_names": "SELECT id, name, exp_dir FROM experiments e WHERE id IN ({ids}) AND {where}",
    "detached_runs": "SELECT r.id, r.job_id, t.id, e.id, e.name FROM trial_runs r JOIN trials t ON r.trial_id = t.id "
    "JOIN experiments e ON t.experiment_id = e.id WHERE r.executor = 'detached' AND r.job_id IN ({ids}) AND {where}",
}
# Parameters per statement, in slices: SQLite bounds the parameters of one statement.
_SLICE = 500


class ExperimentRow(NamedTuple):
    """The columns of `det e list`."""

    id: int
    owner: str
    name: str
    parent_id: int | None
    state: ExperimentState
    progress: float
    start_time: datetime | None
    end_time: datetime | None
    resource_pool: str
    archived: bool


class Workload(NamedTuple):
    """One metric report as `det e describe` shows it."""

    steps_completed: int
    group: str
    report_time: datetime | None
    metrics: Any


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


def sqlite_path(url: str) -> Path | None:
    """The file of a plain ``sqlite:///`` URL; None for other databases, in-memory stores and
    URLs with query parameters (those are left to SQLAlchemy's parsing)."""
    if not url.startswith("sqlite:///"):
        return None
    path = url.split("///", 1)[-1]
    return None if not path or path == ":memory:" or "?" in path else Path(path)


class Reads:
    """Read-only queries on one store; each public method is one consistent read transaction."""

    def __init__(self, begin: Callable[[], contextlib.AbstractContextManager[Run]], json_text: bool) -> None:
        self._begin = begin
        # SQLite hands JSON columns back as text; PostgreSQL's driver has decoded them already.
        self._json: Callable[[Any], Any] = json.loads if json_text else _same
        self._close: Callable[[], None] = _nothing

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def open_sqlite(cls, url: str) -> Reads | None:
        """The SQLite store at ``url`` through the standard library, or None where it cannot
        serve: not a plain SQLite file URL, no such file, or a schema that is not current (the
        ORM store migrates it; :meth:`of_store` then answers)."""
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
            row = con.execute(SQL["revision"]).fetchone()
        except sqlite3.Error:  # no stamp yet (a new store) or unreadable: the ORM path says why
            row = None
        if row is None or row[0] != head_revision():
            con.close()
            return None

        @contextlib.contextmanager
        def begin() -> Iterator[Run]:
            with con:  # BEGIN ... COMMIT around the method's statements: one consistent view
                con.execute("BEGIN")
                yield lambda sql, params: con.execute(sql, params).fetchall()

        reads = cls(begin, json_text=True)
        reads._close = con.close
        return reads

    @classmethod
    def of_store(cls, store: Store) -> Reads:
        """The same queries through the ORM store's connection (PostgreSQL, or any SQLite URL)."""

        @contextlib.contextmanager
        def begin() -> Iterator[Run]:
            with store.read() as s:
                yield _runner(s.connection())

        return cls(begin, json_text=store.is_sqlite)

    @classmethod
    def on(cls, conn: Connection) -> Reads:
        """The queries inside a transaction the caller holds (``views`` builds its dicts here)."""

        @contextlib.contextmanager
        def begin() -> Iterator[Run]:
            yield _runner(conn)

        return cls(begin, json_text=conn.dialect.name == "sqlite")

    def close(self) -> None:
        self._close()

    # -- experiments -----------------------------------------------------------------------
    def has_unfinished(self, executor: str, owner: str) -> bool:
        """Whether some experiment of this executor and owner has not ended (every read asks)."""
        params = {"executor": executor, "owner": owner} | {f"t{j}": st for j, st in enumerate(_TERMINAL_EXPERIMENT)}
        with self._begin() as run:
            return bool(run(SQL["unfinished"], params))

    def with_live_runs(self, executor: str, owner: str) -> list[tuple[int, str]]:
        """(id, experiment dir) of this executor and owner's unfinished experiments that have a
        run not ended yet."""
        params = {"executor": executor, "owner": owner} | {f"t{j}": st for j, st in enumerate(_TERMINAL_EXPERIMENT)}
        with self._begin() as run:
            return [(int(i), str(d)) for i, d in run(SQL["with_live_runs"], params)]

    def experiment_rows(self, owner: str | None, include_archived: bool = False) -> list[ExperimentRow]:
        """The listed columns of ``owner``'s experiments (every owner's for None), by id: whole
        rows (configs, searcher states) of thousands of experiments would take seconds."""
        where, params = _scope(owner, include_archived)
        with self._begin() as run:
            rows = run(SQL["experiment_rows"].format(where=where), params)
        return [
            ExperimentRow(i, o, n, p, ExperimentState(st), float(pr), _when(t0), _when(t1), pool, bool(arch))
            for i, o, n, p, st, pr, t0, t1, pool, arch in rows
        ]

    def experiment_dicts(self, owner: str | None, include_archived: bool = False) -> list[dict[str, Any]]:
        """Every experiment of ``owner`` as :meth:`experiment` gives one (`det e list --json`)."""
        return [d for d, _ in self.experiments(owner, include_archived)]

    def experiments(
        self, owner: str | None, include_archived: bool = False
    ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Every experiment of ``owner`` with its stored config, as :meth:`experiment` gives one."""
        where, params = _scope(owner, include_archived)
        with self._begin() as run:
            return [self._experiment(r) for r in run(SQL["experiments"].format(where=where), params)]

    def experiment(self, exp_id: int, owner: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The experiment's dict and its stored config; NotFoundError for a missing one and for
        another user's alike (its existence is not leaked)."""
        where, params = _scope(owner, True)
        with self._begin() as run:
            rows = run(SQL["experiments"].format(where=where + " AND e.id = :exp"), {**params, "exp": exp_id})
        if not rows:
            raise NotFoundError("experiment", exp_id)
        return self._experiment(rows[0])

    def _experiment(self, row: tuple[Any, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
        i, name, owner, state, progress, desc, t0, t1, pool, archived, config, executor, exp_dir, err, parent = row[:15]
        sha, notes = row[15:]
        cfg = self._json(config)
        d = {
            "id": i,
            "name": name,
            "owner": owner,
            "state": ExperimentState(state),
            "progress": float(progress),
            "description": desc,
            "start_time": _when(t0),
            "end_time": _when(t1),
            "resource_pool": pool,
            "archived": bool(archived),
            "labels": ConfigView(cfg).labels,
            "executor": executor,
            "exp_dir": exp_dir,
            "error": err,
            "parent_id": parent,
            "context_sha256": sha,
            "notes": notes,
        }
        return d, cfg

    def stop_times(self, exp_id: int) -> list[tuple[int, int, float | None]]:
        """(trial, run, seconds) of the experiment's runs whose stop after a signal was measured."""
        with self._begin() as run:
            return [(t, r, s) for t, r, s in run(SQL["stops"], {"exp": exp_id})]

    # -- trials ----------------------------------------------------------------------------
    def trial_dicts(self, exp_id: int, owner: str | None) -> list[dict[str, Any]]:
        """The experiment's trials by id (NotFoundError for a missing or another user's one)."""
        self.experiment(exp_id, owner)
        where, params = _scope(owner, True)
        return self._trials(where + " AND t.experiment_id = :exp", {**params, "exp": exp_id})

    def trial(self, trial_id: int, owner: str | None) -> dict[str, Any]:
        """One trial's dict; NotFoundError for a missing one and another user's alike."""
        where, params = _scope(owner, True)
        found = self._trials(where + " AND t.id = :trial", {**params, "trial": trial_id})
        if not found:
            raise NotFoundError("trial", trial_id)
        return found[0]

    def _trials(self, where: str, params: dict[str, object]) -> list[dict[str, Any]]:
        with self._begin() as run:
            rows = run(SQL["trials"].format(where=where), {**params, "queued": RunState.QUEUED.value})
        out = []
        for r in rows:
            i, exp, st, hp, seed, restarts, runs, ck, steps, metric, progress, t0, t1, batches, early, why, rs, q = r
            state = TrialState(st)
            out.append(
                {
                    "id": i,
                    "experiment_id": exp,
                    "state": state,
                    "hparams": self._json(hp),
                    "seed": seed,
                    "restarts": restarts,
                    "runs": runs,
                    "latest_checkpoint": ck,
                    "steps_completed": steps,
                    "searcher_metric": metric,
                    "progress": float(progress),
                    "start_time": _when(t0),
                    "end_time": _when(t1),
                    "batches": int(batches or 0),
                    "early_stopped": bool(early),
                    "exit_reason": why,
                    # Why its job waits, in words with Slurm's code; only while a run is queued
                    # (the note outlives the wait: a paused trial keeps it).
                    "pending_reason": _pending(rs) if q and st not in _TERMINAL_TRIAL else None,
                }
            )
        return out

    def batches(self, trial_id: int) -> int:
        """The trial's batches, as :meth:`trial` counts them."""
        with self._begin() as run:
            return int(run(SQL["batches"], {"trial": trial_id})[0][0] or 0)

    def first_trial_id(self, exp_id: int, owner: str | None) -> int | None:
        """The experiment's first trial (None before its searcher made one)."""
        self.experiment(exp_id, owner)
        with self._begin() as run:
            return run(SQL["first_trial"], {"exp": exp_id})[0][0]  # type: ignore[no-any-return]

    def run_dicts(self, trial_id: int) -> list[dict[str, Any]]:
        """The trial's runs by run id (after :meth:`trial` checked the caller may see it)."""
        with self._begin() as run:
            rows = run(SQL["runs"], {"trial": trial_id})
        return [
            {
                "run_id": run_id,
                "state": RunState(st),
                "job_id": job,
                "exit_code": code,
                "exit_reason": why,
                "preempt_acked": bool(acked),
                # Seconds from Slurm's signal to the acknowledged checkpoint (None: not stopped by one).
                "preempt_stop_s": stop_s,
                "log": log,
                "start_time": _when(t0),
                "end_time": _when(t1),
            }
            for run_id, st, job, code, why, acked, stop_s, log, t0, t1, _ in rows
        ]

    def metrics(self, trial_id: int) -> list[dict[str, Any]]:
        """Every live metric report of the trial, by step (id breaks ties: arrival order)."""
        with self._begin() as run:
            rows = run(SQL["metrics"], {"trial": trial_id})
        return [
            {"group": g, "steps_completed": steps, "metrics": self._json(m), "report_time": _when(t), "run_id": r}
            for g, steps, m, t, r in rows
        ]

    def recent_metrics(self, trial_ids: Sequence[int], limit: int) -> dict[int, tuple[list[Workload], bool]]:
        """Each trial's last ``limit`` reports in :meth:`metrics` order, and whether it has
        earlier ones: `det e describe` shows a bounded table whatever a trial reported."""
        out = {}
        with self._begin() as run:
            for tid in trial_ids:
                rows = run(SQL["recent_metrics"], {"trial": tid, "n": max(limit, 0) + 1})
                shown = [Workload(s, g, _when(t), self._json(m)) for s, g, t, m in rows[:limit]]
                out[tid] = (shown[::-1], len(rows) > limit)
        return out

    # -- checkpoints -----------------------------------------------------------------------
    def checkpoint_dicts(self, exp_id: int, owner: str | None) -> list[dict[str, Any]]:
        """The experiment's checkpoints by trial and step (NotFoundError as :meth:`experiment`)."""
        self.experiment(exp_id, owner)
        where, params = _scope(owner, True)
        return self._checkpoints(where + " AND t.experiment_id = :exp", {**params, "exp": exp_id})

    def checkpoint(self, uuid: str, owner: str | None) -> dict[str, Any]:
        """One checkpoint's dict: NotFoundError for a missing one and another user's alike."""
        where, params = _scope(owner, True)
        found = self._checkpoints(where + " AND c.uuid = :uuid", {**params, "uuid": uuid})
        if not found:
            raise NotFoundError("checkpoint", uuid)
        return found[0]

    def _checkpoints(self, where: str, params: dict[str, object]) -> list[dict[str, Any]]:
        with self._begin() as run:
            rows = run(SQL["checkpoints"].format(where=where), params)
            validations = run(SQL["validations"].format(where=where), params)
        metric_of: dict[int, str] = {}
        by_uuid: dict[str, list[Any]] = {}
        for uuid, m in validations:
            by_uuid.setdefault(uuid, []).append(m)
        out = []
        for uuid, trial, exp, run_id, steps, state, meta, res, size, when, path, config in rows:
            if exp not in metric_of:
                # The stored config (validated, defaults filled, when it was stored).
                metric_of[exp] = (self._json(config).get("searcher") or {}).get("metric") or ""
            out.append(
                {
                    "uuid": uuid,
                    "trial_id": trial,
                    "experiment_id": exp,
                    "run_id": run_id,
                    "steps_completed": steps,
                    "state": state,
                    "metadata": self._json(meta),
                    "resources": self._json(res),
                    "size": size,
                    "report_time": _when(when),
                    "storage_path": path,
                    "validation_metric": self._validation(by_uuid.get(uuid, []), metric_of[exp]),
                }
            )
        return out

    def validation_metric(self, uuid: str, metric: str) -> float | None:
        """The checkpoint's validation ``metric`` (None without one), as :meth:`checkpoint` gives it."""
        with self._begin() as run:
            reports = run(SQL["validations"].format(where="c.uuid = :uuid"), {"uuid": uuid})
        return self._validation([m for _, m in reports], metric)

    def _validation(self, reports: list[Any], metric: str) -> float | None:
        for m in reports:
            # Metrics are the trial's own JSON (untrusted): a string or null under the metric's
            # name is skipped, not a crash of `det c list`.
            value = self._json(m).get(metric) if metric else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return None

    # -- logs and jobs ---------------------------------------------------------------------
    def trial_logs(self, trial_id: int, owner: str | None) -> tuple[list[TrialRunLog], list[TrialNote]]:
        """The trial's runs and notes, by run and by note id; NotFoundError for a missing trial
        and another user's alike."""
        with self._begin() as run:
            found = run(SQL["trial_owner"], {"trial": trial_id})
            if not found or (owner is not None and found[0][0] != owner):
                raise NotFoundError("trial", trial_id)
            runs = run(SQL["runs"], {"trial": trial_id})
            notes = run(SQL["notes"], {"trial": trial_id})
        return (
            [TrialRunLog(r[0], r[7], _when(r[8] or r[10]), _when(r[9])) for r in runs],
            [TrialNote(_when(t) or datetime.min, level, msg) for t, level, msg in notes],
        )

    def experiment_names(self, ids: set[int], owner: str | None) -> dict[int, tuple[str, str]]:
        """id -> (name, experiment dir) of ``owner``'s experiments among ``ids`` (`det job list`)."""
        rows = self._in("experiment_names", sorted(ids), owner)
        return {i: (n, d) for i, n, d in rows}

    def detached_runs(self, job_ids: list[str], owner: str | None) -> list[tuple[str | None, int, int, str]]:
        """(job id, trial id, experiment id, experiment name) of ``owner``'s detached runs with
        one of ``job_ids``, oldest run first (a requeued job keeps its id; its latest run names it)."""
        rows = self._in("detached_runs", job_ids, owner)
        return [(job, t, e, name) for _, job, t, e, name in sorted(rows)]

    def _in(self, name: str, values: Sequence[object], owner: str | None) -> list[tuple[Any, ...]]:
        where, params = _scope(owner, True)
        rows: list[tuple[Any, ...]] = []
        with self._begin() as run:
            for k in range(0, len(values), _SLICE):
                part = values[k : k + _SLICE]
                marks = ", ".join(f":p{j}" for j in range(len(part)))
                rows += run(SQL[name].format(ids=marks, where=where), {**params, **_numbered(part)})
        return rows


def _numbered(values: Sequence[object]) -> dict[str, object]:
    return {f"p{j}": v for j, v in enumerate(values)}


def _scope(owner: str | None, include_archived: bool) -> tuple[str, dict[str, object]]:
    """The WHERE text (on the experiments table, ``e``) and its parameters: ``owner``'s rows
    only (None: root's --all-users), archived ones only if asked. In SQL, so that other users'
    rows never leave the database."""
    where = ["1 = 1"]
    params: dict[str, object] = {}
    if owner is not None:
        where.append("e.owner = :owner")
        params["owner"] = owner
    if not include_archived:
        where.append("NOT e.archived")
    return " AND ".join(where), params


def _runner(conn: Connection) -> Run:
    from sqlalchemy import text

    return lambda sql, params: [tuple(r) for r in conn.execute(text(sql), dict(params))]


def _pending(runner_state: str | None) -> str | None:
    from detslurm.slurm.reasons import pending_words

    return pending_words(runner_state)


def _when(value: str | datetime | None) -> datetime | None:
    # SQLAlchemy's SQLite DateTime stores "YYYY-MM-DD HH:MM:SS.ffffff" without an offset and reads
    # it back naive; fromisoformat gives the same naive datetime (fmt_time reads naive as UTC).
    # PostgreSQL's driver gives datetimes already, aware, as the ORM reads them there.
    return datetime.fromisoformat(value) if isinstance(value, str) else value


def _same(value: Any) -> Any:
    return value


def _nothing() -> None:
    return None


def trial_reason(d: dict[str, Any]) -> str:
    """What a table shows beside a trial: why it waits, else why it ended (or nothing)."""
    return str(d.get("pending_reason") or d.get("exit_reason") or "")


def experiment_filter_rows(
    rows: Sequence[ExperimentRow], *, states: Sequence[str] = (), name: str | None = None
) -> list[ExperimentRow]:
    """`det e list` filters: any of ``states``, and a name containing ``name`` (case-insensitive)."""
    wanted = {st.upper() for st in states}
    return [
        r for r in rows if (not wanted or str(r.state) in wanted) and (name is None or name.lower() in r.name.lower())
    ]
