"""A search inside an allocation the user holds (docs/user/allocation.md): the trials run as job
steps of it, packed by slots, and its end is a preemption that `det e activate` continues.

The held job is an sbatch job that only sleeps, on the test cluster's two GPU nodes (2 fake GPUs
each); `det` runs "inside" it as in an salloc shell: with its SLURM_JOB_ID."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from helpers import store, wait_for
from sqlalchemy import select
from test_slurm_cluster import squeue_ids

from detslurm.store import Metric, Trial, TrialRun

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]

# Reports where it runs (node and GPU, from what slurmstepd gave its step) and when, then
# overlaps with the others for a while.
REPORTER = """
import os, time
import determined as det

with det.core.init() as ctx:
    start = time.time()
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    node = os.environ.get("SLURMD_NODENAME", "")
    time.sleep(float(os.environ.get("HOLD_S", "8")))
    ctx.train.report_validation_metrics(steps_completed=1, metrics={
        "validation_loss": 0.0, "node": int(node[1:]), "gpu": int(gpus), "gpus": len(gpus.split(",")),
        "start": start, "end": time.time()})
"""


def hold(nodes: int, minutes: int | None = None) -> str:
    """A job holding ``nodes`` GPU nodes whole (2 GPUs, 1 CPU per GPU), running; its id."""
    args = ["sbatch", "--parsable", "-p", "gpu", f"-N{nodes}", "--gres=gpu:2", "--cpus-per-gpu=1", "-o", "/dev/null"]
    args += [f"--time={minutes}"] if minutes else []
    job = subprocess.run([*args, "--wrap", "sleep 600"], capture_output=True, text=True, check=True).stdout.strip()
    wait_for(lambda: _state(job) == "R", 60)
    return job


def _state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%t"], capture_output=True, text=True).stdout.strip()


@pytest.fixture
def inside(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Run `det` inside a held job, as in its salloc shell."""

    def enter(job: str) -> None:
        monkeypatch.setenv("SLURM_JOB_ID", job)

    yield enter


def validations(exp_id: int) -> list[dict[str, Any]]:
    with store().tx() as s:
        q = select(Metric.metrics).join(Trial, Trial.id == Metric.trial_id)
        q = q.where(Trial.experiment_id == exp_id).where(Metric.group == "validation")
        return [m for (m,) in s.execute(q) if m is not None and "node" in m]


@pytest.mark.slurm24_smoke
def test_four_one_slot_trials_share_two_gpu_nodes(det: Any, tmp_path: Path, inside: Any) -> None:
    job = hold(2)
    inside(job)
    ctx = tmp_path / "ctx"
    write(ctx / "report.py", REPORTER)
    config = write(
        tmp_path / "grid.yaml",
        "name: packed\nentrypoint: python3 report.py\nmax_restarts: 0\n"
        "hyperparameters: {i: {type: categorical, vals: [1, 2, 3, 4]}}\n"
        "searcher: {name: grid, metric: validation_loss, max_length: 1}\n"
        "resources: {slots_per_trial: 1}\n",
    )
    code, out, err = det("e", "create", config, ctx, "--in-allocation")
    assert code == 0, out + err
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    reports = validations(1)
    assert len(reports) == 4, reports
    # Each on a GPU of its own: two per node, disjoint CUDA_VISIBLE_DEVICES, one GPU each.
    assert sorted((r["node"], r["gpu"]) for r in reports) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["gpus"] == 1 for r in reports)
    # All four at once: each started before any ended.
    assert max(r["start"] for r in reports) < min(r["end"] for r in reports)
    # Job steps of the held job, never jobs of their own.
    with store().tx() as s:
        ids = list(s.scalars(select(TrialRun.job_id)))
    assert len(ids) == 4 and all(str(i).startswith(f"{job}/") for i in ids), ids
    assert squeue_ids() == {job}
