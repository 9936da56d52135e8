"""The daemon's pid file proves who the daemon is: host, uid, pid and the process's create time
(docs/design/security.md). Anything else is "not running here", and is never signalled."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from detslurm import daemon, settings
from detslurm.settings import Settings


@pytest.fixture
def s(det_env: Path) -> Settings:
    cfg = settings.load()
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    return cfg


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of ours that is not the daemon, with the daemon's module name on its command
    line (as another user's or another store's daemon has: the name proves nothing)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "detslurm.daemon"])
    yield p
    p.kill()
    p.wait()


def record_for(pid: int) -> daemon.PidRecord:
    """What the process ``pid`` would write, were it our daemon on this host."""
    return daemon.PidRecord(socket.gethostname(), os.getuid(), pid, psutil.Process(pid).create_time())


def write(s: Settings, rec: daemon.PidRecord | str) -> None:
    daemon.Paths(s).pid.write_text(rec if isinstance(rec, str) else rec.to_json())


def test_a_matching_record_is_running(s: Settings, sleeper: subprocess.Popen[bytes]) -> None:
    write(s, record_for(sleeper.pid))
    assert daemon.running_pid(s) == sleeper.pid
    assert daemon.daemon_status(s).detail == f"running (pid {sleeper.pid})"


def test_a_reused_pid_is_not_running(s: Settings, sleeper: subprocess.Popen[bytes]) -> None:
    rec = record_for(sleeper.pid)
    write(s, replace(rec, create_time=rec.create_time - 100))
    assert daemon.running_pid(s) is None
    assert daemon.stop(s, wait_s=0.5) is None
    assert sleeper.poll() is None  # not signalled


def test_another_hosts_daemon_is_not_running_here(s: Settings, sleeper: subprocess.Popen[bytes]) -> None:
    write(s, replace(record_for(sleeper.pid), host="login-other"))
    st = daemon.daemon_status(s)
    assert st.pid is None
    assert "not running here" in st.detail and "login-other" in st.detail
    assert daemon.stop(s, wait_s=0.5) is None
    assert sleeper.poll() is None


def test_another_uids_record_is_not_running(s: Settings, sleeper: subprocess.Popen[bytes]) -> None:
    write(s, replace(record_for(sleeper.pid), uid=os.getuid() + 1))
    assert daemon.running_pid(s) is None
    assert "uid" in daemon.daemon_status(s).detail


@pytest.fixture
def foreign_pid() -> Iterator[int]:
    """A live process of another uid: pid 1 for an ordinary user; as root, a sleeper run as nobody."""
    if os.getuid() != 0:
        yield 1
        return
    p = subprocess.Popen(["sh", "-c", "sleep 60", "detslurm.daemon"], user="nobody", start_new_session=True)
    yield p.pid
    os.killpg(p.pid, signal.SIGKILL)  # sh and its sleep
    p.wait()


def test_another_users_process_is_not_running_and_stop_does_not_raise(s: Settings, foreign_pid: int) -> None:
    assert psutil.Process(foreign_pid).uids().real != os.getuid()
    write(s, record_for(foreign_pid))  # our host and uid claimed, but the process is not ours
    assert daemon.running_pid(s) is None
    assert daemon.stop(s, wait_s=0.5) is None
    assert psutil.Process(foreign_pid).is_running()


@pytest.mark.parametrize("text", ["", "12345", "{", '{"host": "h"}', '{"host":"h","uid":0,"pid":-1,"create_time":0}'])
def test_unreadable_or_old_pid_files_are_not_running(s: Settings, text: str) -> None:
    write(s, text)
    assert daemon.running_pid(s) is None
    assert daemon.stop(s, wait_s=0.5) is None


def test_no_pid_file(s: Settings, det: Any) -> None:
    assert daemon.running_pid(s) is None
    code, out, _ = det("daemon", "status")
    assert (code, out.strip()) == (1, "detslurm daemon: not running")


def test_cli_status_and_stop_explain_another_host(s: Settings, det: Any, sleeper: subprocess.Popen[bytes]) -> None:
    write(s, replace(record_for(sleeper.pid), host="login-other"))
    code, out, _ = det("daemon", "status")
    assert code == 1 and "not running here" in out and "login-other" in out
    code, out, _ = det("daemon", "stop")
    assert code == 0 and "not running here" in out
    assert sleeper.poll() is None


def test_store_url_password_is_masked() -> None:
    masked = daemon._safe_url("postgresql://alice:s3cret@db:5432/det")
    assert "s3cret" not in masked and "alice" in masked


def test_a_started_daemon_is_recognised_and_stopped(s: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETSLURM_DAEMON_IDLE_EXIT_S", "30")
    pid = daemon.start(s)
    try:
        rec = daemon.PidRecord.parse(daemon.Paths(s).pid.read_text())
        assert rec == record_for(pid)
        assert daemon.running_pid(s) == pid
    finally:
        assert daemon.stop(s) == pid
    assert daemon.running_pid(s) is None
    assert not daemon.Paths(s).pid.exists()  # the daemon removed its own record


def test_a_slow_starting_daemon_is_waited_for(s: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded login node: the daemon's interpreter takes 12 s before it even imports detslurm
    (a sitecustomize that sleeps). `start` waits for it instead of failing `det e create`
    (it gave up after 10 s, which this test then failed with)."""
    slow = tmp_path / "slow"
    slow.mkdir()
    # Only the first interpreter to start (the daemon) sleeps, not the ones it starts in turn.
    (slow / "first").touch()
    code = f"import os, time\nif os.path.exists({str(slow / 'first')!r}):\n    os.remove({str(slow / 'first')!r})\n    time.sleep(12)\n"
    (slow / "sitecustomize.py").write_text(code)
    monkeypatch.setenv("PYTHONPATH", str(slow))
    monkeypatch.setenv("DETSLURM_DAEMON_IDLE_EXIT_S", "30")
    pid = daemon.start(s)
    try:
        assert daemon.running_pid(s) == pid
    finally:
        assert daemon.stop(s) == pid


def test_a_daemon_whose_data_dir_is_deleted_exits(s: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user deletes the data dir (to start afresh) while the daemon runs: that daemon lost its
    pid file, so `det daemon stop` cannot find it, and would poll Slurm for good beside the next
    daemon. It exits at its next tick instead."""
    monkeypatch.setenv("DETSLURM_DAEMON_IDLE_EXIT_S", "300")
    monkeypatch.setenv("DETSLURM_POLL_INTERVAL_S", "0.2")
    pid = daemon.start(s)
    proc = psutil.Process(pid)
    try:
        shutil.rmtree(s.data_dir)
        deadline = time.monotonic() + 60  # a guard: it exits within one poll interval
        while time.monotonic() < deadline and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.1)
        assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE, "the daemon kept running"
    finally:
        if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            proc.kill()
        os.waitpid(pid, 0)  # our child (daemon.start's Popen): reaped here
