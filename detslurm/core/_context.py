"""``core.init()``: the Core API entry point, on a trial and off-cluster alike."""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from detslurm.ckpt_settings import checkpoint_modes
from detslurm.core._checkpoint import CheckpointContext, DummyCheckpointContext, ensure_base
from detslurm.core._dirs import user_dirs
from detslurm.core._distributed import DistributedContext, DummyDistributedContext
from detslurm.core._events import EventWriter, NullWriter
from detslurm.core._experimental import DummyExperimentalCoreContext, ExperimentalCoreContext
from detslurm.core._info import RunInfo, get_cluster_info
from detslurm.core._preempt import DummyPreemptContext, PreemptContext, PreemptMode
from detslurm.core._profiler import DummyProfilerContext, ProfilerContext
from detslurm.core._searcher import DummySearcherContext, SearcherContext, SearcherContextMissing, Unit
from detslurm.core._train import DummyTrainContext, EarlyExitReason, TrainContext, Writer
from detslurm.errors import InvalidHP
from detslurm.expconf.view import ConfigView
from detslurm.protocol.events import Alert, Event, PreemptAck

log = logging.getLogger("detslurm.core")


class TensorboardMode(enum.Enum):
    AUTO = "AUTO"
    MANUAL = "MANUAL"


# Determined's alert levels (its default is info).
ALERT_LEVELS = ("warn", "info", "debug", "error")


class Context:
    """Determined's ``core.Context``: distributed, train, checkpoint, preempt and searcher in one."""

    def __init__(
        self,
        *,
        distributed: DistributedContext,
        train: TrainContext,
        checkpoint: CheckpointContext,
        preempt: PreemptContext,
        searcher: SearcherContext,
        info: RunInfo | None,
        writer: Writer,
        profiler: ProfilerContext | None = None,
        experimental: ExperimentalCoreContext | None = None,
    ) -> None:
        self.distributed = distributed
        self.train = train
        self.checkpoint = checkpoint
        self.preempt = preempt
        self.searcher = searcher
        self.info = info
        self.profiler = profiler or DummyProfilerContext()
        self.experimental = experimental or DummyExperimentalCoreContext()
        self._writer = writer

    def start(self) -> None:
        # The preemption watcher thread starts only on __enter__, so building a Context (e.g. in a
        # test) starts nothing.
        self.preempt.start()

    def close(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
    ) -> None:
        self.preempt.close()
        # AUTO mode: what the chief wrote since the last periodic upload (the end of training).
        self.train.final_tensorboard_upload()
        try:
            # Flushed before the sockets close: the controller reads this file after the process ends,
            # and the last reports (a final checkpoint) must be in it.
            self._writer.flush()
        finally:
            close = getattr(self._writer, "close", None)
            if close:
                close()
            self.distributed.close()

    def __enter__(self) -> Context:
        self.start()
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, InvalidHP):
            self.train.report_early_exit(EarlyExitReason.INVALID_HP)
            self.close(typ, exc, tb)
            log.info("InvalidHP raised: reported to the searcher, exiting 0")
            # Determined's contract: InvalidHP ends the trial cleanly (exit 0) and the searcher is told
            # through the early-exit event, so the controller must not count it as a failure to restart.
            raise SystemExit(0)
        self.close(typ, exc, tb)

    def alert(self, title: str | None = None, description: str | None = None, level: str | None = "info") -> None:
        """An alert for this trial, kept with its notes (``det trial describe``); Determined sends
        it to the experiment's webhooks. ``level`` is one of Determined's: warn, info, debug, error."""
        if level not in ALERT_LEVELS:
            raise ValueError(f"alert(): level must be one of {', '.join(ALERT_LEVELS)}, not {level!r}")
        if self.info is None:
            raise ValueError("alert() works only in a trial (det e create), not off-cluster")
        self._writer.emit(Alert(title=title or "", description=description or "", level=level))


def _units(config: dict[str, Any]) -> Unit | None:
    ml = ConfigView(config).searcher.max_length
    if ml is None:
        return None
    return {"batches": Unit.BATCHES, "records": Unit.RECORDS, "epochs": Unit.EPOCHS}[ml.unit]


def _storage_base(checkpoint_storage: str | dict[str, Any] | None, default: Path) -> Path:
    if checkpoint_storage is None:
        return default
    if isinstance(checkpoint_storage, str):
        return Path(checkpoint_storage.removeprefix("file://"))
    if checkpoint_storage.get("type") == "shared_fs":
        raise ValueError("checkpoint_storage of type shared_fs is not accepted in dict form; pass a path string")
    if checkpoint_storage.get("type") == "directory":
        return Path(checkpoint_storage["container_path"])
    raise ValueError(f"unsupported checkpoint_storage {checkpoint_storage!r}")


def _durable(writer: Writer) -> Callable[[Event], None]:
    """Checkpoint reports are flushed before store_path() returns: a trial that is killed
    right after a checkpoint still has that checkpoint recorded for its restart."""

    def report(event: Event) -> None:
        writer.emit(event)
        writer.flush()

    return report


def _dummy_init(
    distributed: DistributedContext | None, checkpoint_storage: str | dict[str, Any] | None, preempt_mode: PreemptMode
) -> Context:
    dist = distributed or DummyDistributedContext()
    writer = NullWriter()
    # Off-cluster checkpoints go where the settings put checkpoints (DETSLURM_CHECKPOINT_DIR, the
    # config file's checkpoint_dir, or their default), as a detached run's do.
    base = _storage_base(checkpoint_storage, user_dirs(os.environ).checkpoints)
    ensure_base(base, checkpoint_modes(os.environ))
    log.info("off-cluster: checkpoints go to %s", base)
    return Context(
        distributed=dist,
        train=DummyTrainContext(),
        writer=writer,
        info=None,
        checkpoint=DummyCheckpointContext(dist, base),
        preempt=DummyPreemptContext(dist, preempt_mode),
        searcher=DummySearcherContext(dist),
    )


def init(
    *,
    distributed: DistributedContext | None = None,
    checkpoint_storage: str | dict[str, Any] | None = None,
    preempt_mode: PreemptMode = PreemptMode.WorkersAskChief,
    tensorboard_mode: TensorboardMode = TensorboardMode.AUTO,
) -> Context:
    """The Core API context: wired to the trial's run dir on a cluster, a local twin otherwise."""
    # Keyword-only, as in Determined: positional calls would silently bind the wrong context.
    info = get_cluster_info()
    if info is None or info.task_type != "TRIAL":
        return _dummy_init(distributed, checkpoint_storage, preempt_mode)
    if distributed is None and (len(info.container_addrs) > 1 or len(info.slot_ids) > 1):
        # Determined's message: a multi-slot trial without a DistributedContext would run every
        # rank as a chief, each writing checkpoints and reports as if it were alone.
        raise ValueError("you must provide a valid DistributedContext for a multi-slot task")
    dist = distributed or DummyDistributedContext()
    paths = info.run_paths
    # One event file per rank: ranks never share a file, so no cross-process locking is needed;
    # the controller ingests each file from the byte offset it stored last time.
    writer: Writer = EventWriter(paths.event_file(dist.rank))

    def ack() -> None:
        # `preempt` is bound below, before anything can call ack().
        writer.emit(PreemptAck(signal_time=preempt.signal_time))
        writer.flush()

    preempt = PreemptContext(dist, paths.control, ack, preempt_mode, signals_path=paths.signals)
    config = info.trial._config
    base = _storage_base(checkpoint_storage, info.checkpoint_base)
    units = _units(config)
    searcher: SearcherContext = (
        SearcherContext(dist, writer, paths.exp.ops_file(paths.trial_id), units, preempt._local_answer, ack)
        if units is not None
        # Without searcher.max_length there are no operations to hand out: the missing twin raises
        # with a message if user code asks for them.
        else SearcherContextMissing()
    )
    return Context(
        distributed=dist,
        writer=writer,
        info=info,
        searcher=searcher,
        preempt=preempt,
        train=TrainContext(
            writer, info.trial._trial_run_id, paths, rank=dist.rank, tb_auto=tensorboard_mode == TensorboardMode.AUTO
        ),
        checkpoint=CheckpointContext(dist, base, _durable(writer), require_steps=True),
        profiler=ProfilerContext(),
        experimental=ExperimentalCoreContext(info.trial.trial_id),
    )
