"""What a batch processor is handed (``TorchBatchProcessorContext``), and the class it extends."""

from __future__ import annotations

import abc
import contextlib
import os
from pathlib import Path
from typing import Any, Optional

import torch

from detslurm.ckpt_settings import checkpoint_modes
from detslurm.core import Context as CoreContext
from detslurm.core import get_cluster_info
from detslurm.core._checkpoint import ensure_base
from detslurm.pytorch._data import to_device
from detslurm.pytorch._reducer import ReducerContext


def get_default_device(core_context: CoreContext) -> torch.device:
    """This rank's device: the GPU of its local rank where CUDA has GPUs (the launchers start one
    process per slot of a node), else the CPU."""
    if torch.cuda.device_count() == 0:
        return torch.device("cpu")
    return torch.device("cuda", core_context.distributed.local_rank)


class TorchBatchProcessorContext(ReducerContext):
    """Handed to a :class:`TorchBatchProcessor`: its device, its rank, reports and custom
    reducers, and a directory for the files it writes (``upload_path``)."""

    def __init__(self, core_context: CoreContext, storage_path: str) -> None:
        super().__init__(core_context.distributed)
        self._core_context = core_context
        self.device = get_default_device(core_context)
        self._tensorboard_path = core_context.train.get_tensorboard_path()
        # Relative to the checkpoint storage: "<output uuid>/rank_<rank>", the same on a resume.
        self._storage_path = storage_path
        self._use_default_storage = False

    def get_hparams(self) -> dict[str, Any]:
        """The trial's hyperparameters."""
        info = get_cluster_info()
        if info is None or info.task_type != "TRIAL":
            raise RuntimeError("get_hparams() works only in a trial (det e create), where the hyperparameters are")
        return dict(info.trial.hparams)

    def to_device(self, data: Any, warned_types: Optional[set[type]] = None) -> Any:
        """``data`` on this rank's device: tensors (and anything with a ``.to()``) through nested
        dicts, lists and tuples, numeric numpy arrays as tensors; what cannot move is passed on,
        with one warning per type."""
        return to_device(data, self.device, warned_types)

    def get_tensorboard_path(self) -> Path:
        """Where this rank may write TensorBoard files (a profiler's traces, say); they are
        uploaded with the trial's TensorBoard files."""
        return self._tensorboard_path

    def prepare_model_for_inference(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` in eval mode, on this rank's device."""
        model.eval()
        model.to(self.device)
        return model

    def upload_path(self) -> contextlib.AbstractContextManager[Path]:
        """A directory for this rank's output files, in the checkpoint storage under one uuid
        per run of ``torch_batch_process`` (kept on a resume), then ``rank_<rank>``. The storage
        is a shared filesystem: the files are in place when the ``with`` block ends."""
        self._use_default_storage = True
        path = self._output_base() / Path(self._storage_path).name
        ensure_base(path, checkpoint_modes(os.environ))
        return contextlib.nullcontext(path)

    def _output_base(self) -> Path:
        """The directory of every rank's ``upload_path``."""
        return Path(self._core_context.checkpoint.base) / Path(self._storage_path).parent

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Metrics of ``group`` (``training``, ``validation`` or a name of your own, without a
        ``.``) at ``steps_completed``, as ``core_context.train.report_metrics``."""
        self._core_context.train.report_metrics(group=group, steps_completed=steps_completed, metrics=metrics)

    def report_task_using_model_version(self, model_version: Any) -> None:
        """Record that this task uses ``model_version`` (accepted and logged: the model
        registry is Determined's master's)."""
        self._core_context.experimental.report_task_using_model_version(model_version)

    def report_task_using_checkpoint(self, checkpoint: Any) -> None:
        """Record that this task uses ``checkpoint`` (accepted and logged, as
        ``core_context.experimental.report_task_using_checkpoint``)."""
        self._core_context.experimental.report_task_using_checkpoint(checkpoint)

    def get_distributed_rank(self) -> int:
        """This process's rank among the trial's processes."""
        return self._core_context.distributed.get_rank()

    def get_distributed_size(self) -> int:
        """How many processes (slots) the trial runs."""
        return self._core_context.distributed.get_size()


class TorchBatchProcessor(metaclass=abc.ABCMeta):
    """Your batch processing: built once per rank with the context (load a model there), then
    ``process_batch`` for each batch of this rank's shard."""

    @abc.abstractmethod
    def __init__(self, context: TorchBatchProcessorContext) -> None:
        """Set up what processing needs (a model, an output file) from ``context``."""

    @abc.abstractmethod
    def process_batch(self, batch: Any, batch_idx: int) -> None:
        """Process one batch. ``batch_idx`` counts this rank's batches (0, 1, ...): with 8
        batches and 4 ranks, each rank gets batch_idx 0 and 1."""

    def on_checkpoint_start(self) -> None:  # noqa: B027 (a hook: doing nothing is the default)
        """Called before each checkpoint of the progress: flush what ``process_batch`` buffered,
        since the batches before it are not processed again on a resume."""

    def on_finish(self) -> None:  # noqa: B027 (a hook: doing nothing is the default)
        """Called once, after the last batch and its checkpoint."""
