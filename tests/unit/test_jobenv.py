"""What the daemon's jobs inherit: Slurm's input and allocation variables
are dropped when the daemon starts; the user's own environment reaches jobs unchanged."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from detslurm import daemon, settings
from detslurm.jobenv import daemon_env, warn_once

USER_ENV = {
    "PATH": "/opt/cuda/bin:/usr/bin",
    "LD_LIBRARY_PATH": "/opt/cuda/lib64",
    "MODULEPATH": "/etc/modules",
    "LOADEDMODULES": "cuda/12.4",
    "PYTHONPATH": "/home/u/lib",
    "DETSLURM_SITE_CONFIG": "/etc/site.yaml",
    "SLURM_CONF": "/etc/slurm/slurm.conf",
    "WANDB_MODE": "offline",
}


def test_login_shell_keeps_everything_but_slurm_inputs() -> None:
    env = {**USER_ENV, "TMPDIR": "/tmp", "SBATCH_ACCOUNT": "x", "SLURM_TIME_FORMAT": "relative", "SRUN_X": "1"}
    out = daemon_env(env)
    assert out.env == {**USER_ENV, "TMPDIR": "/tmp"} and out.allocation is None
    assert out.dropped == ("SBATCH_ACCOUNT", "SLURM_TIME_FORMAT", "SRUN_X")
    assert warn_once(out) is None


def test_inside_an_allocation_its_variables_and_scratch_are_dropped() -> None:
    alloc = {
        "SLURM_JOB_ID": "1234",
        "SLURM_NTASKS": "8",
        "SLURM_CPUS_PER_TASK": "4",
        "SLURMD_NODENAME": "c1",
        "SALLOC_PARTITION": "gpu",
        "PMI_RANK": "0",
        "PMIX_NAMESPACE": "slurm.pmix.1234.0",
        "TMPDIR": "/local/job_1234/tmp",
    }
    out = daemon_env({**USER_ENV, **alloc})
    assert out.env == USER_ENV and out.allocation == "1234"
    assert sorted(out.dropped) == sorted(alloc)
    # Another number that merely contains the id is not this allocation's dir.
    assert (
        daemon_env({**USER_ENV, "SLURM_JOB_ID": "1234", "TMPDIR": "/scratch/12345"}).env["TMPDIR"] == "/scratch/12345"
    )
    tmp = daemon_env({"SLURM_JOB_ID": "9", "SLURM_TMPDIR": "/l/x/", "TMPDIR": "/l/x"})
    assert "TMPDIR" in tmp.dropped


def test_the_allocation_warning_comes_once(caplog: pytest.LogCaptureFixture) -> None:
    out = daemon_env({"SLURM_JOB_ID": "777001"})
    msg = warn_once(out)
    assert msg is not None and "inside Slurm allocation 777001" in msg and "it outlives it" in msg
    assert warn_once(out) is None
    assert [r.getMessage() for r in caplog.records].count(msg) == 1
    step = warn_once(daemon_env({"SLURM_JOB_ID": "777002", "SLURMD_NODENAME": "c1"}))
    assert step is not None and "on a compute node" in step and "cgroups" in step


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if b"=" in item)


def test_started_daemon_runs_with_the_scrubbed_environment(det_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETSLURM_DAEMON_IDLE_EXIT_S", "30")
    monkeypatch.setenv("SBATCH_ACCOUNT", "stolen")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("MY_MODULE_VAR", "kept")
    s = settings.load()
    pid = daemon.start(s)
    try:
        env = environ_of(pid)
    finally:
        daemon.stop(s)
    assert env["MY_MODULE_VAR"] == "kept" and env["PATH"] == os.environ["PATH"]
    assert "SBATCH_ACCOUNT" not in env and "SLURM_NTASKS" not in env
    assert "not passing to jobs: SBATCH_ACCOUNT" in daemon.Paths(s).log.read_text()


@pytest.mark.slurm
def test_sbatch_from_the_cli_does_not_carry_an_allocations_settings(
    slurm_env: Path, det: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CLI doing the tick itself (no daemon) inside an allocation: sbatch reads SBATCH_* as
    option defaults and hands the rest to the job; neither may leak."""
    import subprocess

    from conftest import EXAMPLES

    monkeypatch.setenv("SBATCH_TIMELIMIT", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "424242")
    code, out, err = det("e", "create", "--paused", EXAMPLES / "core_api/const.yaml", EXAMPLES / "core_api")
    assert code == 0, err
    from detslurm.controller import ops
    from detslurm.identity import Scope
    from detslurm.store import open_store

    ops.activate(open_store(settings.load().db_url), 1, Scope.mine())
    assert daemon.reconcile_once(settings.load())
    out = subprocess.run(["squeue", "-h", "-o", "%i %l"], capture_output=True, text=True, check=True).stdout
    assert out.split() and "1:00" not in out, out  # no 1-minute limit from SBATCH_TIMELIMIT
