"""``torch_batch_process``: a dataset sharded over the trial's ranks, each batch handed to a
:class:`TorchBatchProcessor`, the progress checkpointed so that a resumed trial (after a pause, a
preemption, a requeue) goes on from the last checkpointed batch instead of the first.

The progress checkpoint holds no model: its metadata says how many batches every rank had
finished (the fewest of any rank) and the uuid under which the ranks write their output files
(``context.upload_path()``), so a resumed run writes beside the first run's files."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import uuid
import warnings
from collections.abc import Iterator, Sized
from typing import Any, Optional

import torch

from detslurm import core
from detslurm.core import DistributedContext, PreemptMode, get_cluster_info
from detslurm.protocol.env import RunInfo
from detslurm.pytorch._data import DataLoader
from detslurm.pytorch.experimental._context import TorchBatchProcessor, TorchBatchProcessorContext

log = logging.getLogger("detslurm.pytorch")

# Determined's default when neither batch_size nor dataloader_kwargs name one.
DEFAULT_BATCH_SIZE = 1
# The loader is built here (sharded, not shuffled, positioned at the resume point).
_OURS = ("sampler", "batch_sampler")


def _batch_size(batch_size: Optional[int], kwargs: dict[str, Any], checkpoint_interval: int) -> int:
    """The batch size, after the checks Determined makes, in its order; ``kwargs`` loses a
    ``batch_size`` it carried."""
    if checkpoint_interval <= 0:
        raise ValueError("checkpoint_interval should be a positive integer")
    if kwargs.pop("shuffle", False):
        raise ValueError("'shuffle' must be false for accurate sharding and checkpointing")
    for name in _OURS:
        if name in kwargs:
            raise ValueError(f"remove the '{name}' argument: torch_batch_process builds its own (sharded) {name}")
    if batch_size is not None:
        if "batch_size" in kwargs:
            raise ValueError("batch_size is passed into torch_batch_process and dataloader_kwargs")
        return batch_size
    return int(kwargs.pop("batch_size", DEFAULT_BATCH_SIZE))


def _iterate_length(max_batches: Optional[int], per_rank: int) -> int:
    """Batches each rank iterates: ``max_batches`` where it is between 1 and a rank's share."""
    if max_batches is None:
        return per_rank
    if max_batches <= 0 or max_batches > per_rank:
        why = "is not valid" if max_batches <= 0 else "exceeds sharded dataset length"
        warnings.warn(
            f"max_batches {max_batches} {why}: ignored, every rank iterates over its whole shard once", stacklevel=3
        )
        return per_rank
    return max_batches


@contextlib.contextmanager
def _core_context(distributed: Optional[DistributedContext], info: RunInfo) -> Iterator[core.Context]:
    """The Core API context, in the torch.distributed group a launcher asked for (joined and left
    here unless the script joined it already)."""
    started = False
    if distributed is None and os.environ.get("USE_TORCH_DISTRIBUTED", "").lower() in ("1", "true"):
        import torch.distributed as dist

        if not dist.is_initialized():
            # NCCL only works between GPUs; CPU-only trials (and the test cluster) need gloo.
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            started = True
        distributed = DistributedContext.from_torch_distributed()
    elif distributed is None and (len(info.container_addrs) > 1 or len(info.slot_ids) > 1):
        raise ValueError(
            "torch_batch_process() on several slots needs a distributed launch layer: "
            "entrypoint: python3 -m determined.launch.torch_distributed python3 your_script.py"
        )
    # WorkersAskChief: only the chief is asked about preemption and every rank gets its answer,
    # so all stop at the same checkpoint (a rank stopping alone would hang the others).
    with core.init(distributed=distributed, preempt_mode=PreemptMode.WorkersAskChief) as core_context:
        yield core_context
    if started:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


class _Run:
    """One run of torch_batch_process on one rank, in its Core API context."""

    def __init__(self, core_context: core.Context, info: RunInfo, checkpoint_interval: int) -> None:
        self.core = core_context
        self.dist = core_context.distributed
        self.rank, self.size = self.dist.get_rank(), self.dist.get_size()
        self.interval = checkpoint_interval
        self.skip, self.output_uuid = self._resume_point(info)
        self.context = TorchBatchProcessorContext(core_context, f"{self.output_uuid}/rank_{self.rank}")

    def _resume_point(self, info: RunInfo) -> tuple[int, str]:
        """(batches every rank has done, the output uuid): a new uuid on a first run, the
        checkpoint's on a resume."""
        fresh = self.dist.broadcast(str(uuid.uuid4()) if self.rank == 0 else None)
        if info.latest_checkpoint is None:
            return 0, str(fresh)
        md = self.core.checkpoint.get_metadata(info.latest_checkpoint)
        if "default_output_uuid" not in md or "steps_completed" not in md:
            raise ValueError(
                f"checkpoint {info.latest_checkpoint} was not written by torch_batch_process (its metadata has "
                "no steps_completed and default_output_uuid): the trial cannot resume its batch processing from it"
            )
        log.info("resuming: %s batches per rank were processed before", md["steps_completed"])
        return int(md["steps_completed"]), str(md["default_output_uuid"])

    def checkpoint(self, steps: int, length: int) -> None:
        """The progress, as the fewest batches any rank has done; the chief writes it."""
        self.core.train.final_tensorboard_upload()  # AUTO mode's sync of the chief's files
        done = self.dist.gather(steps)
        if done is None:
            return
        fewest = min(done)
        log.info("%s batches per rank done: checkpointing", fewest)
        with self.core.checkpoint.store_path({"steps_completed": fewest, "default_output_uuid": self.output_uuid}) as (
            path,
            _,
        ):
            (path / "batch_completed.json").write_text(json.dumps({"batch_completed": fewest}))
        self.core.train.report_progress(min(fewest, length) / length if length else 1.0)

    def report_reducers(self, steps: int) -> None:
        """Every wrapped reducer, reduced across ranks, as validation metrics at ``steps``."""
        wrapped = list(self.context.reducers)
        if not wrapped:
            return
        gathered = self.dist.gather([w.reducer.per_slot_reduce() for w in wrapped])
        if gathered is not None:
            metrics = self.context.run_cross_slot_reduction(wrapped, gathered)
            self.core.train.report_validation_metrics(steps_completed=steps, metrics=metrics)

    def process(self, processor: TorchBatchProcessor, loader: Any, length: int) -> bool:
        """Batches ``skip`` to ``length`` of this rank, a checkpoint every ``interval``; False
        when a preemption stopped it at one."""
        batches = iter(loader)
        last_checkpoint = -1
        batch_idx = self.skip
        for batch_idx in range(self.skip, length):
            # Ranks whose shard is one batch short get None at the end: they still count the
            # step, so that every rank reaches each checkpoint's collectives.
            batch = next(batches, None)
            if batch is not None:
                processor.process_batch(batch=batch, batch_idx=batch_idx)
            if (batch_idx + 1) % self.interval == 0:
                processor.on_checkpoint_start()
                self.checkpoint(batch_idx + 1, length)
                last_checkpoint = batch_idx
                if self.core.preempt.should_preempt():
                    self.report_reducers(batch_idx + 1)
                    return False
        if batch_idx > last_checkpoint:
            processor.on_checkpoint_start()
            self.checkpoint(length, length)
        self.report_reducers(max(self.skip, length))
        return True


def torch_batch_process(
    batch_processor_cls: type[TorchBatchProcessor],
    dataset: torch.utils.data.Dataset[Any],
    batch_size: Optional[int] = None,
    max_batches: Optional[int] = None,
    checkpoint_interval: int = 5,
    dataloader_kwargs: Optional[dict[str, Any]] = None,
    distributed_context: Optional[DistributedContext] = None,
) -> None:
    """Shard ``dataset`` over the trial's ranks (batch ``i`` of ``batch_size`` records goes to
    rank ``i % ranks``, in order) and call ``process_batch`` of one ``batch_processor_cls`` per
    rank on each batch of its shard, at most ``max_batches`` per rank. Every
    ``checkpoint_interval`` batches, and at the end, ``on_checkpoint_start`` is called and the
    progress is checkpointed; a pause or preemption stops every rank there, and the resumed
    trial starts after it. ``dataloader_kwargs`` go to the torch DataLoader (not ``shuffle``,
    ``sampler`` or ``batch_sampler``). Runs in a trial only: ``det e create`` (``--local`` too),
    with a launcher such as ``determined.launch.torch_distributed`` on several slots."""
    kwargs = dict(dataloader_kwargs or {})
    size_of_batch = _batch_size(batch_size, kwargs, checkpoint_interval)
    if not isinstance(dataset, Sized):
        raise TypeError(f"torch_batch_process(): the dataset ({type(dataset).__name__}) must implement __len__()")
    info = get_cluster_info()
    if info is None or info.task_type != "TRIAL":
        raise RuntimeError(
            "torch_batch_process() runs in a trial (det e create, or det e create --local), where its progress "
            "is checkpointed; it does not run off-cluster"
        )
    with _core_context(distributed_context, info) as core_context:
        run = _Run(core_context, info, checkpoint_interval)
        processor = batch_processor_cls(context=run.context)
        loader = DataLoader(dataset, batch_size=size_of_batch, shuffle=False, **kwargs).get_data_loader(
            repeat=False, skip=run.skip, num_replicas=run.size, rank=run.rank
        )
        length = _iterate_length(max_batches, math.ceil(len(dataset) / size_of_batch / run.size))
        if not run.process(processor, loader, length):
            return
        core_context.train.final_tensorboard_upload()
        processor.on_finish()
        if run.rank == 0 and run.context._use_default_storage:
            log.info("files stored with upload_path() are in %s", run.context._output_base())
        run.dist.gather(None)  # every rank has finished before the trial's process ends
