"""Pilot workers (slurm.pilots, docs/user/allocation.md): worker jobs that hold their nodes while
the daemon runs the trial runs in them as job steps; none of a trial's own; a worker that ends
mid-trial is a preemption; idle workers end; only their owner can start a step in them.

And a search inside an allocation (docs/user/allocation.md) whose ASHA promotions continue as
job steps, with the queue verbs (`det e set priority`, `max-slots`) working on its steps."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from helpers import store, wait_for
from sqlalchemy import select
from test_allocation_cluster import hold
from test_slurm_cluster import CORE, steps, trials

from detslurm.slurm.parse import experiment_tag
from detslurm.store import Experiment, ExperimentState, TrialRun

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]

# Reports which worker it ran in, then ends.
REPORTER = """
import os, time
import determined as det

with det.core.init() as ctx:
    time.sleep(float(os.environ.get("HOLD_S", "3")))
    ctx.train.report_validation_metrics(steps_completed=1, metrics={
        "validation_loss": 0.0, "job": int(os.environ["SLURM_JOB_ID"])})
"""


def pilots(count: int, **more: object) -> str:
    extra = "".join(f", {k}: {v}" for k, v in more.items())
    return f"slurm: {{pilots: {{count: {count}{extra}}}}}\n"


def our_jobs(exp_id: int) -> list[tuple[str, str, str, str]]:
    """(array task id, job id, state, comment) of every job Slurm lists (ended ones too, for
    MinJobAge) that belongs to this test's experiment: its comment has the experiment's tag."""
    with store().tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        tag = experiment_tag(exp.exp_dir)
    out = subprocess.run(
        ["squeue", "-h", "--states=all", "-O", "JobArrayID:|,JobID:|,State:|,Comment:200"],
        capture_output=True,
        text=True,
    ).stdout
    rows = [tuple(f.strip() for f in line.split("|")) for line in out.splitlines()]
    return [(r[0], r[1], r[2], r[3]) for r in rows if len(r) == 4 and r[3].endswith(f"tag={tag}")]


def live(jobs: list[tuple[str, str, str, str]]) -> list[str]:
    return [j for j, _, state, _ in jobs if state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")]


def exp_state(exp_id: int) -> ExperimentState:
    with store().tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        return exp.state


def run_jobs(exp_id: int) -> list[str]:
    with store().tx() as s:
        q = select(TrialRun.job_id).join(TrialRun.trial).where(TrialRun.trial.has(experiment_id=exp_id))
        return [str(j) for j in s.scalars(q.order_by(TrialRun.id))]


@pytest.mark.slurm24_smoke
def test_a_search_runs_in_two_workers_with_no_job_per_trial(det: Any, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    write(ctx / "report.py", REPORTER)
    config = write(
        tmp_path / "grid.yaml",
        "name: piloted\nentrypoint: python3 report.py\nmax_restarts: 0\n"
        "hyperparameters: {i: {type: categorical, vals: [1, 2, 3, 4, 5, 6]}}\n"
        "searcher: {name: grid, metric: validation_loss, max_length: 1}\n" + pilots(2),
    )
    code, out, err = det("e", "create", config, ctx)
    assert code == 0, out + err
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    assert [t.state for t in trials(1)] == ["COMPLETED"] * 6
    jobs = our_jobs(1)
    # One array of two workers, and not one job of a trial's own.
    assert len(jobs) == 2 and all(c.startswith("detslurm:pilots,exp=1,") for *_, c in jobs), jobs
    assert len({task.split("_")[0] for task, *_ in jobs}) == 1, jobs  # one sbatch
    # Every run a job step of a worker, both workers used.
    assert {r.split("/")[0] for r in run_jobs(1)} == {job for _, job, _, _ in jobs}, (run_jobs(1), jobs)
    # With nothing left to run the daemon ends them: no idle allocation is held.
    wait_for(lambda: not live(our_jobs(1)), 20)


def test_a_worker_cancelled_mid_trial_hands_the_trial_to_another(det: Any, tmp_path: Path) -> None:
    """scancel of the worker a trial runs in: the trial checkpoints (Slurm's SIGTERM), is
    preempted (no restart spent), and goes on in a new worker from its checkpoint, losing and
    repeating no step."""
    batches = 40
    config = write(tmp_path / "one.yaml", (CORE / "const.yaml").read_text() + pilots(1))
    code, out, err = det(
        "e", "create", config, CORE,
        "--config", "hyperparameters.sleep=0.25",
        "--config", f"environment.environment_variables=[EXAMPLE_TOTAL_BATCHES={batches}]",
        "--config", "max_restarts=0",
    )  # fmt: skip
    assert code == 0, out + err
    (t,) = trials(1)
    wait_for(lambda: len(steps(t.id)) >= 8, 60)  # past its first checkpoint
    (first,) = run_jobs(1)
    worker = first.split("/")[0]
    subprocess.run(["scancel", worker], check=True)
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    (t,) = trials(1)
    assert t.state == "COMPLETED" and t.restarts == 0 and t.run_count == 2, (t.state, t.restarts, t.run_count)
    assert [s for s, _ in steps(t.id)] == list(range(1, batches + 1))  # nothing lost, nothing twice
    runs = run_jobs(1)
    assert len(runs) == 2 and runs[1].split("/")[0] != worker, runs  # in another worker
    with store().tx() as s:
        stopped = s.scalars(select(TrialRun).where(TrialRun.trial_id == t.id).order_by(TrialRun.run_id)).first()
        assert stopped is not None and stopped.exit_reason is not None
        assert "PREEMPT" in stopped.exit_reason.upper(), stopped.exit_reason
    wait_for(lambda: not live(our_jobs(1)), 20)


def test_idle_workers_end_and_pause_activate_resubmits(det: Any, tmp_path: Path) -> None:
    """Three workers asked for one trial: one is kept (the others are not even needed). A
    paused experiment keeps none once its trial has checkpointed; activate submits a worker
    again and the trial finishes in it."""
    batches = 30
    config = write(tmp_path / "one.yaml", (CORE / "const.yaml").read_text() + pilots(3))
    code, out, err = det(
        "e", "create", config, CORE,
        "--config", "hyperparameters.sleep=0.25",
        "--config", f"environment.environment_variables=[EXAMPLE_TOTAL_BATCHES={batches}]",
    )  # fmt: skip
    assert code == 0, out + err
    (t,) = trials(1)
    wait_for(lambda: len(steps(t.id)) >= 5, 60)
    assert len(our_jobs(1)) == 1, our_jobs(1)  # one trial, one worker
    assert det("e", "pause", "1")[0] == 0
    wait_for(lambda: not live(our_jobs(1)), 45)
    (t,) = trials(1)
    assert t.state == "PAUSED"
    assert det("e", "activate", "1")[0] == 0
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    (t,) = trials(1)
    assert t.state == "COMPLETED" and t.restarts == 0
    assert [s for s, _ in steps(t.id)] == list(range(1, batches + 1))
    assert len(our_jobs(1)) == 2  # the first worker, and the one activate asked for


def test_workers_made_too_small_by_sbatch_args_pause_the_experiment(det: Any, tmp_path: Path) -> None:
    """`slurm.sbatch_args` may give the workers less than the pilots section asks for (here one
    CPU for a trial of two): the create's check passes (the workers' job is valid), but no trial
    could ever start in them. The experiment is paused with the numbers, not left waiting, and
    the workers are canceled."""
    ctx = tmp_path / "ctx"
    write(ctx / "report.py", REPORTER)
    config = write(
        tmp_path / "small.yaml",
        "entrypoint: python3 report.py\nresources: {slots_per_trial: 2}\n"
        "searcher: {name: single, metric: validation_loss, max_length: 1}\n"
        "slurm: {pilots: {count: 1}, sbatch_args: ['--cpus-per-task=1']}\n",
    )
    code, out, err = det("e", "create", config, ctx)
    assert code == 0, out + err
    wait_for(lambda: exp_state(1) == ExperimentState.PAUSED, 60, "the experiment to pause")
    code, out, err = det("trial", "logs", str(trials(1)[0].id))
    # The only node it holds has one CPU: a trial of two slots would need two such nodes.
    assert "pilot worker " in out and "is too small: a trial needs 2 nodes with 1 CPU each" in out, out + err
    assert "holds 1 node" in out and "slurm.sbatch_args" in out, out
    assert "`det e activate 1` continues it" in out + err
    assert run_jobs(1) == []  # no run was ever started
    wait_for(lambda: not live(our_jobs(1)), 30, "the worker to be canceled")


def test_set_priority_reaches_workers_waiting_in_the_queue(det: Any, tmp_path: Path) -> None:
    """`det e set priority` gives the experiment's pending pilot workers the new priority (their
    nice), as it does a trial's own queued job: the store lists no worker, the queue does."""
    from detslurm.queue import nice_for

    blocker = hold(2)  # both GPU nodes whole: the worker waits
    ctx = tmp_path / "ctx"
    write(ctx / "report.py", REPORTER)
    config = write(
        tmp_path / "one.yaml",
        "entrypoint: python3 report.py\nresources: {slots_per_trial: 1, resource_pool: gpu}\n"
        "searcher: {name: single, metric: validation_loss, max_length: 1}\n" + pilots(1),
    )
    code, out, err = det("e", "create", config, ctx)
    assert code == 0, out + err
    wait_for(lambda: len(live(our_jobs(1))) == 1, 30, "the worker to be submitted")
    code, out, err = det("e", "set", "priority", "1", "60")
    assert code == 0, out + err
    ((task, *_),) = our_jobs(1)
    nice = subprocess.run(["squeue", "-h", "-j", task, "-o", "%y"], capture_output=True, text=True).stdout.strip()
    assert nice == str(nice_for(60)), (task, nice)
    subprocess.run(["scancel", blocker], check=True)
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err


@pytest.mark.security
def test_the_neighbour_cannot_start_a_step_in_a_worker(
    det: Any, tmp_path: Path, mallory: Any, slurm_cluster: Path
) -> None:
    """Slurm refuses `srun --jobid` of a worker to anyone but its owner, and the one file the
    worker's script reads (its lease) is in the owner's private experiment dir."""
    from security_harness import run_as

    for d in [slurm_cluster, *slurm_cluster.parents][:-1]:
        d.chmod(d.stat().st_mode | 0o001)  # the second user reaches slurm.conf
    ctx = tmp_path / "ctx"
    write(ctx / "report.py", REPORTER)
    config = write(
        tmp_path / "one.yaml",
        "name: held\nentrypoint: python3 report.py\nmax_restarts: 0\n"
        "environment: {environment_variables: [HOLD_S=40]}\n"
        "searcher: {name: single, metric: validation_loss, max_length: 1}\n" + pilots(1),
    )
    code, out, err = det("e", "create", config, ctx)
    assert code == 0, out + err
    wait_for(lambda: any("/" in j for j in run_jobs(1)), 60)
    worker = run_jobs(1)[0].split("/")[0]
    env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": str(slurm_cluster / "etc/slurm.conf")}
    r = run_as(mallory.user, ["srun", f"--jobid={worker}", "--overlap", "touch", str(mallory.home / "ran")],
               env=env, cwd=str(mallory.home), timeout=60)  # fmt: skip
    assert r.returncode != 0 and not (mallory.home / "ran").exists(), r.stdout + r.stderr
    assert "access/permission denied" in r.stderr.lower(), r.stderr
    with store().tx() as s:
        exp = s.get(Experiment, 1)
        assert exp is not None
        lease = Path(exp.exp_dir) / "pilots" / "lease"
    assert lease.exists()
    probe = "import sys, os\ntry:\n    os.utime(sys.argv[1])\nexcept PermissionError:\n    sys.exit(3)\n"
    assert mallory.python_snippet(probe, str(lease)).returncode == 3  # nor can renew (or write) it
    assert det("e", "kill", "1")[0] == 0


def test_asha_in_an_allocation_promotes_as_steps_and_takes_queue_verbs(
    det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adaptive ASHA search inside an allocation: promoted trials train on as job steps, no
    job is queued, and `det e set priority` / `max-slots` change the config without touching
    the steps (no scontrol update of a step id); a fork inside a later allocation runs there."""
    job = hold(2)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    code, out, err = det(
        "e", "create", CORE / "adaptive.yaml", CORE, "--in-allocation",
        "--config", "searcher.max_trials=4", "--config", "searcher.max_time=20",
        "--config", "hyperparameters.sleep=0.2", "--config", "resources.slots_per_trial=1",
        "--config", "environment.environment_variables=[EXAMPLE_TOTAL_BATCHES=20]",
    )  # fmt: skip
    assert code == 0, out + err
    wait_for(lambda: any("/" in j for j in run_jobs(1)), 60)
    assert det("e", "set", "priority", "1", "50")[0] == 0
    code, out, err = det("e", "set", "max-slots", "1", "2")
    assert code == 0 and "Throttled" not in out, out + err
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    done = trials(1)
    assert len(done) == 4 and all(t.state == "COMPLETED" for t in done), [t.state for t in done]
    lengths = sorted(max((s for s, _ in steps(t.id)), default=0) for t in done)
    assert lengths[-1] == 20, lengths  # promoted past the first rung (5 batches), as a job step
    assert all(j.startswith(f"{job}/") for j in run_jobs(1)), run_jobs(1)
    out = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout.split()
    assert out == [job], out
    # A fork inside another allocation runs there, as a create would (its parent's has ended).
    subprocess.run(["scancel", job], check=True)
    wait_for(lambda: not subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout, 30)
    other = hold(1)
    monkeypatch.setenv("SLURM_JOB_ID", other)
    code, out, err = det("e", "fork", "1", "--paused")
    assert code == 0, out + err
    with store().tx() as s:
        forked = s.get(Experiment, 2)
        assert forked is not None and forked.config["slurm"]["allocation_id"] == other, forked and forked.config


def test_a_worker_without_its_daemon_ends_itself_once_no_step_runs(tmp_path: Path) -> None:
    """The worker's own script, with no daemon renewing its lease: it keeps its nodes while a
    step runs in it, and ends within its idle timeout plus one check once none does."""
    from detslurm.expconf import validate
    from detslurm.slurm.pilot_job import CHECK_EVERY_S, lease_path, plan_workers
    from detslurm.slurm.render import resource_plan
    from detslurm.slurm.site import load_site_config

    config = validate(
        {
            "entrypoint": "true",
            "searcher": {"name": "single", "metric": "x", "max_length": 1},
            "slurm": {"pilots": {"count": 1, "idle_timeout": 10}},
            "checkpoint_storage": {"type": "shared_fs", "host_path": str(tmp_path)},
        }
    )
    exp_dir = tmp_path / "exp"
    lease_path(exp_dir).parent.mkdir(parents=True)
    lease_path(exp_dir).touch()
    request = plan_workers(
        config=config, res=resource_plan(config, load_site_config()), exp_id=1, exp_dir=exp_dir, tag="ab", count=1
    )
    array = subprocess.run(
        ["sbatch", "--parsable", *request.args], input=request.script, capture_output=True, text=True, check=True
    ).stdout.strip()
    task = f"{array}_0"

    def state() -> str:
        return subprocess.run(["squeue", "-h", "-j", task, "-o", "%T"], capture_output=True, text=True).stdout.strip()

    wait_for(lambda: state() == "RUNNING", 30)
    job = subprocess.run(["squeue", "-h", "-j", task, "-o", "%A"], capture_output=True, text=True).stdout.strip()
    step = subprocess.Popen(["srun", f"--jobid={job}", "--overlap", "sleep", "20"])  # a trial's step
    try:
        time.sleep(10 + 2 * CHECK_EVERY_S)  # the lease is stale now; the step keeps the worker
        assert state() == "RUNNING"
    finally:
        step.wait(timeout=60)
    started = time.monotonic()
    wait_for(lambda: state() in ("", "COMPLETED", "COMPLETING"), 10 + 3 * CHECK_EVERY_S)
    assert time.monotonic() - started < 10 + 3 * CHECK_EVERY_S
