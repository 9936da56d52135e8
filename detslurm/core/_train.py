"""TrainContext: metrics, progress, status and early exits, as events (contract 2)."""

from __future__ import annotations

import enum
import json
import logging
import math
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from detslurm.protocol import BadRecord, BestValidation, RunPaths
from detslurm.protocol.events import MAX_GROUP, EarlyExit, Event, Metrics, Progress, RunMetadata, Status
from detslurm.protocol.records import read_record
from detslurm.util import atomic_write_json

log = logging.getLogger("detslurm.core")
# AUTO mode uploads the chief's TensorBoard files after a report at most this often: a scan of
# the dir per report would cost more than the report itself on a shared filesystem.
TB_AUTO_INTERVAL_S = 10.0


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
    def __init__(
        self, writer: Writer, run_id: int, paths: RunPaths | None = None, *, rank: int = 0, tb_auto: bool = False
    ) -> None:
        self._w = writer
        self._run_id = run_id
        self._paths = paths  # None off-cluster
        self._rank = rank
        # TensorboardMode.AUTO: the chief uploads its TensorBoard files after every report, as
        # Determined does; MANUAL leaves it to upload_tensorboard_files().
        self._tb_auto_mode = tb_auto and rank == 0
        self._tb_auto = self._tb_auto_mode
        self._tb_copied: dict[Path, int] = {}
        # Set once user code asked for its TensorBoard path: until then there is nothing to upload,
        # and a report costs no filesystem call (report_training_metrics is on the hot path).
        self._tb_used = False
        self._tb_last = 0.0

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
        if self._tb_auto and self._tb_used and time.monotonic() - self._tb_last >= TB_AUTO_INTERVAL_S:
            self.upload_tensorboard_files()

    # Each report is logged at INFO, in Determined's words, on a cluster and off it alike: what a
    # script that configures logging prints as it trains (the Trainer's reports go through here).
    def report_training_metrics(
        self, steps_completed: int, metrics: dict[str, Any], batch_metrics: list[dict[str, Any]] | None = None
    ) -> None:
        log.info("report_training_metrics(steps_completed=%s, metrics=%s)", steps_completed, metrics)
        self._metrics("training", steps_completed, metrics, batch_metrics)

    def report_validation_metrics(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        log.info("report_validation_metrics(steps_completed=%s, metrics=%s)", steps_completed, metrics)
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
        log.info("report_metrics(group=%s, steps_completed=%s, metrics=%s)", group, steps_completed, metrics)
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
        """Where this rank may write TensorBoard files (its own dir in the run dir; Determined's
        is a local path per rank). Metrics reported through this API need not be written there:
        the controller writes them to the trial's event file itself."""
        if self._paths is None:
            return Path("tensorboard")
        path = self._paths.tensorboard / f"rank-{self._rank}"
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._tb_used = True
        return path

    def upload_tensorboard_files(
        self,
        selector: Callable[[Path], bool] = lambda _: True,
        mangler: Callable[[Path, int], Path] = lambda p, __: p,
    ) -> None:
        """Copy the files under :meth:`get_tensorboard_path` that ``selector`` accepts into the
        trial's TensorBoard dir (where `det tensorboard` looks), each at ``mangler(relative path,
        rank)``, as Determined uploads them to checkpoint storage. Only what grew since the last
        call is copied (event files are append-only)."""
        if self._paths is None:
            return  # off-cluster, as Determined's dummy context: nothing to upload to
        self._tb_last = time.monotonic()
        src_root = self.get_tensorboard_path()
        dst_root = self._paths.exp.trial_tensorboard(self._paths.trial_id)
        for src in sorted(p for p in src_root.rglob("*") if p.is_file()):
            if not selector(src):
                continue
            rel = Path(mangler(src.relative_to(src_root), self._rank))
            if rel.is_absolute() or ".." in rel.parts:
                raise ValueError(f"upload_tensorboard_files: the mangler returned {rel}, which leaves the trial's dir")
            self._copy_new_bytes(src, dst_root / rel)

    def _set_auto_upload(self, enabled: bool) -> None:
        """AUTO mode's upload of the chief's TensorBoard files, off or back on (the PyTorch
        Trainer's set_enable_tensorboard_logging); MANUAL mode is left as it is."""
        self._tb_auto = enabled and self._tb_auto_mode

    def final_tensorboard_upload(self) -> None:
        """At close, in AUTO mode: upload what the chief wrote since the last upload. A failure is
        logged, not raised: the trial's own result must not depend on its TensorBoard files."""
        if not (self._tb_auto and self._tb_used):
            return
        try:
            self.upload_tensorboard_files()
        except (OSError, ValueError) as e:
            log.warning("could not upload the TensorBoard files: %s", e)

    def _copy_new_bytes(self, src: Path, dst: Path) -> None:
        size = src.stat().st_size
        done = self._tb_copied.get(src, 0)
        if size == done:
            return
        if size < done:  # the file was rewritten, not appended to: copy it whole
            done = 0
        dst.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(src, "rb") as fin, open(dst, "r+b" if done and dst.exists() else "wb") as fout:
            fin.seek(done)
            fout.seek(done)
            shutil.copyfileobj(fin, fout)
            fout.truncate()
        self._tb_copied[src] = size


class DummyTrainContext(TrainContext):
    """Off-cluster twin, for unit tests and scripts run by hand: reports are checked as on a
    cluster and then dropped; ``get_tensorboard_path()`` is the path given (./tensorboard when
    none)."""

    def __init__(self, tensorboard_path: Path | None = None) -> None:
        super().__init__(_Dropped(), 0)
        self._tensorboard_path = tensorboard_path

    def get_tensorboard_path(self) -> Path:
        return Path(self._tensorboard_path) if self._tensorboard_path is not None else Path("tensorboard")


def dropped_writer() -> Writer:
    """A writer for off-cluster contexts: events are logged at debug level and kept nowhere."""
    return _Dropped()


class _Dropped:
    """The writer of an off-cluster context: each event is logged at debug level, kept nowhere."""

    def emit(self, event: Event) -> None:
        log.debug("off-cluster report: %s", event)

    def flush(self) -> None:
        pass
