"""Batch processing over a trial's slots (Determined's ``det.pytorch.experimental``): offline
inference or feature extraction over a dataset, sharded across ranks and resumable."""

from detslurm.pytorch.experimental._batch_process import torch_batch_process
from detslurm.pytorch.experimental._context import (
    TorchBatchProcessor,
    TorchBatchProcessorContext,
    get_default_device,
)

__all__ = ["TorchBatchProcessor", "TorchBatchProcessorContext", "get_default_device", "torch_batch_process"]
