"""TrainContext: metrics, progress, status and early exits, as events (contract 2)."""

from __future__ import annotations

import enum
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any, Protocol

from detslurm.util import atomic_write_json, read_json

log = logging.getLogger("detslurm.core")


class Writer(Protocol):
    def emit(self, event: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...


class EarlyExitReason(enum.Enum):
    INVALID_HP = "EXITED_REASON_INVALID_HP"
    USER_REQUESTED_STOP = "EXITED_REASON_USER_REQUESTED_STOP"


class TrainContext:
    def __init__(self, writer: Writer, run_id: int, exp_dir: Path | None = None, run_dir: Path | None = None) -> None:
        self._w = writer
        self._run_id = run_id
        self._exp_dir = exp_dir
        self._run_dir = run_dir

    def _metrics(
        self,
        group: str,
        steps_completed: int,
        metrics: dict[str, Any],
        batch_metrics: list[dict[str, Any]] | None = None,
    ) -> None:
        if not group or "." in group:
            raise ValueError(f"metric group {group!r} must be non-empty and contain no '.'")
        ev: dict[str, Any] = {
            "type": "metrics",
            "group": group,
            "steps_completed": int(steps_completed),
            "metrics": dict(metrics),
        }
        if batch_metrics is not None:
            ev["batch_metrics"] = list(batch_metrics)
        self._w.emit(ev)

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
                raise RuntimeError(f"validation metric {k!r} is None")
            clean[k] = v
        self._metrics("validation", steps_completed, clean)

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        self._metrics(group, steps_completed, metrics)

    def report_progress(self, progress: float) -> None:
        if not (0.0 <= float(progress) <= 1.0) or math.isnan(progress):
            raise ValueError(f"progress must be between 0 and 1, got {progress}")
        self._w.emit({"type": "progress", "progress": float(progress)})

    def report_early_exit(self, reason: EarlyExitReason) -> None:
        self._w.emit({"type": "early_exit", "reason": EarlyExitReason(reason).name})
        self._w.flush()

    def set_status(self, status: str) -> None:
        self._w.emit({"type": "status", "state": str(status)})

    def get_experiment_best_validation(self) -> float | None:
        if self._exp_dir is None:
            return None
        best = read_json(self._exp_dir / "best_validation.json", {})
        value = best.get("value")
        return None if value is None else float(value)

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        json.dumps(metadata)  # fail here, not in the writer thread
        if self._run_dir is not None:
            atomic_write_json(self._run_dir.parent / "metadata.json", metadata)
        self._w.emit({"type": "run_metadata", "metadata": metadata})

    def get_metadata(self) -> dict[str, Any] | None:
        if self._run_dir is None:
            return None
        md: dict[str, Any] | None = read_json(self._run_dir.parent / "metadata.json", None)
        return md

    def get_tensorboard_path(self) -> Path:
        base = self._run_dir or Path(".")
        return base / "tensorboard"

    def upload_tensorboard_files(self, *args: Any, **kwargs: Any) -> None:
        log.debug("tensorboard files stay in %s", self.get_tensorboard_path())
