"""The PyTorch Trainer API (Determined's ``det.pytorch``), importable without a cluster."""

# Private modules re-exported here, as Determined's det.pytorch does, so user code writes
# `pytorch.Trainer` and the module layout can change without breaking it.
from detslurm.pytorch import samplers
from detslurm.pytorch._context import (
    CheckpointLoadContext,
    LRScheduler,
    PyTorchExperimentalContext,
    PyTorchTrialContext,
)
from detslurm.pytorch._data import DataLoader, adapt_batch_sampler, data_length, to_device
from detslurm.pytorch._init import init
from detslurm.pytorch._reducer import MetricReducer, Reducer
from detslurm.pytorch._state import load_trial_from_checkpoint_path
from detslurm.pytorch._trainer import Trainer
from detslurm.pytorch._trial import PyTorchCallback, PyTorchTrial, TorchData
from detslurm.pytorch._units import Batch, Epoch, TrainUnit

__all__ = [
    "Batch",
    "CheckpointLoadContext",
    "DataLoader",
    "Epoch",
    "LRScheduler",
    "MetricReducer",
    "PyTorchCallback",
    "PyTorchExperimentalContext",
    "PyTorchTrial",
    "PyTorchTrialContext",
    "Reducer",
    "TorchData",
    "TrainUnit",
    "Trainer",
    "adapt_batch_sampler",
    "data_length",
    "init",
    "load_trial_from_checkpoint_path",
    "samplers",
    "to_device",
]
