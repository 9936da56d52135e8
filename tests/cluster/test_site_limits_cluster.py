"""The admin's site limits on the real test cluster, as root and as a second Unix user
(docs/admin/site-config.md): the polling floor bounds the calls a user's daemon makes to
slurmctld whatever the user's own site file and environment ask for (counted by a logging
squeue on the daemon's PATH), and neither the environment nor sbatch_args get a user past them.

The admin's file stands in for /etc/detslurm/site.yaml through $DETSLURM_ADMIN_SITE_CONFIG,
honoured only for a file root owns and no one else may write."""

from __future__ import annotations

import os
import shlex
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT, write
from security_harness import Attacker, run_as, shared_det, victim_base

from detslurm import daemon, settings

pytestmark = pytest.mark.slurm
CORE = EXAMPLES / "core_api"
FLOOR_S = 4.0  # the admin's floor; the user asks for 0.5 s
WINDOW_S = 16.0  # 4 ticks at the floor, 32 at the user's 0.5 s


def admin_file(base: Path, **changes: str) -> Path:
    """The test cluster's site config as the admin's file, with ``changes`` (top-level keys),
    root's and 0644 in a directory others may traverse."""
    lines = [ln for ln in (ROOT / "site-configs/test-cluster.yaml").read_text().splitlines()]
    lines = [ln for ln in lines if ln.partition(":")[0] not in changes]
    path = write(base / "admin-site.yaml", "\n".join([*lines, *(f"{k}: {v}" for k, v in changes.items())]) + "\n")
    path.chmod(0o644)
    return path


@pytest.fixture
def limited(slurm_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The admin's floor of FLOOR_S and account lock; the user's own site file and environment
    ask for 0.5 s polling."""
    base = victim_base()
    path = admin_file(base, poll_interval_s=str(FLOOR_S), limits="{accounts: [nosuch-admin-account]}")
    monkeypatch.setenv("DETSLURM_ADMIN_SITE_CONFIG", str(path))
    mine = write(slurm_env / "my-site.yaml", "poll_interval_s: 0.5\n")
    monkeypatch.setenv("DETSLURM_SITE_CONFIG", str(mine))
    monkeypatch.setenv("DETSLURM_POLL_INTERVAL_S", "0.5")
    yield path
    shutil.rmtree(base, ignore_errors=True)


def logging_squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An squeue first on PATH that logs each call, then runs the real one."""
    real = shutil.which("squeue")
    assert real is not None
    log = tmp_path / "squeue-calls"
    write(
        tmp_path / "shim/squeue",
        f'#!/bin/bash\necho "$$ $*" >> {shlex.quote(str(log))}\nexec {shlex.quote(real)} "$@"\n',
    ).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'shim'}:{os.environ['PATH']}")
    return log


def calls(log: Path) -> int:
    # One line per call; not splitlines(): squeue's format holds separators it splits on.
    return log.read_bytes().count(b"\n") if log.exists() else 0


def test_the_admins_floor_bounds_the_daemons_slurmctld_calls(
    det: Any, limited: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = logging_squeue(tmp_path, monkeypatch)
    # Its job waits for its begin time: the experiment stays active (one squeue per tick) and
    # takes no node.
    code, out, err = det("e", "create", CORE / "const.yaml", CORE, "--config", "slurm.sbatch_args=[--begin=now+3600]")
    assert code == 0, out + err
    s = settings.load()
    assert daemon.running_pid(s) is not None, "the create started no daemon"
    deadline = time.time() + 120  # a guard: a loaded machine starts the daemon slowly
    while calls(log) < 2 and time.time() < deadline:
        time.sleep(0.2)
    start, t0 = calls(log), time.monotonic()
    assert start >= 2, "the daemon never polled: the shim proves nothing"
    time.sleep(WINDOW_S)
    made, took = calls(log) - start, time.monotonic() - t0
    code, out, err = det("e", "kill", "1")
    assert code == 0, out + err
    # At most one tick per floor (plus the one in progress); the user's 0.5 s would be 32.
    assert 1 <= made <= took / FLOOR_S + 1, f"{made} squeue calls in {took:.1f} s with a floor of {FLOOR_S} s"
    assert f"polling every {FLOOR_S:.1f} s" in (s.data_dir / "daemon.log").read_text()


def test_sbatch_args_cannot_change_the_locked_account_as_root(det: Any, limited: Path) -> None:
    code, out, err = det("e", "create", CORE / "const.yaml", CORE, "--config", "slurm.sbatch_args=[--account=other]")
    assert code != 0
    assert f"--account other is not allowed: limits.accounts in {limited}" in err
    code, out, _ = det("e", "list", "--json")
    assert code == 0 and out.strip() in ("[]", "")


# -- the second user ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mallory_det(mallory: Attacker) -> Path:
    det_bin = shared_det(ROOT)
    r = run_as(mallory.user, [str(det_bin), "--version"], cwd=str(mallory.home))
    if r.returncode != 0:
        pytest.fail(f"{mallory.user.pw_name} cannot run {det_bin}: {r.stderr}")
    return det_bin


@pytest.mark.security
def test_a_second_user_gets_past_the_admins_limits_neither_by_environment_nor_by_sbatch_args(
    mallory: Attacker, mallory_det: Path, slurm_cluster: Path
) -> None:
    # Other users reach slurm.conf and munge's socket (scripts/test-cluster opens the path the
    # same way; a pytest session started since may have closed pytest's base dir again).
    for d in [slurm_cluster, *slurm_cluster.parents][:-1]:
        d.chmod(d.stat().st_mode | 0o001)
    base = victim_base()
    try:
        admin = admin_file(base, poll_interval_s=str(FLOOR_S), limits="{accounts: [nosuch-admin-account]}")
        home = mallory.home
        for sub in ("data", "exps", "ckpts"):
            (home / sub).mkdir(exist_ok=True)
            os.chown(home / sub, mallory.uid, mallory.user.pw_gid)
        own = home / "loose-site.yaml"
        own.write_text(
            "poll_interval_s: 0.5\n" + (ROOT / "site-configs/test-cluster.yaml").read_text().split("\n", 1)[1]
        )
        os.chown(own, mallory.uid, mallory.user.pw_gid)
        env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": str(home),
            "SLURM_CONF": str(slurm_cluster / "etc/slurm.conf"),
            "DETSLURM_DATA_DIR": str(home / "data"),
            "DETSLURM_EXPERIMENTS_DIR": str(home / "exps"),
            "DETSLURM_CHECKPOINT_DIR": str(home / "ckpts"),
            "DETSLURM_CONFIG": str(home / "no-config.yaml"),
            "DETSLURM_POLL_INTERVAL_S": "0.5",
            "DETSLURM_ADMIN_SITE_CONFIG": str(admin),
            "DETSLURM_SITE_CONFIG": str(own),
        }

        def det(*args: str, **over: str) -> tuple[int, str]:
            r = run_as(mallory.user, [str(mallory_det), *args], env={**env, **over}, cwd=str(home), timeout=600)
            return r.returncode, r.stdout + r.stderr

        # The doctor (login-side checks only) names the admin's file as the floor's source.
        code, out = det("site", "doctor", "--no-probe", "--json")
        assert f"site floor poll_interval_s {FLOOR_S:g} s (from {admin})" in out, out
        assert f"pools cpu, gpu, high of {own} are the site's too" in out, out  # the admin's are used
        # Naming their own file as the admin's is refused; so is a file root owns that they may write.
        code, out = det("site", "doctor", "--no-probe", DETSLURM_ADMIN_SITE_CONFIG=str(own))
        assert code != 0 and "must be owned by root and writable by no one else" in out, out
        admin.chmod(0o666)
        code, out = det("site", "doctor", "--no-probe")
        assert code != 0 and "must be owned by root and writable by no one else" in out, out
        admin.chmod(0o644)
        # sbatch_args come after the pool's options on sbatch's line: a locked account is refused.
        code, out = det("e", "create", str(CORE / "const.yaml"), str(CORE), "--config", "slurm.sbatch_args=[-A, x]")
        assert code != 0 and f"--account x is not allowed: limits.accounts in {admin}" in out, out
    finally:
        shutil.rmtree(base, ignore_errors=True)
