"""The PyTorch Trainer API (Determined's ``det.pytorch``), importable without a cluster."""

from detslurm.pytorch._context import CheckpointLoadContext, LRScheduler, PyTorchTrialContext
from detslurm.pytorch._init import init
from detslurm.pytorch._trainer import Trainer
from detslurm.pytorch._trial import PyTorchCallback, PyTorchTrial, Reducer, TorchData
from detslurm.pytorch._units import Batch, Epoch, TrainUnit

__all__ = [
    "Batch",
    "CheckpointLoadContext",
    "Epoch",
    "LRScheduler",
    "PyTorchCallback",
    "PyTorchTrial",
    "PyTorchTrialContext",
    "Reducer",
    "TorchData",
    "TrainUnit",
    "Trainer",
    "init",
]
