"""Two slots, off-cluster: the same trial run by two processes under the real determined 0.38.1's
Trainer and under ours (torchrun's rank variables, gloo) records the same on each rank.

tests/fixtures/onevar_trial.py with a det.pytorch.DataLoader sharded over the two ranks, custom
reducers of both styles (the class one returns its per-slot values too, so the cross-slot
reduction is seen), per-metric evaluation reducers over values that are not one number, and
training windows averaged across the slots. tests/cluster/test_onevar_slots_cluster.py runs the
same trial with 2 slots on the Slurm test cluster against one process.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from determined_oracle import first_difference, onevar_start, oracle_python, same

from detslurm.protocol.secret import SECRET_ENV, new_secret

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

SPEC = {
    "hparams": {
        "global_batch_size": 8,
        "lr": 0.1,
        "shuffle_seed": 5,
        "step_mode": 2,
        "dataloader_type": "determined",
        "evaluate": "reducers",
        "labels": "steps",
    },
    "fit": {
        "max_length": ["batches", 6],
        "validation_period": ["batches", 3],
        "reporting_period": ["batches", 2],
        "checkpoint_policy": "none",
    },
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def two_ranks(python: Path | str, work: Path, name: str) -> list[Any]:
    """Each rank's record of SPEC, from two processes with torchrun's rank variables."""
    env = {"HOME": str(work / f"home-{name}"), SECRET_ENV: new_secret().hex(), "WORLD_SIZE": "2"}
    env |= {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "USE_TORCH_DISTRIBUTED": "1"}
    # Determined's ZMQ ports (its own variables) and ours: free ones, not the fixed defaults.
    port = free_port()
    env |= {"INTER_TRAIN_PROCESS_COMM_PORT_1": str(port), "INTER_TRAIN_PROCESS_COMM_PORT_2": str(free_port())}
    env |= {"DETSLURM_DIST_PORT": str(port), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        onevar_start(python, SPEC, work, f"{name}-{rank}", {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        for rank in range(2)
    ]
    deadline = time.monotonic() + 600
    # A rank that fails leaves the other waiting in a collective: stop it at once.
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for rank, p in enumerate(procs):
        err = p.communicate()[1]
        assert p.returncode == 0, f"{name} rank {rank}: {err[-4000:]}"
    # The fixture writes OUT.json on rank 0 and OUT.json.rank<R> on the others.
    return [json.loads((work / f"{name}-{rank}.json{f'.rank{rank}' if rank else ''}").read_text()) for rank in range(2)]


def test_each_of_two_slots_records_what_determined_records(tmp_path: Path) -> None:
    theirs = two_ranks(oracle_python(), tmp_path, "determined")
    ours = two_ranks(sys.executable, tmp_path, "detslurm")
    for rank in range(2):
        assert same(theirs[rank], ours[rank]), f"rank {rank}: {first_difference(theirs[rank], ours[rank])}"
    # Not vacuous: the ranks trained on different labels, which the reducers saw per slot.
    (first, *_) = [e for e in ours[0] if e[0] == "on_training_workload_end"]
    assert first[1]["cls_per_slot"] == [5.0, 3.0] and len(first[2]) == 2
    validation = next(e for e in ours[0] if e[0] == "on_validation_end")[1]
    assert validation["idx_sum"] == 2 * sum(range(8)) and len(validation["cls_per_slot"]) == 2
