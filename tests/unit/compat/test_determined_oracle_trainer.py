"""The same trial code, run off-cluster by the real determined 0.38.1's Trainer and by ours.

tests/fixtures/onevar_trial.py (written against Determined's API only) records every callback
call with its arguments: the training windows' averages and per-batch metrics (custom reducers
of both styles included), the validation metrics, the LR at every batch, epoch starts and ends
(a legacy ``on_training_epoch_start(self)`` callback too). Both runs must record the same
sequence. Determined averages a window in float32, detslurm in float64: numbers are compared to
a relative 1e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from determined_oracle import first_difference, oracle_python, same

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures/onevar_trial.py"


def run(python: Path | str, spec: dict[str, Any], tmp_path: Path, name: str) -> list[Any]:
    out = tmp_path / f"{name}.json"
    # HOME: Determined's Trainer writes its off-cluster checkpoints under the user's data dir,
    # and copies the working dir into each: the two must not nest.
    work = tmp_path / f"cwd-{name}"
    work.mkdir()
    env = {**os.environ, "HOME": str(tmp_path / f"home-{name}")}
    r = subprocess.run(
        [str(python), str(FIXTURE), str(out), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
        timeout=600,
    )
    assert r.returncode == 0, f"{name}: {r.stderr[-4000:]}"
    events: list[Any] = json.loads(out.read_text())
    return events


HPARAMS = {"global_batch_size": 8, "lr": 0.1, "shuffle_seed": 5}
FIT = {"max_length": ["batches", 10], "validation_period": ["batches", 4], "reporting_period": ["batches", 3]}


@pytest.mark.parametrize(
    ("loader", "step_mode", "legacy"),
    [
        ("torch", 2, True),  # samplers, STEP_EVERY_BATCH, the legacy callback signature
        ("determined", 1, False),  # det.pytorch.DataLoader, STEP_EVERY_EPOCH (8 batches an epoch)
        ("determined", 3, True),  # MANUAL_STEP: the LR never changes
        ("torch", 4, False),  # STEP_EVERY_OPTIMIZER_STEP
    ],
)
def test_the_same_trial_records_the_same_under_both_trainers(
    tmp_path: Path, loader: str, step_mode: int, legacy: bool
) -> None:
    hparams = {**HPARAMS, "dataloader_type": loader, "step_mode": step_mode, "legacy_callback": legacy}
    spec = {"hparams": hparams, "fit": {**FIT, "checkpoint_policy": "none"}}
    theirs = run(oracle_python(), spec, tmp_path, "determined")
    ours = run(sys.executable, spec, tmp_path, "detslurm")
    assert same(theirs, ours), first_difference(theirs, ours)
    # The comparison is not vacuous: training ran, reducers and the legacy hook were seen.
    windows = [e for e in ours if e[0] == "on_training_workload_end"]
    assert windows and all("cls_reducer" in w[1] and "fn_reducer" in w[1] for w in windows)
    assert (["legacy_epoch_start"] in ours) is legacy


SAMPLERS_PROBE = """
import json, torch
from determined.pytorch import samplers, adapt_batch_sampler
seq = torch.utils.data.SequentialSampler(range(10))
batches = lambda s, n=3: torch.utils.data.BatchSampler(s, n, drop_last=False)
shuffled = samplers.ReproducibleShuffleSampler(seq, 7)
out = {
    "shuffle": [list(shuffled), list(shuffled)],
    "shuffle_len": len(shuffled),
    "repeat": [i for i, _ in zip(samplers.RepeatSampler(seq), range(23))],
    "dist": [list(samplers.DistributedSampler(seq, num_workers=3, rank=r)) for r in range(3)],
    "dist_len": [len(samplers.DistributedSampler(seq, num_workers=3, rank=r)) for r in range(3)],
    "dist_batches": [list(samplers.DistributedBatchSampler(batches(seq), 2, r)) for r in range(2)],
    "dist_batches_len": [len(samplers.DistributedBatchSampler(batches(seq), 2, r)) for r in range(2)],
    "skip": list(samplers.SkipSampler(seq, 4)),
    "skip_len": len(samplers.SkipSampler(seq, 4)),
    "skip_batches": list(samplers.SkipBatchSampler(batches(seq), 2)),
    "skip_past_end": list(samplers.SkipBatchSampler(batches(seq), 9)),
    "shuffle_batches": list(samplers.ReproducibleShuffleBatchSampler(batches(seq), 3)),
    "repeat_batches": [b for b, _ in zip(samplers.RepeatBatchSampler(batches(seq)), range(6))],
    "adapted": [b for b, _ in zip(adapt_batch_sampler(batches(seq, 2), repeat=True, skip=2, num_replicas=2, rank=1), range(5))],
}
for bad in ((2, 2), (0, 0), (2, -1)):
    try:
        samplers.DistributedBatchSampler(batches(seq), *bad)
        out[f"bad{bad}"] = "accepted"
    except ValueError:
        out[f"bad{bad}"] = "ValueError"
print(json.dumps(out))
"""


def probe(python: Path | str, code: str) -> Any:
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_samplers_yield_what_determined_yields() -> None:
    theirs = probe(oracle_python(), SAMPLERS_PROBE)
    assert probe(sys.executable, SAMPLERS_PROBE) == theirs
    assert theirs["shuffle"][0] != theirs["shuffle"][1]  # each pass draws a new order


DATA_PROBE = """
import json, logging, numpy as np, torch
from determined import pytorch
batch = {"x": np.ones((3, 2), dtype=np.float32), "ids": np.array(["a", "b", "c"]), "t": (torch.zeros(3), [torch.ones(3)]), "n": 5}
moved = pytorch.to_device(batch, torch.device("cpu"))
kinds = {k: type(v).__name__ for k, v in moved.items()}
kinds["t"] = [type(moved["t"]).__name__, type(moved["t"][0]).__name__, type(moved["t"][1]).__name__]
lengths = [pytorch.data_length(d) for d in (torch.zeros(4, 2), np.zeros(3), {"a": torch.zeros(2)}, [torch.zeros(5)], (np.zeros(6),))]
errors = []
for bad in ({}, [], (), 3):
    try:
        pytorch.data_length(bad)
    except (ValueError, TypeError) as e:
        errors.append(type(e).__name__)
print(json.dumps({"kinds": kinds, "lengths": lengths, "errors": errors}))
"""


def test_to_device_and_data_length_behave_as_determined() -> None:
    theirs = probe(oracle_python(), DATA_PROBE)
    assert probe(sys.executable, DATA_PROBE) == theirs
    assert theirs["kinds"]["x"] == "Tensor" and theirs["kinds"]["ids"] == "ndarray"
