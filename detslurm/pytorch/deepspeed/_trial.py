"""DeepSpeedTrial: what user code implements to train DeepSpeed engines with the Trainer."""

from __future__ import annotations

import abc
import pathlib
from typing import Any, Union

from detslurm.pytorch._data import data_length
from detslurm.pytorch._reducer import Reducer
from detslurm.pytorch._trial import AnyDataLoader, PyTorchCallback
from detslurm.pytorch.deepspeed._context import DeepSpeedTrialContext


class DeepSpeedTrial(abc.ABC):
    """A trial over DeepSpeed engines. Unlike PyTorchTrial, train_batch and evaluate_batch get
    an iterator of micro batches: a pipeline engine draws as many as it needs itself."""

    trial_context_class = DeepSpeedTrialContext
    # Named in a checkpoint's load_data.json (Determined's trial_type).
    _trial_type = "DeepSpeedTrial"

    @abc.abstractmethod
    def __init__(self, context: DeepSpeedTrialContext) -> None: ...

    @abc.abstractmethod
    def train_batch(self, dataloader_iter: Any, epoch_idx: int, batch_idx: int) -> Union[Any, dict[str, Any]]:
        """One micro batch (one call per micro batch of the batch, unless the context's
        disable_auto_grad_accumulation()): a dict of metrics, or the loss tensor."""

    @abc.abstractmethod
    def build_training_data_loader(self) -> AnyDataLoader: ...

    @abc.abstractmethod
    def build_validation_data_loader(self) -> AnyDataLoader: ...

    def evaluate_batch(self, dataloader_iter: Any, batch_idx: int) -> dict[str, Any]:
        raise NotImplementedError("implement evaluate_batch or evaluate_full_dataset")

    def evaluate_full_dataset(self, data_loader: AnyDataLoader) -> dict[str, Any]:
        raise NotImplementedError("implement evaluate_batch or evaluate_full_dataset")

    def build_callbacks(self) -> dict[str, PyTorchCallback]:
        return {}

    def evaluation_reducer(self) -> Union[Reducer, dict[str, Reducer]]:
        return Reducer.AVG

    def save(self, context: DeepSpeedTrialContext, path: pathlib.Path) -> None:
        """Called on every rank (an engine saves its own shard): each wrapped engine under the
        tag ``model<i>``."""
        engines: list[Any] = context.models  # DeepSpeed engines (untyped)
        for i, engine in enumerate(engines):
            engine.save_checkpoint(path, tag=f"model{i}")

    def load(self, context: DeepSpeedTrialContext, load_path: pathlib.Path) -> None:
        """The engines' state from what :meth:`save` wrote."""
        engines: list[Any] = context.models
        for i, engine in enumerate(engines):
            try:
                engine.load_checkpoint(load_path, tag=f"model{i}")
            except AssertionError as e:
                # DeepSpeed's loader asserts without a message: say which engine and where.
                raise RuntimeError(f"DeepSpeed could not load engine model{i} from {load_path}: {e!r}") from None

    def get_batch_length(self, batch: Any) -> int:
        """Records in ``batch``; override for batch types data_length() does not know."""
        return data_length(batch)
