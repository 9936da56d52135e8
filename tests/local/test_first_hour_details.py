"""The smaller things a new user meets in the first hour, in local mode: sizes as people read
them, the context directory Determined requires, config errors that name the file, a dashboard
without Slurm, controller notes in time order, a kill that stops the searcher, and the
messages of remote mode when paramiko or the login node's SFTP is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES

from detslurm.util import format_size

CORE = EXAMPLES / "core_api"


def test_sizes_read_as_people_read_them(det: Any, tmp_path: Path) -> None:
    assert [format_size(n) for n in (0, 512, 1024, 61442.1 * 1024, 1024**2 - 1, 5.5 * 1024**3)] == [
        "0 B",
        "512 B",
        "1.0 KiB",
        "60.0 MiB",
        "1.0 MiB",
        "5.5 GiB",
    ]
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text((CORE / "train.py").read_text())
    with open(ctx / "blob.bin", "wb") as f:  # sparse: st_size counts
        f.truncate(3 * 2**20)
    code, out, err = det("e", "create", "--dry-run", "--local", CORE / "const.yaml", ctx)
    assert code == 0, err
    assert "(2 entries, 3.0 MiB, sha256 " in out


def test_create_needs_the_context_directory(det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Determined's CLI takes the context as optional and then sends no code; packaging the
    current directory instead (a home directory, say) is refused with the fix."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text((CORE / "train.py").read_text())
    (ctx / "const.yaml").write_text((CORE / "const.yaml").read_text())
    monkeypatch.chdir(ctx)
    for args in (["const.yaml"], ["--config-file", "const.yaml"]):
        code, out, err = det("e", "create", "--local", "--dry-run", *args)
        assert code == 2 and "missing the context directory" in err, err
        assert "pass `.` for the current directory" in err and "Traceback" not in err
    code, out, err = det("e", "create", "--local", "--dry-run", "const.yaml", ".")
    assert code == 0 and "# dry run: nothing was created" in out, err
    code, out, err = det("e", "create", "--local", "--dry-run", "--config-file", "const.yaml", ".")
    assert code == 0 and "# dry run: nothing was created" in out, err


def test_controller_notes_come_in_time_order_among_the_runs(det: Any, tmp_path: Path) -> None:
    """A trial whose first run failed and whose second completed: the note about the first
    run's exit sits between the two runs' output, not after all of it (full listing and --tail)."""
    from datetime import datetime, timedelta, timezone

    from detslurm import settings
    from detslurm.identity import os_user
    from detslurm.store import Experiment, LogEntry, Trial, TrialRun, open_store

    t0 = datetime(2026, 11, 1, 12, 0, tzinfo=timezone.utc)
    at = lambda s: t0 + timedelta(seconds=s)  # noqa: E731
    store = open_store(settings.load().db_url)
    with store.tx() as s:
        e = Experiment(
            name="two-runs",
            owner=os_user(),
            config={"searcher": {"name": "single", "metric": "loss"}},
            original_config="",
            context_sha256="0",
            exp_dir=str(tmp_path / "exp"),
            executor="local",
            resource_pool="cpu",
            progress=1.0,
            state="COMPLETED",
        )
        s.add(e)
        s.flush()
        t = Trial(experiment_id=e.id, request_id="r0", hparams={}, seed=0, state="COMPLETED", start_time=t0)
        s.add(t)
        s.flush()
        trial_id = int(t.id)
        for run_id, start, lines in ((1, 0, "[rank=0] first run\n[rank=0] boom\n"), (2, 20, "[rank=0] second run\n")):
            log = tmp_path / f"run{run_id}.log"
            log.write_text(lines)
            s.add(
                TrialRun(
                    trial_id=trial_id,
                    run_id=run_id,
                    state="EXITED",
                    executor="local",
                    run_dir=str(tmp_path),
                    log_path=str(log),
                    start_time=at(start),
                    end_time=at(start + 10),
                )
            )
        # Added out of time order: the order shown comes from the times.
        s.add(LogEntry(trial_id=trial_id, time=at(35), level="INFO", message="trial completed"))
        s.add(LogEntry(trial_id=trial_id, time=at(12), level="WARNING", message="run 1 exited with code 1; restarting"))
    code, out, err = det("t", "logs", str(trial_id))
    assert code == 0, err
    shown = [line.split(" (")[0] if line.startswith("===") else line.split("|| ")[-1] for line in out.splitlines()]
    assert shown == [
        f"=== trial {trial_id} run 1",
        "[rank=0] first run",
        "[rank=0] boom",
        "WARNING: run 1 exited with code 1; restarting",
        f"=== trial {trial_id} run 2",
        "[rank=0] second run",
        "INFO: trial completed",
    ]
    code, out, err = det("t", "logs", str(trial_id), "--tail", "5")
    assert code == 0 and [line.split("|| ")[-1].split(" (")[0] for line in out.splitlines()] == shown[2:], out


def test_a_killed_experiment_creates_no_trial_after_the_kill(det: Any, tmp_path: Path) -> None:
    """A random search of 3 trials, one at a time: killing it while the first runs ends the
    search there. Before, the searcher's replacement for the killed trial was created (and
    canceled) after the kill, and `det e list-trials` showed it."""
    from helpers import store, wait_for
    from sqlalchemy import select

    from detslurm.store import Trial

    def trial_states() -> list[str]:
        with store().read() as s:
            return [str(t.state.value) for t in s.scalars(select(Trial).order_by(Trial.id))]

    cfg = tmp_path / "random.yaml"
    cfg.write_text(
        (CORE / "const.yaml")
        .read_text()
        .replace("name: single", "name: random\n  max_trials: 3\n  max_concurrent_trials: 1")
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "detslurm.cli.main", "e", "create", "--local", str(cfg), str(CORE)]
        + ["--config", "hyperparameters.sleep=0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: trial_states() == ["ACTIVE"], interval=0.1)
        assert det("e", "kill", "1")[0] == 0
        out, _ = proc.communicate(timeout=300)
    finally:  # a failed wait must not leave the driver running
        if proc.poll() is None:
            proc.kill()
    assert "Experiment 1 CANCELED" in out, out
    assert trial_states() == ["CANCELED"]


@pytest.mark.parametrize("persist", ["600", "0"])
@pytest.mark.parametrize("paramiko", ["not installed", "broken"])
def test_remote_mode_without_paramiko_names_the_extra(
    det_env: Path, tmp_path: Path, paramiko: str, persist: str
) -> None:
    """`det -m ssh://...` on a laptop without the remote extra: one line naming
    `pip install 'detslurm[remote]'`, with the connection holder (persist_s > 0) or without;
    no ImportError traceback and no "holder exited" message. A broken install (paramiko present,
    its import failing) says the same, with the import's own error."""
    import os

    hide = tmp_path / "hide"
    hide.mkdir()
    if paramiko == "not installed":
        # As if absent: find_spec answers None and the import fails.
        (hide / "sitecustomize.py").write_text("import sys\nsys.modules['paramiko'] = None\n")
    else:
        (hide / "paramiko").mkdir()
        (hide / "paramiko" / "__init__.py").write_text("raise ImportError(\"No module named 'cryptography'\")\n")
    env = dict(os.environ, PYTHONPATH=str(hide), DETSLURM_REMOTE_PERSIST_S=persist)
    p = subprocess.run(
        [sys.executable, "-m", "detslurm.cli.main", "-m", "ssh://127.0.0.1:1", "e", "list"],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert "remote mode needs its extra: pip install 'detslurm[remote]'" in line
    assert ("cryptography" in line) == (paramiko == "broken")
    assert "Traceback" not in p.stderr and "holder" not in p.stderr


@pytest.mark.parametrize("persist", ["0", "60"])
def test_a_login_node_without_sftp_says_so(
    det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persist: str
) -> None:
    """A real sshd configured without the SFTP subsystem (tests/sshd_harness.py): `det e create`
    over ssh:// says that SFTP is missing and what to do, directly and through the connection
    holder (which reset the connection: "[Errno 104] Connection reset by peer")."""
    import os
    import shutil
    import tempfile

    pytest.importorskip("paramiko")
    import sshd_harness as sh

    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the remote-mode tests start sshd as root, and CI runs as root")
        pytest.skip("the remote-mode tests start sshd as root")
    sh.ensure_openssh()
    sh.ensure_user()
    key = sh.keygen(tmp_path / "laptop_key")
    # sshd reads the keys as the ssh user: a file of their own, outside root's private tmp.
    keys = Path(tempfile.mkdtemp(prefix="ds-keys-"))
    keys.chmod(0o755)
    (keys / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    (keys / "authorized_keys").chmod(0o644)
    run = Path(tempfile.mkdtemp(prefix="ds-run-"))  # short: the holder's socket path must fit
    srv = sh.start_sshd(tmp_path / "nosftp", keys / "authorized_keys", sftp=False)
    try:
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True)
        (home / ".ssh/config").write_text(
            f"Host nosftp\n  HostName 127.0.0.1\n  Port {srv.port}\n  User {sh.USER}\n  IdentityFile {key}\n"
        )
        (home / ".ssh/known_hosts").write_text(srv.known_hosts_line())
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
        monkeypatch.setenv("DETSLURM_REMOTE_PERSIST_S", persist)
        code, out, err = det("-m", "ssh://nosftp", "e", "create", CORE / "const.yaml", CORE)
        assert code == 1, out + err
        assert "its sshd offers no SFTP subsystem" in err and "Subsystem sftp internal-sftp" in err, err
        assert "Errno" not in err and "Traceback" not in err
        assert "subsystem request for sftp" in srv.log  # the server was asked, and refused
    finally:
        for sock in run.glob("detslurm/*.sock"):
            sock.unlink()  # a holder whose socket is gone exits within a second
        srv.stop()
        shutil.rmtree(keys, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)


def test_the_local_demo_installs_only_what_it_runs(tmp_path: Path) -> None:
    """`DEMO_LOCAL=1 scripts/demo` installs detslurm alone: not the development setup
    (scripts/bootstrap: torch, DeepSpeed and Horovod builds, Chromium). Run on a copy of the
    checkout's scripts whose venv and package tools record what they were asked to do."""
    import os
    import shutil

    from conftest import ROOT

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts/demo", repo / "scripts/demo")
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, repo / name)
    log = tmp_path / "calls.log"
    record = f'#!/bin/sh\necho "$(basename "$0") $*" >> {log}\n'
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (repo / ".venv/bin").mkdir(parents=True)
    stubs = {
        repo / "scripts/bootstrap": record + "exit 1\n",
        repo / "scripts/bootstrap-launchers": record + "exit 1\n",
        bin_dir / "apt-get": record + "exit 1\n",
        # The venv's python: pip calls are recorded; the demo's one-line JSON readers run for real.
        repo / ".venv/bin/python": record + f'[ "$1" = -c ] && exec {sys.executable} "$@"\nexit 0\n',
        repo / ".venv/bin/det": record + 'case "$*" in *--json*) echo \'[{"id": 1}]\';; esac\n',
    }
    for path, text in stubs.items():
        path.write_text(text)
        path.chmod(0o755)
    env = dict(os.environ, DEMO_LOCAL="1", PATH=f"{bin_dir}:{os.environ['PATH']}")
    p = subprocess.run(["bash", str(repo / "scripts/demo")], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    calls = log.read_text().splitlines()
    assert [c for c in calls if c.startswith(("bootstrap", "apt-get"))] == []
    (pip,) = [c for c in calls if " pip install" in c]
    assert pip.endswith(" -e . -c constraints.txt") and "[" not in pip, pip
    assert "det experiment create --local examples/core_api/adaptive.yaml examples/core_api" in calls
    # A second run finds the venv current and installs nothing.
    assert subprocess.run(["bash", str(repo / "scripts/demo")], env=env, capture_output=True).returncode == 0
    assert sum(" pip install" in c for c in log.read_text().splitlines()) == 1
