"""A Trainer script run as a plain `python script.py`, off-cluster, as a new user first runs
one: a missing hparams says where they come from, checkpoints go to DETSLURM_CHECKPOINT_DIR,
and each reporting period's metrics are logged as Determined 0.38.1 logs them (the same script
runs under the real Determined, side by side)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from determined_oracle import oracle_python

pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.e2e]

SCRIPT = """
import logging
import sys

import torch
from torch.utils.data import TensorDataset

import determined as det
from determined import pytorch


class Linear(pytorch.PyTorchTrial):
    def __init__(self, context):
        self.context = context
        torch.manual_seed(0)
        self.model = context.wrap_model(torch.nn.Linear(2, 1))
        lr = context.get_hparam("lr")
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=lr))

    def build_training_data_loader(self):
        g = torch.Generator().manual_seed(1)
        return pytorch.DataLoader(TensorDataset(torch.randn(64, 2, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)

    def build_validation_data_loader(self):
        g = torch.Generator().manual_seed(2)
        return pytorch.DataLoader(TensorDataset(torch.randn(16, 2, generator=g), torch.randn(16, 1, generator=g)), batch_size=8)

    def train_batch(self, batch, epoch_idx, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}

    def evaluate_batch(self, batch):
        x, y = batch
        return {"val_loss": torch.nn.functional.mse_loss(self.model(x), y)}


logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
hparams = {"lr": 0.1} if sys.argv[1] == "with-hparams" else None
with pytorch.init(hparams=hparams) as ctx:
    pytorch.Trainer(Linear(ctx), ctx).fit(
        max_length=pytorch.Batch(6),
        reporting_period=pytorch.Batch(2),
        validation_period=pytorch.Batch(3),
        checkpoint_period=pytorch.Batch(3),
    )
"""

# "INFO: [pid] <logger>: report_training_metrics(steps_completed=2, metrics={'loss': ...})"
REPORT = re.compile(r"^(\w+): \[\d+\] [\w.]+: report_(training|validation)_metrics\(steps_completed=(\d+), metrics=\{")


def _run(python: Path | str, work: Path, arg: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    work.mkdir(exist_ok=True)
    (work / "script.py").write_text(SCRIPT)
    return subprocess.run(
        [str(python), "script.py", arg], capture_output=True, text=True, timeout=300, cwd=work, env=env
    )


def _env(tmp_path: Path) -> dict[str, str]:
    """No trial around, private dirs; HOME outside the script's dir (Determined's local
    checkpoints go under it, and copy the script's dir into each one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_", "DETSLURM_", "SLURM_"))}
    (tmp_path / "home").mkdir(exist_ok=True)
    return env | {
        "HOME": str(tmp_path / "home"),
        "DETSLURM_DATA_DIR": str(tmp_path / "data"),
        "DETSLURM_CONFIG": str(tmp_path / "no-config.yaml"),
        "DETSLURM_CHECKPOINT_DIR": str(tmp_path / "ckpts"),
    }


def _reports(stderr: str) -> list[tuple[str, str, int]]:
    return [(m[1], m[2], int(m[3])) for line in stderr.splitlines() if (m := REPORT.match(line))]


def test_missing_hparams_say_where_they_come_from(tmp_path: Path) -> None:
    r = _run(sys.executable, tmp_path / "ours", "no-hparams", _env(tmp_path))
    # Before: KeyError: "hyperparameter 'lr' not found; the trial has: none".
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: hyperparameter 'lr' is not set"), r.stderr
    assert "det.pytorch.init(hparams={...})" in last and "det e create" in last
    # Determined raises a ValueError too (its text says only to check the init() call).
    theirs = _run(oracle_python(), tmp_path / "theirs", "no-hparams", _env(tmp_path))
    assert theirs.stderr.strip().splitlines()[-1].startswith("ValueError: hparams is undefined")


def test_trains_with_reports_logged_and_checkpoints_in_the_checkpoint_dir(tmp_path: Path) -> None:
    env = _env(tmp_path)
    r = _run(sys.executable, tmp_path / "ours", "with-hparams", env)
    assert r.returncode == 0, r.stderr
    ours = _reports(r.stderr)
    # Before: nothing (reports were logged at DEBUG only).
    assert ours == [
        ("INFO", "training", 2),
        ("INFO", "training", 3),
        ("INFO", "validation", 3),
        ("INFO", "training", 4),
        ("INFO", "training", 6),
        ("INFO", "validation", 6),
    ]
    theirs = _run(oracle_python(), tmp_path / "theirs", "with-hparams", env)
    assert theirs.returncode == 0, theirs.stderr
    assert ours == _reports(theirs.stderr)
    # Before: under DETSLURM_DATA_DIR/checkpoints, whatever DETSLURM_CHECKPOINT_DIR said.
    saved = [p for p in (tmp_path / "ckpts").iterdir() if (p / "metadata.json").is_file()]
    assert len(saved) == 2 and not (tmp_path / "data" / "checkpoints").exists()
