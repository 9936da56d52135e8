"""A trial's metrics reports as Determined's SDK returns them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from detslurm.client._session import Session


@dataclasses.dataclass
class TrialMetrics:
    """One metrics report of a trial, as Determined's SDK returns it."""

    trial_id: int
    trial_run_id: int
    steps_completed: int
    end_time: Optional[datetime]
    metrics: dict[str, Any]
    group: str
    batch_metrics: Optional[list[dict[str, Any]]] = None

    @property
    def total_batches(self) -> int:  # Determined's older name for steps_completed
        return self.steps_completed


class TrainingMetrics(TrialMetrics):
    """Deprecated in Determined (``TrialMetrics`` with group "training"); kept for old code."""

    def __init__(self, total_batches: Optional[int] = None, **kwargs: Any) -> None:
        kwargs.setdefault("steps_completed", total_batches)
        super().__init__(**{"group": "training", **kwargs})


class ValidationMetrics(TrialMetrics):
    """Deprecated in Determined (``TrialMetrics`` with group "validation"); kept for old code."""

    def __init__(self, total_batches: Optional[int] = None, **kwargs: Any) -> None:
        kwargs.setdefault("steps_completed", total_batches)
        super().__init__(**{"group": "validation", **kwargs})


def _trial_metrics(session: Session, trial_id: int, group: Optional[str]) -> Iterator[TrialMetrics]:
    session.reads.trial(trial_id, session.owner)  # the scope check: another user's is "not found"
    for m in session.reads.metrics(trial_id):
        if group is None or m["group"] == group:
            yield TrialMetrics(trial_id, m["run_id"], m["steps_completed"], m["report_time"], m["metrics"], m["group"])
