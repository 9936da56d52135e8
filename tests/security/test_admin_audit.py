"""What admins observe (docs/admin/audit.md): root's audit log of `det --all-users`, which only
root can write and no other user can redirect, and `det --all-users daemon status`, every user's
daemon on this login node, read from their own files without following their links.

Root runs det in-process; the second Unix user runs a real det (security_harness.shared_det)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from security_harness import Attacker, run_as, shared_det, victim_base

from detslurm.audit import AuditLog, changes_jobs
from detslurm.slurm.client import Result

pytestmark = pytest.mark.security


@pytest.fixture
def base() -> Iterator[Path]:
    path = victim_base()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def admin_site(base: Path, monkeypatch: pytest.MonkeyPatch, log: Path) -> Path:
    """The admin's site file (root's, 0644) naming ``log`` as the audit log."""
    path = base / "admin-site.yaml"
    path.write_text(f"audit_log: {log}\n")
    path.chmod(0o644)
    monkeypatch.setenv("DETSLURM_ADMIN_SITE_CONFIG", str(path))
    monkeypatch.delenv("DETSLURM_SITE_CONFIG", raising=False)
    return path


def records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def mallory_det(mallory: Attacker) -> Path:
    det_bin = shared_det(ROOT)
    r = run_as(mallory.user, [str(det_bin), "--version"], cwd=str(mallory.home))
    assert r.returncode == 0, f"{mallory.user.pw_name} cannot run {det_bin}: {r.stderr}"
    return det_bin


def mallory_env(mallory: Attacker, **extra: str) -> dict[str, str]:
    home = mallory.home
    for sub in ("data", "exps"):
        (home / sub).mkdir(exist_ok=True)
        os.chown(home / sub, mallory.uid, mallory.user.pw_gid)
    return {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(home),
        "DETSLURM_DATA_DIR": str(home / "data"),
        "DETSLURM_EXPERIMENTS_DIR": str(home / "exps"),
        "DETSLURM_CONFIG": str(home / "no-config.yaml"),
        **extra,
    }


# -- the audit log --------------------------------------------------------------------------


def test_every_all_users_command_is_recorded_in_a_log_only_root_can_write(
    det: Any, base: Path, monkeypatch: pytest.MonkeyPatch, mallory: Attacker, mallory_det: Path
) -> None:
    log = base / "log" / "audit.log"
    admin_site(base, monkeypatch, log)
    monkeypatch.setenv("SUDO_USER", "alice")
    code, out, err = det("--all-users", "e", "list", "--json")
    assert code == 0, err
    [rec] = records(log)
    assert rec["event"] == "command" and rec["argv"] == ["det", "--all-users", "e", "list", "--json"]
    assert rec["user"] == "root" and rec["uid"] == 0 and rec["sudo_user"] == "alice" and rec["time"]
    assert oct(log.stat().st_mode & 0o777) == "0o600" and oct(log.parent.stat().st_mode & 0o777) == "0o750"
    code, _, err = det("e", "list")  # root's own commands are not admin actions
    assert code == 0 and len(records(log)) == 1, err
    # The second user can neither read nor append to it, nor pass as root to write in it.
    assert not mallory.can_read(log)
    r = mallory.python_snippet("import sys; open(sys.argv[1], 'a').write('forged\\n')", str(log))
    assert r.returncode != 0 and "PermissionError" in r.stderr
    env = mallory_env(mallory, DETSLURM_ADMIN_SITE_CONFIG=str(base / "admin-site.yaml"), USER="root")
    r = run_as(mallory.user, [str(mallory_det), "--all-users", "e", "list"], env=env, cwd=str(mallory.home))
    assert r.returncode == 1 and "--all-users is only for root" in r.stderr
    assert len(records(log)) == 1


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_a_log_in_a_dir_others_may_write_is_refused_and_the_command_does_nothing(
    det: Any, base: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(mode)
    admin_site(base, monkeypatch, shared / "audit.log")
    code, out, err = det("--all-users", "e", "list")
    assert code == 1 and f"{shared} is writable by users other than root" in err and out == ""
    assert not (shared / "audit.log").exists()


def test_a_log_planted_as_a_link_or_by_another_user_is_refused(
    det: Any, base: Path, monkeypatch: pytest.MonkeyPatch, mallory: Attacker
) -> None:
    logs = base / "logs"
    logs.mkdir(mode=0o755)
    target = base / "elsewhere"
    target.write_text("")
    (logs / "audit.log").symlink_to(target)
    admin_site(base, monkeypatch, logs / "audit.log")
    code, _, err = det("--all-users", "e", "list")
    assert code == 1 and "cannot open the audit log" in err and target.read_text() == ""
    (logs / "audit.log").unlink()
    (logs / "audit.log").write_text("")
    os.chown(logs / "audit.log", mallory.uid, mallory.user.pw_gid)  # a file another user owns
    code, _, err = det("--all-users", "e", "list")
    assert code == 1 and "must be a regular file owned by root and writable by no one else" in err


class FakeSlurm:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: Any, *, input: Any = None, timeout: float, env: Any = None) -> Result:
        self.calls.append(list(argv))
        return Result(1 if argv[1] == "hold" else 0, "", "Access/permission denied" if argv[1] == "hold" else "")


def test_slurm_calls_that_change_jobs_are_recorded_before_they_run_with_their_outcome(base: Path) -> None:
    logs = base / "logs"
    logs.mkdir(mode=0o700)
    audit = AuditLog(logs / "audit.log", env={})
    slurm = FakeSlurm()
    run = audit.runner(slurm)
    run(["squeue", "-h", "-u", "x"], timeout=5)
    run(["scontrol", "show", "job", "34"], timeout=5)
    run(["scontrol", "update", "JobId=34", "Partition=gpu"], timeout=5)
    run(["scontrol", "hold", "35"], timeout=5)
    got = [(r["event"], r["slurm"], r.get("returncode"), r.get("stderr")) for r in records(logs / "audit.log")]
    assert got == [
        ("slurm_call", ["scontrol", "update", "JobId=34", "Partition=gpu"], None, None),
        ("slurm_result", ["scontrol", "update", "JobId=34", "Partition=gpu"], 0, ""),
        ("slurm_call", ["scontrol", "hold", "35"], None, None),
        ("slurm_result", ["scontrol", "hold", "35"], 1, "Access/permission denied"),
    ]
    assert len(slurm.calls) == 4
    # A call the log cannot record is never made.
    logs.chmod(0o777)
    with pytest.raises(Exception, match="writable by users other than root"):
        run(["scancel", "36"], timeout=5)
    assert len(slurm.calls) == 4
    assert [changes_jobs(a.split()) for a in ("sbatch x", "scancel 1", "sinfo", "sacctmgr show assoc")] == [
        True,
        True,
        False,
        False,
    ]


# -- every user's daemon ---------------------------------------------------------------------


def _wait_status(path: Path) -> None:
    deadline = time.time() + 120  # a guard: a loaded machine starts a daemon slowly
    while not path.exists() and time.time() < deadline:
        time.sleep(0.2)


def test_root_lists_every_users_daemon_with_its_polling_and_last_tick(
    det: Any, det_env: Path, base: Path, monkeypatch: pytest.MonkeyPatch, mallory: Attacker, mallory_det: Path
) -> None:
    admin_site(base, monkeypatch, base / "log" / "audit.log")
    env = mallory_env(mallory, DETSLURM_POLL_INTERVAL_S="12")
    home = mallory.home

    def as_mallory(*args: str) -> subprocess.CompletedProcess[str]:
        return run_as(mallory.user, [str(mallory_det), *args], env=env, cwd=str(home))

    try:
        r = as_mallory("daemon", "start")
        assert r.returncode == 0, r.stderr
        code, out, err = det("daemon", "start")
        assert code == 0, err
        _wait_status(home / "data/daemon.status")
        _wait_status(det_env / "data/daemon.status")
        r = as_mallory("daemon", "status")
        assert r.returncode == 0 and "polling every 12 s, last tick" in r.stdout, r.stdout + r.stderr
        code, out, err = det("--all-users", "daemon", "status", "--json")
        assert code == 0, err
        mine = {d["user"]: d for d in json.loads(out) if Path(d["data_dir"]) in (home / "data", det_env / "data")}
        assert set(mine) == {"root", mallory.user.pw_name}, out
        theirs = mine[mallory.user.pw_name]
        assert theirs["tick"]["poll_interval_s"] == 12 and theirs["tick"]["ok"] is True
        assert time.time() - theirs["tick"]["last_tick"] < 600
        # A status file swapped for a link to a file of root's is not read (the daemon rewrites
        # it by rename, so the link is there until its next round).
        secret = base / "root-only.json"
        secret.write_text(json.dumps({**theirs["tick"], "poll_interval_s": 999}))
        link = mallory.python_snippet(
            "import os, sys; os.remove(sys.argv[1]); os.symlink(sys.argv[2], sys.argv[1])",
            str(home / "data/daemon.status"),
            str(secret),
        )
        assert link.returncode == 0, link.stderr
        code, out, err = det("--all-users", "daemon", "status", "--json")
        theirs = next(d for d in json.loads(out) if d["user"] == mallory.user.pw_name)
        assert theirs["tick"] is None or theirs["tick"]["poll_interval_s"] == 12
        code, out, err = det("--all-users", "daemon", "status")
        assert code == 0 and mallory.user.pw_name in out and "Polling and last tick" in out
        # Only root looks at other users' daemons.
        r = as_mallory("--all-users", "daemon", "status")
        assert r.returncode == 1 and "--all-users is only for root" in r.stderr
    finally:
        as_mallory("daemon", "stop")
        det("daemon", "stop")
