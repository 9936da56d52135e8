"""A shuffled ``det.pytorch.DataLoader`` deals the same records to the same batches under the real
determined 0.38.1's Trainer and under ours, for the same seed: one slot, and each of two slots.

tests/fixtures/order_trial.py records every batch's records (and every validation batch's); both
Trainers run it off-cluster from the same seeded global RNG, which the trial also draws from at
every batch (as dropout does) and validations draw from in between."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from determined_oracle import oracle_python, record_script

from detslurm.protocol.secret import SECRET_ENV, new_secret

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures/order_trial.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run(python: Path | str, spec: dict[str, Any], tmp_path: Path, name: str, world: int = 1) -> list[Any]:
    """Each rank's records, from ``world`` processes with torchrun's rank variables."""
    work = tmp_path / f"cwd-{name}"
    work.mkdir()
    # HOME: Determined's Trainer writes off-cluster checkpoints under the user's data dir.
    env = {**os.environ, "HOME": str(tmp_path / f"home-{name}"), SECRET_ENV: new_secret().hex()}
    if world > 1:
        ports = free_port()
        env |= {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}
        # Determined's ZMQ ports (its own variables) and ours: free ones, not the fixed defaults.
        env |= {"INTER_TRAIN_PROCESS_COMM_PORT_1": str(ports), "INTER_TRAIN_PROCESS_COMM_PORT_2": str(free_port())}
        env |= {"DETSLURM_DIST_PORT": str(ports), "USE_TORCH_DISTRIBUTED": "1"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(
            [str(python), str(FIXTURE), str(work / f"rank{r}.json"), json.dumps(spec)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)} if world > 1 else env,
            cwd=work,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), f"{name}: " + "\n".join(o[1][-3000:] for o in outs)
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(world)]


def train_batches(seen: list[Any]) -> list[Any]:
    return [s for s in seen if s[0] == "train"]


HPARAMS = {"records": 40, "validation_records": 12, "drop_last": False, "shuffle_validation": False}


@pytest.mark.parametrize(
    "hparams",
    [
        {"global_batch_size": 4},
        {"global_batch_size": 6, "drop_last": True},  # 6 full batches an epoch, 4 records dropped
        {"global_batch_size": 6, "shuffle_validation": True},  # a short last batch, shuffled validation
    ],
)
def test_one_slot_trains_the_records_in_determineds_order(tmp_path: Path, hparams: dict[str, Any]) -> None:
    spec = {"seed": 17, "hparams": {**HPARAMS, **hparams}, "batches": 25, "validate_every": 7}
    (theirs,) = run(oracle_python(), spec, tmp_path, "determined")
    (ours,) = run(sys.executable, spec, tmp_path, "detslurm")
    first_epoch = [i for s in train_batches(theirs) if s[1] == 0 for i in s[3]]
    assert len({s[1] for s in train_batches(theirs)}) >= 3 and first_epoch != sorted(first_epoch)  # shuffled
    assert ours == theirs


def test_each_of_two_slots_trains_the_records_in_determineds_order(tmp_path: Path) -> None:
    spec = {"seed": 5, "hparams": {**HPARAMS, "global_batch_size": 8}, "batches": 13, "validate_every": 4}
    theirs = run(oracle_python(), spec, tmp_path, "determined", world=2)
    ours = run(sys.executable, spec, tmp_path, "detslurm", world=2)
    assert [len(train_batches(r)) for r in theirs] == [13, 13]
    assert ours == theirs


LOADER_SCRIPT = r"""
import itertools, json, sys
import torch
from determined import pytorch

data = torch.arange(11)
out = {}
torch.manual_seed(3)
loader = pytorch.DataLoader(data, batch_size=3, shuffle=True)
out["passes"] = [[b.tolist() for b in loader] for _ in range(2)]
out["repeat-2-1"] = [b.tolist() for b in itertools.islice(loader.get_data_loader(repeat=True, num_replicas=2, rank=1), 9)]
own = pytorch.DataLoader(data, batch_size=4, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1))
out["own-generator"] = [[b.tolist() for b in own] for _ in range(3)]
sampler = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(2))
out["random-sampler"] = [[b.tolist() for b in pytorch.DataLoader(data, batch_size=5, sampler=sampler)] for _ in range(2)]
out["global-after"] = torch.rand(2).tolist()  # the global RNG was drawn from alike
json.dump(out, open(sys.argv[1], "w"), sort_keys=True)
"""


def test_a_shuffled_loader_iterated_by_hand_draws_determineds_orders(tmp_path: Path) -> None:
    """Outside the Trainer (a pass over the loader, get_data_loader): each pass draws a new order
    as torch's RandomSampler does, from the loader's or the sampler's generator or the global RNG."""
    theirs = record_script(oracle_python(), LOADER_SCRIPT, tmp_path / "determined")
    ours = record_script(sys.executable, LOADER_SCRIPT, tmp_path / "detslurm")
    assert theirs["passes"][0] != theirs["passes"][1] and theirs["own-generator"][0] != theirs["own-generator"][1]
    assert ours == theirs
