"""``determined.experimental``'s checkpoint and metrics submodules and ``test_one_batch``, run by
the real determined 0.38.1 and by us: one script, written against Determined's API only,
prints what it saw; the two records must be equal."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from determined_oracle import oracle_python, record_script

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

SCRIPT = r"""
import json, sys
import torch
from determined import pytorch
import determined.experimental as exp
from determined.experimental import checkpoint, client, metrics

out = {}
out["checkpoint_names"] = sorted(n for n in dir(checkpoint) if n[:1].isupper())
out["metrics_names"] = sorted(n for n in dir(metrics) if n[:1].isupper() and n.endswith("Metrics"))
out["same_classes"] = [checkpoint.Checkpoint is client.Checkpoint, checkpoint.CheckpointState is client.CheckpointState,
                       metrics.TrialMetrics is client.TrialMetrics]
calls = []
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(12, 2, generator=g), torch.randn(12, 1, generator=g))

class OneVar(pytorch.PyTorchTrial):
    def __init__(self, context):
        self.context = context
        torch.manual_seed(1)
        self.model = context.wrap_model(torch.nn.Linear(2, 1))
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=context.get_hparam("lr")))

    def train_batch(self, batch, epoch_idx, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        calls.append(["train", epoch_idx, batch_idx, len(x), round(loss.item(), 6)])
        return {"loss": loss}

    def evaluate_batch(self, batch):
        calls.append(["evaluate", len(batch[0])])
        return {"v": 1.0}

    def build_training_data_loader(self):
        return pytorch.DataLoader(data, batch_size=self.context.get_per_slot_batch_size())

    def build_validation_data_loader(self):
        return pytorch.DataLoader(data, batch_size=3)

config = {"hyperparameters": {"lr": 0.1, "global_batch_size": 4},
          "searcher": {"name": "single", "metric": "v", "max_length": {"batches": 5}}}
exp.test_one_batch(OneVar, config)
out["calls"] = calls
json.dump(out, open(sys.argv[1], "w"), sort_keys=True)
"""


def record(python: Path | str, tmp_path: Path, name: str) -> dict[str, Any]:
    # Off-cluster checkpoints (Determined's under HOME, ours under the data dir) stay in tmp,
    # outside the working dir, which Determined copies into each checkpoint.
    env = {**os.environ, "HOME": str(tmp_path / f"home-{name}"), "DETSLURM_DATA_DIR": str(tmp_path / f"data-{name}")}
    env["DETSLURM_CHECKPOINT_DIR"] = str(tmp_path / f"ckpts-{name}")
    return record_script(python, SCRIPT, tmp_path / name, env, timeout=600)


def test_sdk_submodules_and_test_one_batch_behave_as_determined(tmp_path: Path) -> None:
    theirs = record(oracle_python(), tmp_path, "determined")
    ours = record(sys.executable, tmp_path, "detslurm")
    assert theirs["calls"][0][:4] == ["train", 0, 0, 4]  # the oracle ran: one batch, then one validation batch
    assert ours == theirs


def test_test_one_batch_refuses_what_is_not_a_trial_class() -> None:
    import detslurm.experimental as exp

    with pytest.raises(TypeError, match="PyTorchTrial or DeepSpeedTrial"):
        exp.test_one_batch(dict, {})
