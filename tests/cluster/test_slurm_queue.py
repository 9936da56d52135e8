"""The job queue on the real cluster, as root and as an ordinary Unix user the test creates."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
USER = "detslurm-tester"


def sbatch(*args: str, as_user: str | None = None) -> str:
    cmd = ["sbatch", "--parsable", "-o", "/dev/null", *args, "--wrap", "sleep 120"]
    if as_user:
        cmd = ["runuser", "-u", as_user, "--", "env", f"SLURM_CONF={os.environ['SLURM_CONF']}", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd="/tmp").stdout.strip()


def running(*jobs: str) -> None:
    import time

    deadline = time.time() + 30
    while time.time() < deadline:
        if all(squeue(j, "%T") == "RUNNING" for j in jobs):
            return
        time.sleep(0.2)
    raise AssertionError(f"jobs {jobs} did not start")


def squeue(job: str, fmt: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", fmt], capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def tester() -> str:
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-m", USER], check=True)
    return USER


@pytest.fixture(scope="module")
def user_det() -> Path:
    """A `det` other users can run (security_harness.shared_det: a venv from the system Python)."""
    from security_harness import shared_det

    return shared_det(ROOT)


def as_user(det_bin: Path, user: str, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "SLURM_CONF": os.environ["SLURM_CONF"],
        "DETSLURM_SITE_CONFIG": os.environ["DETSLURM_SITE_CONFIG"],
        "DETSLURM_DATA_DIR": str(home / "data"),
        "DETSLURM_EXPERIMENTS_DIR": str(home / "exps"),
        "DETSLURM_CHECKPOINT_DIR": str(home / "ckpts"),
        "HOME": str(home),
        "PATH": os.environ["PATH"],
    }
    cmd = ["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()), str(det_bin), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp")


@pytest.mark.slurm24_smoke
def test_queue_as_root(det: Any) -> None:
    blockers = [sbatch("-c", "2", "-w", "c1"), sbatch("-c", "2", "-w", "c2")]
    running(*blockers)
    a, b = sbatch("-c", "2"), sbatch("-c", "2")
    code, out, _ = det("job", "list")
    assert code == 0 and "TYPE_EXTERNAL" in out and "STATE_QUEUED" in out and "Pending Reason" in out
    assert det("job", "update", b, "--priority", "10")[0] == 0  # root may raise
    assert int(squeue(b, "%y")) == -3200 and int(squeue(b, "%Q")) > int(squeue(a, "%Q"))
    assert det("job", "update", a, "--ahead-of", b)[0] == 0
    assert int(squeue(a, "%Q")) > int(squeue(b, "%Q"))
    assert det("job", "update", a, "--hold")[0] == 0 and squeue(a, "%r") == "JobHeldAdmin"
    assert det("job", "update", a, "--release")[0] == 0 and squeue(a, "%r") != "JobHeldAdmin"
    code, _, err = det("job", "update", a, "--resource-pool", "gpu")
    assert code == 0, err
    assert squeue(a, "%P") == "gpu"
    code, _, err = det("job", "update", blockers[0], "--resource-pool", "gpu")
    assert code == 1 and "Slurm cannot move a running job to another partition" in err
    code, out, _ = det("job", "update-batch", f"{b}.priority=50", f"{a}.priority=50")
    assert code == 0 and squeue(b, "%y") == "800"


@pytest.fixture
def tester_home(tester: str) -> Iterator[Path]:
    """A private home the test user owns. Not under pytest's tmp dir: that is private to root
    (0700 parents), so the user could not even look for its own config there."""
    home = Path(tempfile.mkdtemp(prefix="detslurm-tester-home-"))
    os.chown(home, pwd.getpwnam(tester).pw_uid, pwd.getpwnam(tester).pw_gid)
    yield home
    # The user's jobs outlive a failed test otherwise (the slurm_env teardown cancels root's).
    subprocess.run(["scancel", "-u", tester], check=False)
    shutil.rmtree(home, ignore_errors=True)


@pytest.mark.fault
def test_queue_as_ordinary_user(det: Any, tester: str, user_det: Path, tester_home: Path) -> None:
    home = tester_home
    blockers = [sbatch("-c", "2", "-w", "c1"), sbatch("-c", "2", "-w", "c2")]
    running(*blockers)
    roots = sbatch("-c", "2")
    mine, mine2 = sbatch("-c", "2", as_user=tester), sbatch("-c", "2", as_user=tester)
    r = as_user(user_det, tester, home, "job", "list")
    assert r.returncode == 0, r.stderr
    assert tester in r.stdout and "root" in r.stdout
    r = as_user(user_det, tester, home, "job", "update", mine, "--priority", "60")  # lowering: allowed
    assert r.returncode == 0, r.stderr
    assert squeue(mine, "%y") == "1800"
    r = as_user(user_det, tester, home, "job", "update", mine, "--priority", "10")
    assert r.returncode == 1 and "lets ordinary users only lower the priority" in r.stderr
    assert squeue(mine, "%y") == "1800"
    r = as_user(user_det, tester, home, "job", "update", roots, "--hold")
    assert r.returncode == 1 and "belongs to root; you can only change your own jobs" in r.stderr
    assert squeue(roots, "%r") != "JobHeldUser"
    r = as_user(user_det, tester, home, "job", "update", mine2, "--ahead-of", mine)  # scontrol top (enable_user_top)
    assert r.returncode == 0, r.stderr
    r = as_user(user_det, tester, home, "job", "update", mine, "--hold")
    assert r.returncode == 0 and squeue(mine, "%r") == "JobHeldUser"
    # Slurm itself refuses too: the check is not only ours.
    raw = subprocess.run(
        ["runuser", "-u", tester, "--", "env", f"SLURM_CONF={os.environ['SLURM_CONF']}", "scancel", roots],
        capture_output=True,
        text=True,
    )
    assert raw.returncode != 0 and "Access/permission denied" in raw.stderr
    del blockers


@pytest.mark.fault
def test_other_users_cannot_read_experiments(det: Any, tester: str, tmp_path: Path) -> None:
    code, out, err = det(
        "e",
        "create",
        "--local",
        EXAMPLES / "core_api/const.yaml",
        EXAMPLES / "core_api",
        "--config",
        "hyperparameters.sleep=0",
    )
    assert code == 0, err
    from detslurm import settings

    s = settings.load()
    exp_dir = Path(s.experiments_dir) / "exp-1"
    os.chmod(tmp_path, 0o755)  # let the other user reach the dirs: the experiment dir itself stays private
    for p in (exp_dir, Path(s.data_dir) / "detslurm.db"):
        r = subprocess.run(["runuser", "-u", tester, "--", "ls", str(p)], capture_output=True, text=True)
        assert r.returncode != 0 and "Permission denied" in r.stderr
