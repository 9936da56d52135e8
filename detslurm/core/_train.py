"""TrainContext: metrics, progress, status and early exits, as events (contract 2)."""

from __future__ import annotations

import enum
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any, Protocol

from detslurm.protocol import BadRecord, BestValidation, RunPaths
from detslurm.protocol.events import MAX_GROUP, EarlyExit, Event, Metrics, Progress, RunMetadata, Status
from detslurm.protocol.records import read_record
from detslurm.util import atomic_write_json

log = logging.getLogger("detslurm.core")


# The event sink: the rank's event file on a cluster, a null writer off it. A Protocol so
# the contexts can be tested with an in-memory writer.
class Writer(Protocol):
    def emit(self, event: Event) -> None: ...
    def flush(self) -> None: ...


class EarlyExitReason(enum.Enum):
    # Determined's wire names; the event carries the member name, which the controller maps.
    INVALID_HP = "EXITED_REASON_INVALID_HP"
    USER_REQUESTED_STOP = "EXITED_REASON_USER_REQUESTED_STOP"


class TrainContext:
    def __init__(self, writer: Writer, run_id: int, paths: RunPaths | None = None) -> None:
        self._w = writer
        self._run_id = run_id
        self._paths = paths  # None off-cluster

    def _metrics(
        self,
        group: str,
        steps_completed: int,
        metrics: dict[str, Any],
        batch_metrics: list[dict[str, Any]] | None = None,
    ) -> None:
        # Checked in the trial, where the user sees the message, rather than only at ingest. The
        # rules are Determined's master's (empty or dotted groups are InvalidArgument there).
        if not group or "." in group or len(group) > MAX_GROUP:
            raise ValueError(f"metric group {group!r} must be non-empty, at most {MAX_GROUP} characters, without '.'")
        self._w.emit(
            Metrics(
                group=group,
                steps_completed=int(steps_completed),
                metrics=dict(metrics),
                batch_metrics=None if batch_metrics is None else list(batch_metrics),
            )
        )

    def report_training_metrics(
        self, steps_completed: int, metrics: dict[str, Any], batch_metrics: list[dict[str, Any]] | None = None
    ) -> None:
        self._metrics("training", steps_completed, metrics, batch_metrics)

    def report_validation_metrics(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        clean = {}
        for k, v in metrics.items():
            if isinstance(v, bytes):
                warnings.warn(f"dropping bytes-valued validation metric {k!r}", stacklevel=2)
                continue
            if v is None:
                # As in Determined: bytes are dropped with a warning, None is an error.
                raise RuntimeError(f"validation metric {k!r} is None")
            clean[k] = v
        self._metrics("validation", steps_completed, clean)

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        self._metrics(group, steps_completed, metrics)

    def report_progress(self, progress: float) -> None:
        if not (0.0 <= float(progress) <= 1.0) or math.isnan(progress):
            raise ValueError(f"progress must be between 0 and 1, got {progress}")
        self._w.emit(Progress(progress=float(progress)))

    def report_early_exit(self, reason: EarlyExitReason) -> None:
        # Flushed at once: the trial usually exits right after, and the controller must see why.
        self._w.emit(EarlyExit(reason=EarlyExitReason(reason).name))
        self._w.flush()

    def set_status(self, status: str) -> None:
        self._w.emit(Status(state=str(status)))

    def get_experiment_best_validation(self) -> float | None:
        if self._paths is None:
            return None
        try:
            best = BestValidation.read(self._paths.exp.best_validation)
        except BadRecord:
            return None
        return None if best is None else best.value

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        json.dumps(metadata)  # fail here, not in the writer thread
        if self._paths is not None:
            # Kept in a file as well as sent as an event so get_metadata() can read it back after a
            # restart, without asking the store (which the job cannot reach).
            atomic_write_json(self._paths.exp.trial_metadata(self._paths.trial_id), metadata)
        self._w.emit(RunMetadata(metadata=dict(metadata)))

    def get_metadata(self) -> dict[str, Any] | None:
        if self._paths is None:
            return None
        try:
            md = read_record(self._paths.exp.trial_metadata(self._paths.trial_id))
        except BadRecord:
            return None
        return md if isinstance(md, dict) else None

    def get_tensorboard_path(self) -> Path:
        return self._paths.tensorboard if self._paths is not None else Path("tensorboard")

    def upload_tensorboard_files(self, *args: Any, **kwargs: Any) -> None:
        # No upload: the files are already on the shared filesystem, where Determined's upload
        # would have put them.
        log.debug("tensorboard files stay in %s", self.get_tensorboard_path())
