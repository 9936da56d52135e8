"""The ends of a held job and of a pilot worker, and what continues the experiment after them
(docs/user/allocation.md): a search paused in one allocation goes on as job steps of the next;
an allocation canceled while a step runs (Slurm's SIGTERM) is a preemption that `det e
activate` continues; a pilot worker that reaches its time limit hands its trial to a new
worker. Each time: no restart spent, every step once (examples/core_api checkpoints every 5).

The held jobs are sbatch jobs that only sleep, each on one GPU node; `det` runs "inside" one as
in its salloc shell: with its SLURM_JOB_ID."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from helpers import wait_for
from test_allocation_cluster import hold
from test_pilots_cluster import live, our_jobs, pilots, run_jobs
from test_preemption_multinode import runs
from test_slurm_cluster import CORE, squeue_ids, steps, trials
from test_time_limit_cluster import use_lead

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]

BATCH_S = 0.25


def create(det: Any, config: Path, batches: int, *more: str) -> None:
    code, out, err = det(
        "e", "create", config, CORE, *more,
        "--config", f"hyperparameters.sleep={BATCH_S}",
        "--config", f"environment.environment_variables=[EXAMPLE_TOTAL_BATCHES={batches}]",
        "--config", "max_restarts=0",
    )  # fmt: skip
    assert code == 0, out + err


def finished_whole(det: Any, batches: int) -> list[str]:
    """Experiment 1, once done: its one trial completed with no restart spent, each step
    reported once; the job ids of its runs, in order."""
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    (t,) = trials(1)
    assert t.state == "COMPLETED" and t.restarts == 0, (t.state, t.restarts)
    assert [s for s, _ in steps(t.id)] == list(range(1, batches + 1))  # nothing lost, nothing twice
    return [str(r.job_id) for r in runs(t.id)]


def paused_with_checkpoint() -> None:
    """Experiment 1's trial is paused, and its one run ended having checkpointed on request."""
    wait_for(lambda: trials(1)[0].state == "PAUSED", 60, "the trial to pause")
    (t,) = trials(1)
    wait_for(lambda: runs(t.id)[0].end_time is not None, 30, "its run to end")
    (first,) = runs(t.id)
    assert first.preempt_acked and first.exit_code == 0, (first.exit_reason, first.exit_code)


def in_a_new_allocation(det: Any, monkeypatch: pytest.MonkeyPatch, batches: int) -> tuple[str, Any]:
    """Experiment 1 created inside a new one-node allocation, its trial ten steps in: the
    allocation's job id and the trial."""
    a = hold(1)
    monkeypatch.setenv("SLURM_JOB_ID", a)
    create(det, CORE / "const.yaml", batches, "--in-allocation")
    (t,) = trials(1)
    wait_for(lambda: len(steps(t.id)) >= 10, 60, "ten steps")
    return a, t


def test_paused_in_one_allocation_continues_as_steps_of_the_next(det: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paused inside allocation A, activated inside a new allocation B while A still runs: the
    trial goes on as a job step of B (not of A, not as a job of its own)."""
    batches = 60
    a, t = in_a_new_allocation(det, monkeypatch, batches)
    assert det("e", "pause", "1")[0] == 0
    paused_with_checkpoint()
    b = hold(1)
    monkeypatch.setenv("SLURM_JOB_ID", b)
    code, out, err = det("e", "activate", "1")
    assert code == 0 and f"its trials run as job steps of allocation {b}" in out, out + err
    ids = finished_whole(det, batches)
    assert len(ids) == 2 and ids[0].startswith(f"{a}/") and ids[1].startswith(f"{b}/"), ids
    assert squeue_ids() == {a, b}  # no job of a trial's own was ever queued


# On 24.11 too: how a canceled job's steps are stopped is Slurm's, and may differ by version.
@pytest.mark.slurm24_smoke
def test_an_allocation_canceled_mid_step_is_a_preemption_that_activate_continues(
    det: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scancel of the held job while its step runs: Slurm's SIGTERM reaches the trial, which
    checkpoints; the run is a preemption (no restart spent), the experiment pauses, and
    activate inside a new allocation continues the trial there from that checkpoint."""
    batches = 60
    a, t = in_a_new_allocation(det, monkeypatch, batches)
    subprocess.run(["scancel", a], check=True)
    wait_for(lambda: '"PAUSED"' in det("e", "list", "--json")[1], 60, "the experiment to pause")
    paused_with_checkpoint()
    (first,) = runs(t.id)
    assert first.exit_reason is not None and "PREEMPT" in first.exit_reason.upper(), first.exit_reason
    assert first.job_id is not None and first.job_id.startswith(f"{a}/")
    b = hold(1)
    monkeypatch.setenv("SLURM_JOB_ID", b)
    code, out, err = det("e", "activate", "1")
    assert code == 0 and f"its trials run as job steps of allocation {b}" in out, out + err
    ids = finished_whole(det, batches)
    assert len(ids) == 2 and ids[1].startswith(f"{b}/"), ids


def test_a_daemon_that_ended_with_its_allocation_leaves_a_preemption(det: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`det e create --in-allocation` in an sbatch script runs the daemon inside the job, and
    the job's end kills it and the runs' shells with it (Slurm's cgroup does; the test
    cluster's proctrack/linuxproc would let them escape, so the test kills them as the job
    ends). No exit record is written. The next daemon reads the run as the held job's end: a
    preemption, no restart spent (max_restarts 0), the experiment paused; activate continues it
    as an ordinary job, every step once."""
    from detslurm import daemon, settings
    from detslurm.controller.step_executor import StepRun

    batches = 60
    a, t = in_a_new_allocation(det, monkeypatch, batches)
    s = settings.load()
    pid = daemon.running_pid(s)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    (first,) = runs(t.id)
    step = StepRun.parse(str(first.job_id))
    assert step is not None
    os.kill(step.pid, signal.SIGKILL)  # the run's shell: srun goes on until the job ends
    subprocess.run(["scancel", a], check=True)
    wait_for(lambda: a not in squeue_ids(), 60, "the held job to end")
    monkeypatch.delenv("SLURM_JOB_ID")
    daemon.start(s)
    wait_for(lambda: '"PAUSED"' in det("e", "list", "--json")[1], 120, "the experiment to pause")
    (first,) = runs(t.id)
    assert first.exit_code is None and first.exit_reason is not None, (first.exit_code, first.exit_reason)
    assert "PREEMPT" in first.exit_reason.upper(), first.exit_reason
    assert trials(1)[0].restarts == 0
    code, out, err = det("e", "activate", "1")
    assert code == 0 and "continue as ordinary Slurm jobs" in out, out + err
    ids = finished_whole(det, batches)
    assert len(ids) == 2 and "/" not in ids[1], ids


def test_a_worker_at_its_time_limit_hands_the_trial_to_a_new_worker(
    det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1-minute pilot worker and a 35 s lead: the daemon sends the trial in it the warning
    signal 25 s in (from the worker's EndTime, not Slurm's --signal, which may come up to 60 s
    early), the trial checkpoints, and it goes on in a worker submitted for it, with no
    restart spent. A trial longer than one worker's 25 s moves on as often as it needs. The
    worker it left is canceled at once, not kept idle until its limit."""
    use_lead(tmp_path, monkeypatch, 35)
    batches = 120  # 30 s of steps: more than one worker leaves it
    config = write(tmp_path / "one.yaml", (CORE / "const.yaml").read_text() + pilots(1, time_limit=1))
    create(det, config, batches)
    ids = finished_whole(det, batches)
    workers = [j.split("/")[0] for j in ids]
    assert len(ids) >= 2 and len(set(workers)) == len(workers), ids  # each run in a worker of its own
    (t,) = trials(1)
    for run in runs(t.id)[:-1]:
        # Stopped by the daemon's warning (recorded by the run's shell), after a checkpoint.
        assert run.preempt_acked and run.exit_code == 0, (run.exit_reason, run.exit_code)
        assert (Path(run.run_dir) / "signals").read_text().split() == ["USR2"]
    jobs = our_jobs(1)
    assert {job for _, job, _, _ in jobs} == set(workers), (jobs, ids)  # only workers, no trial job
    assert set(run_jobs(1)) == set(ids)
    # Each canceled by the daemon, the one a trial left too; none kept idle until its limit.
    wait_for(lambda: not live(our_jobs(1)), 30, "the workers to end")
    assert {state for _, _, state, _ in our_jobs(1)} == {"CANCELLED"}, our_jobs(1)
