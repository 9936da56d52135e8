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
from test_slurm_cluster import CORE, squeue_ids, steps, trials
from test_time_limit_cluster import use_lead

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


def test_time_limit_end_pauses_and_activate_continues_as_jobs(
    det: Any, tmp_path: Path, inside: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The allocation's time limit is a preemption: the running trial gets the warning signal
    the site's lead before it and checkpoints, the experiment pauses, and `det e activate`
    outside any allocation continues it as an ordinary job with no step lost or repeated."""
    use_lead(tmp_path, monkeypatch, 90)  # a 2-minute allocation warns 30 s in
    job = hold(1, minutes=2)
    inside(job)
    batches = 120  # 60 s: more than the allocation leaves it
    code, out, err = det(
        "e",
        "create",
        CORE / "const.yaml",
        CORE,
        "--in-allocation",
        "--config",
        "hyperparameters.sleep=0.5",
        "--config",
        f"environment.environment_variables=[EXAMPLE_TOTAL_BATCHES={batches}]",
        "--config",
        "max_restarts=0",
    )
    assert code == 0, out + err
    wait_for(lambda: det("e", "list", "--json")[1].count('"PAUSED"') > 0, 150)
    (t,) = trials(1)
    wait_for(lambda: trials(1)[0].state == "PAUSED", 60)
    with store().tx() as s:
        (first,) = s.scalars(select(TrialRun).where(TrialRun.trial_id == t.id))
        assert first.job_id is not None and first.job_id.startswith(f"{job}/")
        assert first.preempt_acked and first.exit_code == 0, (first.exit_reason, first.exit_code)
        assert (Path(first.run_dir) / "signals").read_text().split() == ["USR2"]
    monkeypatch.delenv("SLURM_JOB_ID")
    code, out, err = det("e", "activate", "1")
    assert code == 0 and "continue as ordinary Slurm jobs" in out, out + err
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    (t,) = trials(1)
    assert t.state == "COMPLETED" and t.restarts == 0 and t.run_count == 2
    assert [s for s, _ in steps(t.id)] == list(range(1, batches + 1))  # nothing lost, nothing twice
    with store().tx() as s:
        last = s.scalars(select(TrialRun).where(TrialRun.trial_id == t.id).order_by(TrialRun.run_id)).all()[-1]
    assert last.job_id is not None and "/" not in last.job_id  # an ordinary job


def test_trials_that_cannot_fit_are_refused(det: Any, tmp_path: Path, inside: Any) -> None:
    args = ("e", "create", CORE / "const.yaml", CORE, "--in-allocation")
    code, _, err = det(*args)
    assert code == 1 and "det e create runs outside a Slurm allocation (SLURM_JOB_ID is not set)" in err
    job = hold(2)
    inside(job)
    code, _, err = det(*args, "--config", "resources.slots_per_trial=6")
    assert code == 1, err
    assert (
        f"const.yaml: resources.slots_per_trial: a trial needs 3 nodes with 2 GPUs each, but allocation {job} holds "
        "2 nodes (g1, g2) with 2 GPUs and 2 CPUs each" in err
    ), err
    assert det("e", "list", "--json")[1].strip() == "[]" and squeue_ids() == {job}
