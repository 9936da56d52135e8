"""Accounting on a real cluster with accounting (MariaDB + slurmdbd): an array task
that has left squeue gets its real end (completed, failed, canceled, preempted) from sacct,
looked up by its ARRAY_TASK id, instead of "lost"; a failing sacct costs only that detail.
Time limit, preemption, node failure and cancel are told apart through one batched sacct once
the jobs left the queue, and through squeue alone as a site without accounting sees them."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Optional

import pytest
from conftest import ROOT

from detslurm.controller.executor import ExitCause, JobState, JobStatus
from detslurm.controller.slurm_executor import SlurmExecutor
from detslurm.slurm.client import Result, SlurmClient, SlurmUnavailable, subprocess_runner
from detslurm.slurm.site import SiteConfig

pytestmark = [pytest.mark.slurm]


@pytest.fixture(scope="module")
def dbd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A second test cluster, with accounting, on its own ports (the shared one has none).
    DETSLURM_TEST_DBD_CLUSTER=DIR reuses one that is up (TEST_CLUSTER_DBD_PORT its port)."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the Slurm test cluster needs root, and CI runs as root")
        pytest.skip("the Slurm test cluster needs root")
    reuse = os.environ.get("DETSLURM_TEST_DBD_CLUSTER")
    state = Path(reuse) if reuse else tmp_path_factory.mktemp("slurm-dbd")
    port = os.environ.get("TEST_CLUSTER_DBD_PORT") or str(int(os.environ.get("TEST_CLUSTER_PORT", "17817")) + 100)
    env = dict(os.environ, TEST_CLUSTER_PORT=port, TEST_CLUSTER_DBD="1")
    subprocess.run([str(ROOT / "scripts/test-cluster"), "up", str(state)], check=True, env=env)
    yield state
    if not reuse:
        subprocess.run([str(ROOT / "scripts/test-cluster"), "down", str(state)], check=False, env=env)


@pytest.fixture
def dbd_env(dbd_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("SLURM_CONF", str(dbd_cluster / "etc/slurm.conf"))
    yield dbd_cluster
    subprocess.run(["scancel", "-u", os.environ.get("USER", "root")], check=False)


class QueueForgot:
    """squeue answers "no jobs" (as after MinJobAge); everything else is the real command.
    ``sacct`` may be replaced by a failure, as when slurmdbd is down or sacct is missing."""

    def __init__(self, sacct: Optional[Result | Exception] = None) -> None:
        self.sacct = sacct
        self.calls: list[str] = []

    def __call__(
        self,
        argv: Sequence[str],
        *,
        input: Optional[str] = None,
        timeout: float,
        env: Optional[Mapping[str, str]] = None,
    ) -> Result:
        self.calls.append(argv[0])
        if argv[0] == "squeue":
            return Result(0, "", "")
        if argv[0] == "sacct" and isinstance(self.sacct, Exception):
            raise self.sacct
        if argv[0] == "sacct" and self.sacct is not None:
            return self.sacct
        return subprocess_runner(argv, input=input, timeout=timeout, env=env)


def sbatch(*args: str) -> str:
    res = subprocess.run(["sbatch", "--parsable", "--chdir=/tmp", *args], capture_output=True, text=True, check=True)
    return res.stdout.strip().split(";")[0]


class NoAccounting:
    """The real commands, but slurmctld's config says there is no accounting storage: the
    executor then sees what a site without slurmdbd sees (and must never ask sacct)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(
        self,
        argv: Sequence[str],
        *,
        input: Optional[str] = None,
        timeout: float,
        env: Optional[Mapping[str, str]] = None,
    ) -> Result:
        self.calls.append(argv[0])
        res = subprocess_runner(argv, input=input, timeout=timeout, env=env)
        if list(argv[:3]) == ["scontrol", "show", "config"]:
            return Result(
                res.returncode, res.stdout.replace("accounting_storage/slurmdbd", "accounting_storage/none"), ""
            )
        return res


def wait_running(jobs: list[str], timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while True:
        out = subprocess.run(
            ["squeue", "-h", "-t", "R", "-j", ",".join(jobs), "-o", "%i"], capture_output=True, text=True
        )
        if len(out.stdout.split()) == len(jobs):
            return
        assert time.time() < deadline, f"not all of {jobs} ran: {out.stdout}"
        time.sleep(0.2)


def wait_accounted(jobs: list[str], timeout: float = 45) -> None:
    """Until slurmdbd has every job's final state (slurmctld sends them asynchronously)."""
    terminal = ("COMPLETED", "FAILED", "CANCELLED", "PREEMPTED", "TIMEOUT", "NODE_FAIL")
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(
            ["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(jobs)], capture_output=True, text=True
        ).stdout
        states = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
        if all(states.get(j, "").split(" ")[0] in terminal for j in jobs):
            return
        time.sleep(0.5)
    raise AssertionError(f"sacct never showed every job ended: {out}")


def wait_completed(jobs: list[str], timeout: float = 120) -> None:
    """Until no job is COMPLETING any more. slurmdbd records a job's end (TIMEOUT, NODE_FAIL)
    while its processes are still being killed; squeue shows it COMPLETING until they are gone,
    and the executor rightly reports such a job as still running."""
    deadline = time.time() + timeout
    while True:
        out = subprocess.run(
            ["squeue", "-h", "-t", "CG", "-j", ",".join(jobs), "-o", "%i %T"], capture_output=True, text=True
        ).stdout
        if not out.strip():
            return
        assert time.time() < deadline, f"jobs still completing after {timeout} s: {out}"
        time.sleep(0.5)


def test_array_tasks_that_left_the_queue_get_their_real_end(dbd_env: Path, tmp_path: Path) -> None:
    arr = sbatch("--array=0-2", "--wrap=case $SLURM_ARRAY_TASK_ID in 0) exit 0;; 1) exit 3;; *) sleep 600;; esac")
    # Preemption by the high partition; --no-requeue makes it end as PREEMPTED (not requeued).
    victims = sbatch("--array=0-1", "--no-requeue", "--partition=gpu", "--cpus-per-task=2", "--wrap=sleep 600")
    deadline = time.time() + 30
    while (
        "RUNNING"
        not in subprocess.run(["squeue", "-h", "-j", f"{arr}_2", "-o", "%T"], capture_output=True, text=True).stdout
    ):
        assert time.time() < deadline, "task 2 never ran"
        time.sleep(0.2)
    subprocess.run(["scancel", f"{arr}_2"], check=True)
    while (
        subprocess.run(
            ["squeue", "-h", "-r", "-j", victims, "-t", "R", "-o", "%i"], capture_output=True, text=True
        ).stdout.count("\n")
        < 2
    ):
        assert time.time() < deadline, "the victims never ran"
        time.sleep(0.2)
    sbatch("--partition=high", "--nodelist=g1,g2", "--nodes=2", "--cpus-per-task=2", "--wrap=sleep 1")
    jobs = [f"{arr}_0", f"{arr}_1", f"{arr}_2", f"{victims}_0", f"{victims}_1"]
    wait_accounted(jobs)
    dirs = {j: tmp_path / j for j in jobs}  # no exit.json: only Slurm knows how they ended
    for d in dirs.values():
        d.mkdir()
    runner = QueueForgot()
    got = SlurmExecutor(SlurmClient(runner), SiteConfig()).poll(dirs)
    assert got[f"{arr}_0"] == JobStatus(JobState.EXITED, 0, ExitCause.COMPLETED, None)
    assert got[f"{arr}_1"] == JobStatus(JobState.EXITED, 3, ExitCause.FAILED, "FAILED")
    assert got[f"{arr}_2"].cause is ExitCause.CANCELED_BY_USER
    assert got[f"{victims}_0"].cause is got[f"{victims}_1"].cause is ExitCause.PREEMPTED
    assert runner.calls.count("sacct") == 1  # one call for all of them


@pytest.mark.fault
@pytest.mark.parametrize(
    "failure",
    [
        Result(1, "", "sacct: error: Problem talking to the database: Connection refused"),
        Result(0, "not|sacct\ngarbage\n", ""),
        SlurmUnavailable("sacct not found: is this a Slurm login node?"),
    ],
    ids=["slurmdbd-down", "garbage", "sacct-missing"],
)
def test_failing_sacct_costs_only_the_detail(dbd_env: Path, tmp_path: Path, failure: Result | Exception) -> None:
    job = sbatch("--wrap=true")
    runner = QueueForgot(failure)
    got = SlurmExecutor(SlurmClient(runner), SiteConfig()).poll({job: tmp_path})  # never raises
    assert got[job] == JobStatus(JobState.UNKNOWN, None, ExitCause.LOST)
    assert "sacct" in runner.calls


def test_time_limit_preemption_node_failure_and_cancel_told_apart(dbd_env: Path, tmp_path: Path) -> None:
    """Four jobs end four ways on the real cluster. While squeue still shows them (MinJobAge)
    the executor tells them apart without accounting; once they have left the queue, one sacct
    call for all four does. The time limit takes a minute or so: Slurm checks limits every 30 s."""
    common = ["--no-requeue", "--wrap=sleep 600"]
    timeout = sbatch("--partition=cpu", "--nodelist=c1", "--time=1", *common)
    preempted = sbatch("--partition=gpu", "--nodelist=g1", "--cpus-per-task=2", *common)
    node_fail = sbatch("--partition=cpu", "--nodelist=c2", *common)
    canceled = sbatch("--partition=gpu", "--nodelist=g2", *common)
    jobs = [timeout, preempted, node_fail, canceled]
    wait_running(jobs)
    try:
        sbatch("--partition=high", "--nodelist=g1", "--cpus-per-task=2", "--wrap=sleep 1")
        subprocess.run(["scontrol", "update", "NodeName=c2", "State=DOWN", "Reason=detslurm-test"], check=True)
        subprocess.run(["scancel", canceled], check=True)
        wait_accounted(jobs, timeout=150)
    finally:
        # ReturnToService=2 may already have brought c2 back; then RESUME is refused, harmlessly.
        subprocess.run(["scontrol", "update", "NodeName=c2", "State=RESUME"], capture_output=True)
    wait_completed(jobs)
    expect = {
        timeout: ExitCause.TIME_LIMIT,
        preempted: ExitCause.PREEMPTED,
        node_fail: ExitCause.NODE_FAILURE,
        canceled: ExitCause.CANCELED_BY_USER,
    }
    dirs = {j: tmp_path / j for j in jobs}  # no exit.json: only Slurm knows how they ended
    for d in dirs.values():
        d.mkdir()
    without = NoAccounting()
    seen = SlurmExecutor(SlurmClient(without), SiteConfig()).poll(dirs)
    assert {j: s.cause for j, s in seen.items()} == expect
    assert "sacct" not in without.calls
    forgot = QueueForgot()
    accounted = SlurmExecutor(SlurmClient(forgot), SiteConfig()).poll(dirs)
    assert {j: s.cause for j, s in accounted.items()} == expect
    assert all(s.state is JobState.EXITED for s in accounted.values())
    assert forgot.calls.count("sacct") == 1  # one call for all four, never one per job
