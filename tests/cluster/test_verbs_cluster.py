"""The everyday verbs where they touch Slurm, on the real test cluster: `det e pause/kill` reach
queued jobs at once (not at the daemon's next tick), a priority set with `det job update`
survives the trial's resubmission, and `resources.priority` becomes the job's nice.

Jobs are held in the queue with ``--begin`` in the future, so nothing trains and each step is
observed in Slurm's own queue."""

from __future__ import annotations

import json
import re
import subprocess
import time
from typing import Any

import pytest
from conftest import EXAMPLES

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
CORE = EXAMPLES / "core_api"
QUEUED = "slurm.sbatch_args=[--begin=now+3600]"


def job_state(job: str) -> tuple[str, int]:
    """Slurm's state and nice of one job (--states=all: ended jobs stay visible for MinJobAge)."""
    out = subprocess.run(
        ["squeue", "-h", "--states=all", "-j", job, "-o", "%T %y"], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1])


def queued_tasks(array: str) -> set[str]:
    """The array's tasks still waiting in the queue."""
    argv = ["squeue", "-h", "-r", "-j", array, "--states=PENDING", "-o", "%i"]
    return set(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split())


def job_info_calls() -> int:
    """How many queue listings (squeue) slurmctld has answered so far (sdiag's RPC counts)."""
    out = subprocess.run(["sdiag"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REQUEST_JOB_INFO\s+\(\s*\d+\)\s+count:(\d+)", out)
    assert m is not None, out
    return int(m.group(1))


def runs(det: Any, trial_id: int) -> list[dict[str, Any]]:
    code, out, err = det("t", "describe", str(trial_id), "--json")
    assert code == 0, err
    return list(json.loads(out)["runs"])


def wait_for_job(det: Any, trial_id: int, run_id: int, timeout: float = 60) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for r in runs(det, trial_id):
            if r["run_id"] == run_id and r["job_id"]:
                return str(r["job_id"])
        time.sleep(0.5)
    raise AssertionError(f"trial {trial_id} run {run_id} was never submitted")


def test_pause_and_kill_reach_queued_jobs_at_once_and_priority_survives(det: Any) -> None:
    code, out, err = det(
        "e", "create", CORE / "const.yaml", CORE, "--config", QUEUED, "--config", "resources.priority=60"
    )
    assert code == 0, err
    job = wait_for_job(det, 1, 1)
    # resources.priority 60 is below Determined's default 42: nice (60 - 42) * 100.
    assert job_state(job) == ("PENDING", 1800)
    # No daemon from here on: what happens at once is the command's own doing.
    assert det("daemon", "stop")[0] == 0

    code, out, err = det("job", "update", job, "--priority", "70")
    assert code == 0, err
    assert job_state(job) == ("PENDING", 2800)
    assert "priority: 70" in det("e", "config", "1")[1]

    code, out, err = det("e", "pause", "1")
    assert code == 0 and f"Canceled Slurm job {job} (queued, not started yet)" in out, (out, err)
    assert job_state(job)[0] == "CANCELLED"  # before any tick could have run
    code, out, err = det("t", "describe", "1", "--json")
    trial = json.loads(out)
    # Our own cancel of a queued job: the trial is paused, and no restart was spent on it.
    assert trial["trial"]["state"] == "PAUSED" and trial["trial"]["restarts"] == 0, out
    assert trial["runs"][0]["exit_reason"] == "canceled by detslurm"

    # Resubmitted on activate: the new job gets the priority `det job update` set.
    assert det("e", "activate", "1")[0] == 0
    job2 = wait_for_job(det, 1, 2)
    assert job2 != job and job_state(job2) == ("PENDING", 2800)

    code, out, err = det("e", "kill", "1")
    assert code == 0 and f"Canceled Slurm job {job2}" in out, (out, err)
    assert job_state(job2)[0] == "CANCELLED"
    code, out, _ = det("e", "wait", "1")
    assert code == 1 and "Experiment 1 CANCELED" in out
    code, out, _ = det("t", "logs", "1")
    assert "trial killed" in out


def test_set_priority_reaches_live_jobs_and_later_submissions(det: Any) -> None:
    code, _, err = det("e", "create", CORE / "const.yaml", CORE, "--config", QUEUED)
    assert code == 0, err
    job = wait_for_job(det, 1, 1)
    assert job_state(job) == ("PENDING", 0)  # no resources.priority: Slurm's default nice
    # With no daemon, reads poll Slurm themselves, but not faster than the site's floor (1 s).
    assert det("daemon", "stop")[0] == 0
    before = job_info_calls()
    assert det("e", "list")[0] == 0 and det("e", "list")[0] == 0
    assert job_info_calls() - before == 1  # the second read reused the first one's poll
    time.sleep(1.2)
    assert det("e", "list")[0] == 0 and job_info_calls() - before == 2
    code, out, err = det("e", "set", "priority", "1", "55")
    assert code == 0 and "Set `priority` of experiment 1 to 55" in out, err
    assert job_state(job) == ("PENDING", 1300)
    code, out, _ = det("e", "set", "priority", "1", "0")
    assert code == 2 and "0 is not in the range 1<=x<=99" in out + _
    # A fork is a Slurm experiment too, and its config carries the priority set above.
    code, out, err = det("e", "fork", "1")
    assert code == 0 and "Created experiment 2 (forked from experiment 1)" in out, err
    forked = wait_for_job(det, 2, 1)
    assert job_state(forked) == ("PENDING", 1300)
    assert det("e", "kill", "1")[0] == 0 and det("e", "kill", "2")[0] == 0


def test_set_max_slots_throttles_a_live_array_and_trial_kill_is_at_once(det: Any) -> None:
    code, _, err = det("e", "create", CORE / "adaptive.yaml", CORE, "--config", QUEUED)
    assert code == 0, err
    job = wait_for_job(det, 1, 1)
    array = job.split("_")[0]
    assert "_" in job  # the first trials share one sbatch: a job array
    code, out, err = det("e", "set", "max-slots", "1", "2")
    assert code == 0 and f"Throttled Slurm job array {array}" in out, (out, err)
    shown = subprocess.run(["scontrol", "show", "job", array], capture_output=True, text=True, check=True).stdout
    assert "ArrayTaskThrottle=2" in shown
    # `det t kill` cancels that trial's task at once; its sibling stays queued.
    job2 = wait_for_job(det, 2, 1)
    assert queued_tasks(array) == {job, job2}
    code, out, err = det("t", "kill", "2")
    assert code == 0 and f"Canceled Slurm job {job2}" in out, (out, err)
    # A canceled pending task leaves the array's record at once (squeue no longer lists it).
    assert queued_tasks(array) == {job}
    assert det("e", "kill", "1")[0] == 0
