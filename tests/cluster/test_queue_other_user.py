"""Root's queue edits of another user's trial, with per-user stores (the default), on the real
cluster: a priority and a pool move reach the owner's experiment (root's `det` opens the owner's
store as the owner), or say exactly what did not change; the dry run predicts it; the owner is
told when an administrator holds their job."""

from __future__ import annotations

import os
import pwd
import shutil
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT
from helpers import wait_for
from test_slurm_pool_move import blockers, shown, trial_job

pytestmark = [pytest.mark.slurm, pytest.mark.security, pytest.mark.usefixtures("slurm_env")]
USER = "detslurm-tester"
CORE = EXAMPLES / "core_api"


@pytest.fixture(scope="module")
def user_det() -> Path:
    """A `det` every user can run (security_harness.shared_det). Root runs it too: the child it
    starts as the owner must be able to run its interpreter."""
    from security_harness import shared_det

    return shared_det(ROOT)


@pytest.fixture
def owner() -> Iterator[tuple[pwd.struct_passwd, Path]]:
    """The second user, whose store is where their own `det` puts it: the dirs their config file
    (in their passwd home, which is all root knows of them) names."""
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-m", USER], check=True)
        pw = pwd.getpwnam(USER)
    dirs = Path(tempfile.mkdtemp(prefix="detslurm-owner-"))
    os.chown(dirs, pw.pw_uid, pw.pw_gid)
    config = Path(pw.pw_dir) / ".config/detslurm/config.yaml"
    as_owner(pw, ["mkdir", "-p", str(config.parent)])
    text = f"data_dir: {dirs}/data\nexperiments_dir: {dirs}/exps\ncheckpoint_dir: {dirs}/ckpts\n"
    as_owner(pw, ["sh", "-c", f"cat > {config}"], input=text)
    yield pw, dirs
    as_owner(pw, ["rm", "-rf", str(config.parent)])
    subprocess.run(["scancel", "-u", USER], check=False)
    shutil.rmtree(dirs, ignore_errors=True)


def as_owner(pw: pwd.struct_passwd, argv: list[str], input: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        "HOME": pw.pw_dir,
        "PATH": os.environ["PATH"],
        "SLURM_CONF": os.environ["SLURM_CONF"],
        "DETSLURM_SITE_CONFIG": os.environ["DETSLURM_SITE_CONFIG"],
        "DETSLURM_DAEMON_IDLE_EXIT_S": "60",
        "DETSLURM_POLL_INTERVAL_S": "0.5",
    }
    cmd = ["runuser", "-u", pw.pw_name, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp", input=input)


def root_det(det_bin: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(det_bin), *args], capture_output=True, text=True, cwd="/tmp")


def owners_experiment(dirs: Path) -> tuple[str, int | None]:
    """(pool, priority) of the owner's experiment 1, read from their store (read-only)."""
    import json

    db = sqlite3.connect(f"file:{dirs}/data/detslurm.db?mode=ro", uri=True)
    try:
        pool, config = db.execute("select resource_pool, config from experiments where id = 1").fetchone()
    finally:
        db.close()
    return pool, json.loads(config)["resources"].get("priority")


def test_root_reaches_the_owners_experiment(det: Any, user_det: Path, owner: tuple[pwd.struct_passwd, Path]) -> None:
    pw, dirs = owner
    blocking = blockers()
    r = as_owner(
        pw, [str(user_det), "e", "create", str(CORE / "const.yaml"), str(CORE), "--config", "hyperparameters.sleep=0"]
    )
    assert r.returncode == 0, r.stderr
    wait_for(lambda: trial_job(1) != "", what="the owner's trial job")
    job = trial_job(1)
    store = f"{USER}'s store ({dirs}/data/detslurm.db)"

    # Priority: the dry run says where it will be kept, and changes nothing.
    r = root_det(user_det, "--all-users", "job", "update", job, "--priority", "10", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"would run: scontrol update JobId={job} Nice=-3200" in r.stdout
    assert f"keep priority 10 for experiment 1's later submissions ({store})" in r.stdout
    assert shown(job)["Nice"] == "0" and owners_experiment(dirs)[1] is None
    r = root_det(user_det, "--all-users", "job", "update", job, "--priority", "10")
    assert r.returncode == 0, r.stderr
    assert shown(job)["Nice"] == "-3200" and owners_experiment(dirs)[1] == 10

    # A pool move: the job takes the GPU pool's GRES, and the owner's experiment the pool.
    r = root_det(user_det, "--all-users", "job", "update", job, "--resource-pool", "gpu", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"would run: scontrol update JobId={job} Partition=gpu TresPerNode=gres:gpu:1" in r.stdout
    assert f"move experiment 1 ({store}) to pool gpu" in r.stdout and shown(job)["Partition"] == "cpu"
    r = root_det(user_det, "--all-users", "job", "update", job, "--resource-pool", "gpu")
    assert r.returncode == 0, r.stderr
    assert (shown(job)["Partition"], shown(job)["TresPerNode"]) == ("gpu", "gres:gpu:1")
    assert owners_experiment(dirs)[0] == "gpu"

    # Without --all-users root does not change another user's experiment, and so not the job.
    r = root_det(user_det, "job", "update", job, "--resource-pool", "cpu")
    assert r.returncode == 1 and "takes det --all-users" in r.stderr and "nothing changed" in r.stderr
    assert shown(job)["Partition"] == "gpu"

    # A store root cannot find (the owner's config file moved away): the move is refused whole;
    # a priority changes the job only, and says so.
    config = Path(pw.pw_dir) / ".config/detslurm/config.yaml"
    assert as_owner(pw, ["mv", str(config), f"{config}.away"]).returncode == 0
    r = root_det(user_det, "--all-users", "job", "update", job, "--resource-pool", "cpu", "--dry-run")
    assert r.returncode == 1 and "cannot be moved with it" in r.stderr
    r = root_det(user_det, "--all-users", "job", "update", job, "--resource-pool", "cpu")
    assert r.returncode == 1 and "nothing changed" in r.stderr and shown(job)["Partition"] == "gpu"
    r = root_det(user_det, "--all-users", "job", "update", job, "--priority", "20")
    assert r.returncode == 0 and f"priority 20 is for job {job} only" in r.stderr
    assert shown(job)["Nice"] == "-2200" and owners_experiment(dirs) == ("gpu", 10)
    assert as_owner(pw, ["mv", f"{config}.away", str(config)]).returncode == 0

    # Back to the CPU pool: Slurm cannot take the GRES off, so the owner's job is replaced (the
    # child cancels it as the owner; the owner's daemon resubmits the trial in the new pool).
    r = root_det(user_det, "--all-users", "job", "update", job, "--resource-pool", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert owners_experiment(dirs)[0] == "cpu"
    wait_for(lambda: trial_job(1) not in ("", job), what="the owner's trial resubmitted in the cpu pool")
    moved = trial_job(1)
    now = shown(moved)
    assert now["Partition"] == "cpu" and "TresPerNode" not in now and now["UserId"].startswith(USER)

    # An administrator's hold: the owner is told who holds it, not Slurm's bare refusal.
    assert root_det(user_det, "job", "update", moved, "--hold").returncode == 0
    r = as_owner(pw, [str(user_det), "job", "update", moved, "--release"])
    assert r.returncode == 1 and "held by an administrator" in r.stderr and "JobHeldAdmin" in r.stderr
    assert shown(moved)["Reason"] == "JobHeldAdmin"
    subprocess.run(["scancel", *blocking], check=True)
    as_owner(pw, [str(user_det), "daemon", "stop"])
