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
from detslurm.store.models import Metric
from detslurm.store.sanitize import json_safe


@dataclass
class PendingMetrics:
    """One file's metric rows awaiting their bulk insert, each with the line it came from."""

    trial_id: int
    run_id: int
    rows: list[tuple[Line, dict[str, Any]]] = field(default_factory=list)

    def add(self, line: Line, ev: Metrics, when: datetime) -> None:
        """Queue the row of ``ev`` (the same columns ``apply._on_metrics`` writes)."""
        self.rows.append(
            (
                line,
                {
                    "trial_id": self.trial_id,
                    "run_id": self.run_id,
                    "group": ev.group,
                    "steps_completed": ev.steps_completed,
                    "metrics": json_safe(ev.metrics),
                    "batch_metrics": json_safe(ev.batch_metrics),
                    "report_time": when,
                    "archived": False,
                },
            )
        )

    def drop(self, line: Line) -> list[dict[str, Any]]:
        """Take ``line``'s queued row out (it is written, or not, with its event's other effects)."""
        mine = [r for ln, r in self.rows if ln is line]
        self.rows = [(ln, r) for ln, r in self.rows if ln is not line]
        return mine

    @staticmethod
    def insert(session: Session, rows: list[dict[str, Any]]) -> None:
        """Insert ``rows`` now: a Core insert of the table (one executemany; the ORM's bulk
        insert of the class costs as much again per row)."""
        if rows:
            session.execute(insert(Metric.metadata.tables[Metric.__tablename__]), rows)

    def flush(self, session: Session, refused: Callable[[Line, str], None]) -> int:
        """Insert the queued rows; returns how many were refused (each reported to ``refused``
        with its line and why). A failing store (OperationalError, InterfaceError) raises: the
        whole tick rolls back and is retried, as for any other event."""
        rows, self.rows = self.rows, []
        if not rows:
            return 0
        try:
            with session.begin_nested():
                self.insert(session, [r for _, r in rows])
            return 0
        except (OperationalError, InterfaceError):
            raise
        except Exception:
            pass
        bad = 0
        for line, row in rows:
            try:
                with session.begin_nested():
                    self.insert(session, [row])
            except (OperationalError, InterfaceError):
                raise
            except Exception as e:
                refused(line, f"could not apply metrics: {type(e).__name__}: {str(e)[:200]}")
                bad += 1
        return bad
