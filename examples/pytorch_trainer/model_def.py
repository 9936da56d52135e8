"""Seed 003's MyPyTorchTrial on synthetic MNIST-shaped tensors (no downloads).

Runs as written: locally (``python3 train.py``), with ``torchrun --nproc_per_node=2 train.py``,
and on a cluster (``det e create const.yaml .``, entrypoint ``python3 -m
determined.launch.torch_distributed python3 train.py``), and as a legacy trial
(``entrypoint: model_def:MyPyTorchTrial``).
"""

import os
from typing import Any

import determined as det
import torch
from determined import pytorch
from determined.pytorch import PyTorchTrialContext
from torch import nn
from torch.utils.data import TensorDataset


def synthetic(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 28, 28, generator=g)
    w = torch.randn(28 * 28, 10, generator=torch.Generator().manual_seed(0))
    y = (x.flatten(1) @ w).argmax(1)  # a learnable labelling
    return TensorDataset(x, y)


class MyPyTorchTrial(pytorch.PyTorchTrial):
    def __init__(self, context: PyTorchTrialContext, hparams: dict = None) -> None:
        self.context = context
        hparams = hparams or context.get_hparams()
        self.batch_size = int(hparams.get("global_batch_size", 32))
        self.model = context.wrap_model(
            nn.Sequential(
                nn.Flatten(),
                nn.Linear(784, 128),
                nn.ReLU(),
                nn.Dropout(0.1),
                nn.Linear(128, 10),
                nn.LogSoftmax(dim=1),
            )
        )
        self.optimizer = context.wrap_optimizer(torch.optim.Adadelta(self.model.parameters(), lr=hparams["lr"]))

    def train_batch(self, batch: pytorch.TorchData, epoch_idx: int, batch_idx: int) -> dict[str, torch.Tensor]:
        crash = os.environ.get("EXAMPLE_CRASH_AT_BATCH")  # for the kill-and-resume test
        info = det.get_cluster_info()
        if crash and info and info.trial._trial_run_id == 1 and batch_idx + 1 == int(crash):
            os._exit(3)
        data, labels = batch
        output = self.model(data)
        loss = torch.nn.functional.nll_loss(output, labels)
        self.context.backward(loss)
        self.context.step_optimizer(self.optimizer)
        return {"loss": loss}

    def evaluate_batch(self, batch: pytorch.TorchData, batch_idx: int) -> dict[str, Any]:
        data, labels = batch
        output = self.model(data)
        validation_loss = torch.nn.functional.nll_loss(output, labels).item()
        accuracy = (output.argmax(1) == labels).float().mean().item()
        return {"validation_loss": validation_loss, "accuracy": accuracy}

    def build_training_data_loader(self) -> pytorch.DataLoader:
        # Per-slot batches: each of N ranks gets its own shard; one step trains the global batch.
        return pytorch.DataLoader(synthetic(1024, 1), batch_size=self.context.get_per_slot_batch_size(), shuffle=True)

    def build_validation_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(synthetic(256, 2), batch_size=self.context.get_per_slot_batch_size())
