"""Metric rows inserted in bulk during ingest (goal: >= 100k rows/s, bench/README.md).

Each event used to be applied in its own SAVEPOINT, so that a row the store refuses costs only
itself: an ORM flush, a SAVEPOINT and its RELEASE per metric row, about 2,000
rows/s on SQLite. Metric rows are now collected while a file's lines are read and written by
one executemany in one SAVEPOINT; only when that fails are they retried one at a time, so a
refused row is still quarantined alone and every other row is kept. (A validation's searcher
side is applied by ``apply._Ingest``, after the rows.)

On SQLite the rows go to the driver's own ``executemany`` as tuples, already encoded: the
ORM's parameter processing (a JSON and a datetime processor per row and column) cost more than
the insert itself. PostgreSQL keeps SQLAlchemy Core's insert (its driver needs it).

Rows are written before any other event of the same file is applied (``flush`` is called
first), so metric ids keep the order the trial reported in. The reports' TensorBoard records
are written at the same points, in one write per flush.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Table, bindparam, insert
from sqlalchemy.dialects import sqlite
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session

from detslurm import tbevents
from detslurm.controller import fastjson
from detslurm.protocol import Line, Metrics
from detslurm.store.models import Metric, MetricPoint
from detslurm.store.sanitize import JSON_STR_MAX, json_safe

log = logging.getLogger("detslurm.controller")
POINT_NAME_MAX = 256  # MetricPoint.name's length
# A float column holds ints up to about 1.8e308; a larger one (JSON allows it) is kept only in
# the report's JSON, never as a point (float() of it would raise).
_FLOAT_MAX = 1.7976931348623157e308

# Raw inserts for SQLite's executemany, compiled from the models' tables: a column the models
# rename or drop fails here, at import, not as a wrong row at ingest.
_METRIC_COLUMNS = (
    "trial_id",
    "run_id",
    "group",
    "steps_completed",
    "metrics",
    "batch_metrics",
    "report_time",
    "archived",
)
_POINT_COLUMNS = ("trial_id", "group", "name", "steps_completed", "report_time", "value", "archived")


def _qmark_insert(table: Table, columns: tuple[str, ...]) -> str:
    """``INSERT INTO table (columns) VALUES (?, ...)`` for sqlite3, parameters in ``columns``' order."""
    compiled = insert(table).values({c: bindparam(c) for c in columns}).compile(dialect=sqlite.dialect())
    if tuple(compiled.positiontup or ()) != columns:
        raise RuntimeError(f"{table.name}: compiled parameters {compiled.positiontup} are not {columns}")
    return str(compiled)


_SQLITE_METRICS = _qmark_insert(Metric.metadata.tables[Metric.__tablename__], _METRIC_COLUMNS)
_SQLITE_POINTS = _qmark_insert(MetricPoint.metadata.tables[MetricPoint.__tablename__], _POINT_COLUMNS)


def _points(metrics: Any) -> list[tuple[str, float]]:
    if not isinstance(metrics, dict):
        return []
    # json_safe already turned non-finite floats into strings; booleans are not values.
    return [
        (name, float(v))
        for name, v in metrics.items()
        if (type(v) is float or (type(v) is int and -_FLOAT_MAX <= v <= _FLOAT_MAX)) and len(name) <= POINT_NAME_MAX
    ]


def safe_report(metrics: Any) -> tuple[Any, list[tuple[str, float]]]:
    """``json_safe(metrics)`` and its points. A flat report of finite numbers, booleans, nulls and
    short strings without NUL (nearly every report) is already JSON-safe: it is checked and its
    points collected in one loop, with no copy; anything else takes json_safe's full walk."""
    if type(metrics) is dict:
        points: list[tuple[str, float]] = []
        for k, v in metrics.items():
            if type(k) is not str or len(k) > JSON_STR_MAX or "\x00" in k:
                break
            t = type(v)
            if t is float:
                if v - v != 0.0:  # NaN or an infinity: json_safe spells them as strings
                    break
                if len(k) <= POINT_NAME_MAX:
                    points.append((k, v))
            elif t is int:
                if len(k) <= POINT_NAME_MAX and -_FLOAT_MAX <= v <= _FLOAT_MAX:
                    points.append((k, float(v)))
            elif t is str:
                if len(v) > JSON_STR_MAX or "\x00" in v:
                    break
            elif t is not bool and v is not None:
                break  # nested values, or an int/float subclass
        else:
            return metrics, points
    safe = json_safe(metrics)
    return safe, _points(safe)


class Queued(NamedTuple):
    """One report waiting for the bulk insert: its ``metrics`` row and its ``metric_points``
    rows travel together, so a refused report loses both and a kept one keeps both."""

    line: Line
    group: str
    steps_completed: int
    metrics: Any  # JSON-safe
    batch_metrics: Any  # JSON-safe, or None
    report_time: datetime
    points: list[tuple[str, float]]


@dataclass
class PendingMetrics:
    """One file's metric rows awaiting their bulk insert, each with the line it came from, and
    their TensorBoard records (written to ``tensorboard``, the trial's directory, if given)."""

    trial_id: int
    run_id: int
    tensorboard: Path | None = None
    rows: list[Queued] = field(default_factory=list)
    records: list[bytes] = field(default_factory=list)
    first_time: float = 0.0

    def add(self, line: Line, ev: Metrics, when: datetime) -> None:
        """Queue the rows of ``ev``: its ``metrics`` row and its numeric values' ``metric_points`` rows."""
        metrics, points = safe_report(ev.metrics)
        batch = None if ev.batch_metrics is None else json_safe(ev.batch_metrics)
        self.rows.append(Queued(line, ev.group, ev.steps_completed, metrics, batch, when, points))
        if self.tensorboard is not None:
            data = tbevents.report_record(ev.group, ev.steps_completed, ev.time, ev.metrics)
            if data:
                self.first_time = self.first_time if self.records else ev.time
                self.records.append(data)

    def drop(self, line: Line) -> list[Queued]:
        """Take ``line``'s queued rows out (they are written, or not, with its event's other effects)."""
        mine = [q for q in self.rows if q.line is line]
        self.rows = [q for q in self.rows if q.line is not line]
        return mine

    def insert(self, session: Session, queued: list[Queued]) -> None:
        """Insert ``queued`` now: one executemany per table."""
        if not queued:
            return
        # The session's own connection, so the rows are in its transaction and SAVEPOINT.
        raw = session.connection().connection.driver_connection
        if isinstance(raw, sqlite3.Connection):
            self._insert_sqlite(raw, queued)
        else:
            self._insert_core(session, queued)

    def _insert_core(self, session: Session, queued: list[Queued]) -> None:
        # Core inserts of the tables: the ORM's bulk insert of the classes costs as much again per row.
        rows = [
            {
                "trial_id": self.trial_id,
                "run_id": self.run_id,
                "group": q.group,
                "steps_completed": q.steps_completed,
                "metrics": q.metrics,
                "batch_metrics": q.batch_metrics,
                "report_time": q.report_time,
                "archived": False,
            }
            for q in queued
        ]
        session.execute(insert(Metric.metadata.tables[Metric.__tablename__]), rows)
        points = [
            {
                "trial_id": self.trial_id,
                "group": q.group,
                "name": name,
                "steps_completed": q.steps_completed,
                "report_time": q.report_time,
                "value": value,
                "archived": False,
            }
            for q in queued
            for name, value in q.points
        ]
        if points:
            session.execute(insert(MetricPoint.metadata.tables[MetricPoint.__tablename__]), points)

    def _insert_sqlite(self, raw: sqlite3.Connection, queued: list[Queued]) -> None:
        tid, dumps = self.trial_id, fastjson.encode
        rows, points = [], []
        for q in queued:
            # SQLAlchemy's format for SQLite DATETIME: UTC wall clock, always 6 decimals, no offset.
            when = q.report_time.isoformat(" ", "microseconds")[:26]
            batch = "null" if q.batch_metrics is None else dumps(q.batch_metrics)
            rows.append((tid, self.run_id, q.group, q.steps_completed, dumps(q.metrics), batch, when, 0))
            points += [(tid, q.group, name, q.steps_completed, when, value, 0) for name, value in q.points]
        try:
            raw.executemany(_SQLITE_METRICS, rows)
            if points:
                raw.executemany(_SQLITE_POINTS, points)
        except (sqlite3.IntegrityError, sqlite3.DataError, sqlite3.ProgrammingError):
            raise  # this row's fault: refused alone by flush()
        except (sqlite3.DatabaseError, sqlite3.InterfaceError, MemoryError) as e:
            # The store itself failed (disk full, I/O, a corrupt file, out of memory): raised as
            # SQLAlchemy raises it, so the tick rolls back and retries as for any other store
            # failure, instead of refusing every line of the pass.
            raise OperationalError(_SQLITE_METRICS, None, e) from e

    def flush(self, session: Session, refused: Callable[[Line, str], None]) -> int:
        """Insert the queued rows; returns how many reports were refused (each reported to
        ``refused`` with its line and why). A failing store (OperationalError, InterfaceError)
        raises: the whole tick rolls back and is retried, as for any other event."""
        self._write_tensorboard()
        queued, self.rows = self.rows, []
        if not queued:
            return 0
        try:
            with session.begin_nested():
                self.insert(session, queued)
            return 0
        except (OperationalError, InterfaceError):
            raise
        except Exception:
            pass
        bad = 0
        for q in queued:
            try:
                with session.begin_nested():
                    self.insert(session, [q])
            except (OperationalError, InterfaceError):
                raise
            except Exception as e:
                refused(q.line, f"could not apply metrics: {type(e).__name__}: {str(e)[:200]}")
                bad += 1
        return bad

    def _write_tensorboard(self) -> None:
        """The queued reports' TensorBoard records, in one write. Written before the tick's
        commit: a tick that rolls back after it re-ingests the reports and writes them again,
        which TensorBoard shows as one point (same step, same value)."""
        if not self.records or self.tensorboard is None:
            return
        data, self.records = b"".join(self.records), []
        try:
            tbevents.append_records(self.tensorboard, data, self.first_time)
        except OSError as e:
            # A full or read-only disk must not stop ingest: the metrics are in the store.
            log.warning("trial %s: could not write its TensorBoard events: %s", self.trial_id, e)
