"""Metric rows inserted in bulk during ingest (issue 15: >= 100k rows/s).

Each event used to be applied in its own SAVEPOINT, so that a row the store refuses costs only
itself (review H1): an ORM flush, a SAVEPOINT and its RELEASE per metric row, about 2,000
rows/s on SQLite. Metric rows are now collected while a file's lines are read and written by
one executemany in one SAVEPOINT; only when that fails are they retried one at a time, so a
refused row is still quarantined alone and every other row is kept. (A validation's searcher
side is applied by ``apply._Ingest``, after the rows.)

Rows are written before any other event of the same file is applied (``flush`` is called
first), so metric ids keep the order the trial reported in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import insert
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session

from detslurm.protocol import Line, Metrics
from detslurm.store.models import Metric, MetricPoint
from detslurm.store.sanitize import json_safe

POINT_NAME_MAX = 256  # MetricPoint.name's length


def point_rows(trial_id: int, ev: Metrics, metrics: Any, when: datetime) -> list[dict[str, Any]]:
    """The report's numeric values as ``metric_points`` rows: the dashboard's curves read them
    without parsing each report's JSON. ``metrics`` is the report already made JSON-safe."""
    if not isinstance(metrics, dict):
        return []
    return [
        {
            "trial_id": trial_id,
            "group": ev.group,
            "name": name,
            "steps_completed": ev.steps_completed,
            "report_time": when,
            "value": float(v),
            "archived": False,
        }
        for name, v in metrics.items()
        # json_safe already turned non-finite floats into null; booleans are not values.
        if isinstance(v, (int, float)) and not isinstance(v, bool) and len(name) <= POINT_NAME_MAX
    ]


@dataclass
class Queued:
    """One report waiting for the bulk insert: its ``metrics`` row and its ``metric_points``
    rows travel together, so a refused report loses both and a kept one keeps both."""

    line: Line
    row: dict[str, Any]
    points: list[dict[str, Any]]


@dataclass
class PendingMetrics:
    """One file's metric rows awaiting their bulk insert, each with the line it came from."""

    trial_id: int
    run_id: int
    rows: list[Queued] = field(default_factory=list)

    def add(self, line: Line, ev: Metrics, when: datetime) -> None:
        """Queue the rows of ``ev`` (the same columns ``apply._on_metrics`` writes)."""
        metrics = json_safe(ev.metrics)
        row = {
            "trial_id": self.trial_id,
            "run_id": self.run_id,
            "group": ev.group,
            "steps_completed": ev.steps_completed,
            "metrics": metrics,
            "batch_metrics": json_safe(ev.batch_metrics),
            "report_time": when,
            "archived": False,
        }
        self.rows.append(Queued(line, row, point_rows(self.trial_id, ev, metrics, when)))

    def drop(self, line: Line) -> list[Queued]:
        """Take ``line``'s queued rows out (they are written, or not, with its event's other effects)."""
        mine = [q for q in self.rows if q.line is line]
        self.rows = [q for q in self.rows if q.line is not line]
        return mine

    @staticmethod
    def insert(session: Session, queued: list[Queued]) -> None:
        """Insert ``queued`` now: Core inserts of the tables (one executemany each; the ORM's
        bulk insert of the classes costs as much again per row)."""
        if queued:
            session.execute(insert(Metric.metadata.tables[Metric.__tablename__]), [q.row for q in queued])
        points = [pt for q in queued for pt in q.points]
        if points:
            session.execute(insert(MetricPoint.metadata.tables[MetricPoint.__tablename__]), points)

    def flush(self, session: Session, refused: Callable[[Line, str], None]) -> int:
        """Insert the queued rows; returns how many reports were refused (each reported to
        ``refused`` with its line and why). A failing store (OperationalError, InterfaceError)
        raises: the whole tick rolls back and is retried, as for any other event."""
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
