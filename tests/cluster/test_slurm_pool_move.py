"""`det job update --resource-pool` on the real cluster. A running trial: its own experiment
moves (checkpoint, resubmit in the new partition); another store's experiment with the same id
is left alone. A queued trial takes the target pool's resources, as Slurm shows its job."""

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


def blockers() -> list[str]:
    """A job on every node (all their CPUs), so that trials stay queued."""
    out = []
    for node, part in (("c1", "cpu"), ("c2", "cpu"), ("g1", "gpu"), ("g2", "gpu")):
        argv = ["sbatch", "--parsable", "-o", "/dev/null", "-p", part, "-w", node, "-c", "2", "--wrap", "sleep 600"]
        out.append(subprocess.run(argv, capture_output=True, text=True, check=True, cwd="/tmp").stdout.strip())
    wait_for(lambda: all(squeue_field(j, "%T") == "RUNNING" for j in out), what="the blockers to run")
    return out


def squeue_field(job: str, fmt: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", fmt], capture_output=True, text=True).stdout.strip()


def shown(job: str) -> dict[str, str]:
    """`scontrol show job`'s fields of the real job."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def trial_job(exp_id: int) -> str:
    """The queued job of experiment ``exp_id``'s one trial (by the comment detslurm gives it)."""
    out = subprocess.run(["squeue", "-h", "-t", "PD,R", "-o", "%i|%k"], capture_output=True, text=True).stdout
    jobs = [j for j, _, c in (line.partition("|") for line in out.splitlines()) if f"exp={exp_id}," in c]
    return jobs[0] if len(jobs) == 1 else ""


def test_queued_trials_take_the_target_pools_resources(det: Any) -> None:
    blocking = blockers()
    fast = ["--config", "hyperparameters.sleep=0", "--config", "resources.slots_per_trial=1"]
    assert det("e", "create", CORE / "const.yaml", CORE, *fast)[0] == 0  # cpu, the default pool
    assert det("e", "create", CORE / "const.yaml", CORE, *fast, "--config", "resources.resource_pool=gpu")[0] == 0
    wait_for(lambda: trial_job(1) and trial_job(2), what="both trials' jobs")
    cpu_job, gpu_job = trial_job(1), trial_job(2)
    assert "TresPerNode" not in shown(cpu_job) and shown(gpu_job)["TresPerNode"] == "gres:gpu:1"

    # The dry run prints the exact scontrol call and changes nothing.
    code, out, err = det("job", "update", cpu_job, "--resource-pool", "gpu", "--dry-run")
    assert code == 0, err
    call = f"scontrol update JobId={cpu_job} Partition=gpu TresPerNode=gres:gpu:1"
    assert f"would run: {call}" in out and "move experiment 1 (your store) to pool gpu" in out
    assert shown(cpu_job)["Partition"] == "cpu" and pool_of(1) != "gpu"

    # A CPU trial moved to the GPU pool gets the GRES a fresh submission there would ask for.
    code, out, err = det("job", "update", cpu_job, "--resource-pool", "gpu")
    assert code == 0, out + err
    now = shown(cpu_job)
    assert (now["Partition"], now["TresPerNode"], now["CPUs/Task"], now["NumCPUs"]) == ("gpu", "gres:gpu:1", "1", "1")
    assert pool_of(1) == "gpu"

    # A GPU trial moved to the CPU pool loses its GRES: Slurm cannot take it off a pending job, so
    # the job is replaced by a fresh submission there (no restart spent).
    code, out, err = det("job", "update", gpu_job, "--resource-pool", "cpu", "--dry-run")
    assert code == 0 and f"scancel --state=PENDING {gpu_job}, then resubmit its trial in pool cpu" in out
    assert "cannot take a GRES (gpu:1) off a pending job" in out and squeue_field(gpu_job, "%T") == "PENDING"
    code, out, err = det("job", "update", gpu_job, "--resource-pool", "cpu")
    assert code == 0, out + err
    wait_for(lambda: trial_job(2) not in ("", gpu_job), what="the GPU trial's job in the cpu pool")
    now = shown(trial_job(2))
    assert now["Partition"] == "cpu" and "TresPerNode" not in now and now["CPUs/Task"] == "1"
    assert pool_of(2) == "cpu"

    subprocess.run(["scancel", *blocking], check=True)
    assert det("e", "wait", "1")[0] == 0 and det("e", "wait", "2")[0] == 0
    with open_store(settings.load().db_url).tx() as s:
        (trial,) = views.get_experiment(s, 2, Scope.mine()).trials
        assert trial.restarts == 0 and len(trial.runs) == 2
