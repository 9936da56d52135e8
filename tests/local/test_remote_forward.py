"""`det -m ssh://login dashboard` (and `tensorboard start`) forward a laptop port through the SSH
connection to the server the login node started on its 127.0.0.1, against a real sshd
(tests/sshd_harness.py), over a direct connection and through the connection holder.

The login node's `det` here is a stand-in script (the harness's full remote venv is not needed
to test the tunnel): it serves a page on a free 127.0.0.1 port with Python's http.server, prints
the "Open http://127.0.0.1:PORT/..." line `det dashboard` prints, and runs until its stdin
closes, which is how the real server learns that the laptop went away (--exit-on-eof)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sshd_harness as sh
from conftest import ROOT, write

pytest.importorskip("paramiko")

FAKE_DET = """#!/bin/bash
echo "$*" > "$HOME/{tag}.args"
dir=$(mktemp -d); echo "hello through the tunnel" > "$dir/index.html"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server --bind 127.0.0.1 --directory "$dir" "$port" >/dev/null 2>&1 &
srv=$!
for i in $(seq 50); do python3 -c "import socket; socket.create_connection(('127.0.0.1', $port))" 2>/dev/null && break; sleep 0.1; done
echo "a banner line"
echo "Open http://127.0.0.1:$port/index.html"
cat >/dev/null
kill $srv
touch "$HOME/{tag}.stopped"
"""


@pytest.fixture(scope="module")
def login(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if os.geteuid() != 0:
        pytest.skip("the remote-mode tests start sshd as root")
    try:
        sh.ensure_openssh()
        user = sh.ensure_user()
    except sh.Unavailable as e:
        pytest.skip(str(e))
    base = tmp_path_factory.mktemp("ssh-forward")
    key = sh.keygen(base / "laptop_key")
    ssh_dir = Path(user.pw_dir) / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    keys = ssh_dir / "authorized_keys_forward"
    keys.write_text(Path(f"{key}.pub").read_text())
    for p in (ssh_dir, keys):
        os.chown(p, user.pw_uid, user.pw_gid)
    server = sh.start_sshd(base / "login", keys)
    yield {"server": server, "key": key, "user": user}
    server.stop()


def _laptop(login: dict[str, Any], home: Path, persist_s: int) -> tuple[dict[str, str], str, Path]:
    """A laptop HOME for ssh://direct and a stand-in det on the login node; (env, tag, its home)."""
    server, user = login["server"], login["user"]
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(login["key"], home / ".ssh/key")
    write(
        home / ".ssh/config",
        f"Host direct\n  HostName 127.0.0.1\n  Port {server.port}\n  User {sh.USER}\n  IdentityFile ~/.ssh/key\n",
    )
    write(home / ".ssh/known_hosts", server.known_hosts_line())
    tag = f"fake-det-{uuid.uuid4().hex[:8]}"
    remote_home = Path(user.pw_dir)
    script = remote_home / tag
    script.write_text(FAKE_DET.format(tag=tag))
    script.chmod(0o755)
    os.chown(script, user.pw_uid, user.pw_gid)
    config = write(home / "detslurm.json", json.dumps({"remote": {"det": str(script), "persist_s": persist_s}}))
    # Short, like /run/user/UID (a long pytest basetemp would not fit sun_path); removed by the test.
    run = Path(tempfile.mkdtemp(prefix="ds-run-"))
    env = dict(os.environ, HOME=str(home), DETSLURM_CONFIG=str(config), XDG_RUNTIME_DIR=str(run))
    env.pop("SSH_AUTH_SOCK", None)
    env.pop("DET_MASTER", None)
    return env, tag, remote_home


@pytest.mark.parametrize("persist_s", [0, 60], ids=["direct", "held"])
def test_dashboard_port_is_forwarded_to_the_laptop(login: dict[str, Any], tmp_path: Path, persist_s: int) -> None:
    env, tag, remote_home = _laptop(login, tmp_path / "laptop", persist_s)
    errors = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "detslurm.cli.main", "-m", "ssh://direct", "dashboard", "--allow-actions"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        stderr=errors,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        # The login node's output comes through (on failure, say what det said).
        assert first == "a banner line\n", (tmp_path / "stderr").read_text()
        url = proc.stdout.readline().split()
        assert url[0] == "Open" and url[1].startswith("http://127.0.0.1:") and url[1].endswith("/index.html")
        # A laptop port, not the login node's: the page comes through the SSH connection.
        for _ in range(3):  # several connections, each its own channel
            with urllib.request.urlopen(url[1], timeout=300) as r:
                assert r.read() == b"hello through the tunnel\n"
        assert (remote_home / f"{tag}.args").read_text().split() == ["dashboard", "--allow-actions", "--exit-on-eof"]
    finally:
        proc.terminate()
        proc.wait(30)
        errors.close()
        run = Path(env["XDG_RUNTIME_DIR"])
        for sock in (run / "detslurm").glob("*.sock"):
            sock.unlink()  # the holder (persist_s > 0) exits once its socket is gone
        shutil.rmtree(run, ignore_errors=True)
    # The laptop went away: the server's stdin closed and it stopped (not orphaned on the login node).
    deadline = time.monotonic() + 20
    while not (remote_home / f"{tag}.stopped").exists():
        assert time.monotonic() < deadline, "the login node's server kept running after the laptop left"
        time.sleep(0.2)


def test_forward_only_for_server_commands() -> None:
    from detslurm.cli.remote.forward import wants_forward

    assert wants_forward(["dashboard"]) and wants_forward(["tensorboard", "start", "1"])
    assert not wants_forward(["dashboard", "--help"]) and not wants_forward(["e", "list"])
    assert not wants_forward(["tensorboard"])


def test_forwards_go_to_the_login_nodes_loopback_only() -> None:
    from detslurm.cli.remote.connect import Connection
    from detslurm.cli.remote.target import RemoteError

    # No transport is touched: the destination is refused before any channel is asked for.
    conn = Connection([], "user@login")
    for host in ("10.0.0.5", "example.org", "0.0.0.0"):
        with pytest.raises(RemoteError, match="loopback only"):
            conn.open_tcp(8080, host)
