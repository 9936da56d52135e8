"""`det job update --resource-pool` on a running trial, on the real cluster: its own experiment
moves (checkpoint, resubmit in the new partition); another store's experiment with the same id
is left alone."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES
from helpers import wait_for

from detslurm import settings, views
from detslurm.identity import Scope
from detslurm.store import open_store

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
CORE = EXAMPLES / "core_api"


def running_jobs() -> dict[str, str]:
    """job id -> partition of the running jobs."""
    out = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i %P"], capture_output=True, text=True).stdout
    return dict(line.split() for line in out.splitlines())


def pool_of(exp_id: int) -> str:
    with open_store(settings.load().db_url).tx() as s:
        return views.get_experiment(s, exp_id, Scope.mine()).resource_pool


def run_states(trial_id: int) -> list[str]:
    with open_store(settings.load().db_url).tx() as s:
        return [r.state for r in views.runs(s, trial_id)]


def use_store(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    for key, sub in (("DATA_DIR", "data"), ("EXPERIMENTS_DIR", "exps"), ("CHECKPOINT_DIR", "ckpts")):
        monkeypatch.setenv(f"DETSLURM_{key}", str(root / sub))


def test_pool_move_of_own_and_foreign_experiment(det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert det("e", "create", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=2.0")[0] == 0
    # Running in Slurm and in the store: a move preempts the runs the store knows to be running.
    wait_for(lambda: len(running_jobs()) == 1 and run_states(1) == ["RUNNING"])
    ((job, partition),) = running_jobs().items()
    assert partition == "cpu"
    code, out, _ = det("job", "list")
    assert code == 0 and "core-api-const (1) trial" in out

    # Another store of the same user has an experiment 1 too: the job is not its trial.
    use_store(monkeypatch, tmp_path / "other")
    assert det("e", "create", "--paused", CORE / "const.yaml", CORE)[0] == 0
    before = pool_of(1)
    code, _, err = det("job", "update", job, "--resource-pool", "gpu")
    assert code == 1 and "submitted from another store" in err
    assert pool_of(1) == before != "gpu"

    use_store(monkeypatch, tmp_path)
    code, out, err = det("job", "update", job, "--resource-pool", "gpu")
    assert code == 0, out + err
    assert pool_of(1) == "gpu"
    wait_for(lambda: "gpu" in running_jobs().values())  # checkpointed, resubmitted there
    assert det("e", "kill", "1")[0] == 0
    assert det("e", "wait", "1")[0] == 1
