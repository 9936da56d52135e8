"""PyTorchTrial and callbacks: what user code implements."""

from __future__ import annotations

import abc
from typing import Any, Optional, Union

from detslurm.pytorch._reducer import Reducer

TorchData = Union[dict[str, Any], list[Any], tuple[Any, ...], Any]
# build_*_data_loader returns a det.pytorch.DataLoader (sharded, resumable) or a torch one.
# Typed Any so that user trials returning either kind type-check without importing torch's.
AnyDataLoader = Any


class PyTorchCallback:
    """Hooks called by the Trainer; override what you need."""

    # Names and signatures are Determined's PyTorchCallback's, so existing callbacks work as
    # they are; every hook is a no-op unless overridden.
    def on_trial_startup(self, first_batch_idx: int, checkpoint_uuid: Optional[str]) -> None: ...
    def on_training_start(self) -> None: ...
    def on_training_epoch_start(self, epoch_idx: int) -> None: ...
    def on_training_epoch_end(self, epoch_idx: int) -> None: ...
    def on_training_workload_end(self, avg_metrics: dict[str, Any], batch_metrics: list[dict[str, Any]]) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self, outputs: list[Any]) -> None: ...
    def on_validation_end(self, metrics: dict[str, Any]) -> None: ...
    def on_checkpoint_save_start(self, checkpoint: dict[str, Any]) -> None: ...
    def on_checkpoint_load_start(self, checkpoint: dict[str, Any]) -> None: ...
    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None: ...
    def on_checkpoint_upload_end(self, uuid: str) -> None: ...
    def on_checkpoint_end(self, checkpoint_dir: str) -> None: ...
    def on_trial_shutdown(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class PyTorchTrial(abc.ABC):
    """Determined's PyTorchTrial: the user's model, optimizer and data, driven by the Trainer."""

    @abc.abstractmethod
    def __init__(self, context: Any) -> None: ...

    @abc.abstractmethod
    def train_batch(self, batch: TorchData, epoch_idx: int, batch_idx: int) -> dict[str, Any]: ...

    @abc.abstractmethod
    def build_training_data_loader(self) -> AnyDataLoader: ...

    @abc.abstractmethod
    def build_validation_data_loader(self) -> AnyDataLoader: ...

    # Neither evaluate method is abstract: a trial implements one of the two, and the Trainer
    # uses evaluate_full_dataset when it is overridden.
    def evaluate_batch(self, batch: TorchData, batch_idx: int) -> dict[str, Any]:
        raise NotImplementedError("implement evaluate_batch or evaluate_full_dataset")

    def evaluate_full_dataset(self, data_loader: AnyDataLoader) -> dict[str, Any]:
        raise NotImplementedError("implement evaluate_batch or evaluate_full_dataset")

    def evaluation_reducer(self) -> Union[Reducer, dict[str, Reducer]]:
        return Reducer.AVG

    def build_callbacks(self) -> dict[str, PyTorchCallback]:
        return {}

    def get_batch_length(self, batch: TorchData) -> int:
        """Records in ``batch`` (for records_per_s); override for batches of another shape."""
        if isinstance(batch, (list, tuple)):
            # The first element of a (inputs, labels) batch holds one row per record.
            return len(batch[0])
        if isinstance(batch, dict):
            return len(next(iter(batch.values())))
        return len(batch)
