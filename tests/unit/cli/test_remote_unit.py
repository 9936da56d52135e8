"""Remote mode without a server: the ssh:// URL, -m/DET_MASTER handling, the remote shell
command (run for real by a local bash with hostile arguments), the `remote:` settings."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from detslurm.cli.remote.command import remote_command
from detslurm.cli.remote.target import RemoteError, RemoteSettings, Target, parse_url, remote_settings, split_master
from detslurm.errors import ConfigError


@pytest.mark.parametrize(
    "url, want",
    [
        ("ssh://login", Target("login")),
        ("ssh://alice@login.hpc.example.org:2222", Target("login.hpc.example.org", "alice", 2222)),
        ("ssh://hpc/opt/venvs/det", Target("hpc", det_path="/opt/venvs/det")),
        ("ssh://bob@[::1]:22/home/bob/venv/bin/det", Target("::1", "bob", 22, "/home/bob/venv/bin/det")),
    ],
)
def test_parse_url(url: str, want: Target) -> None:
    assert parse_url(url) == want


@pytest.mark.parametrize(
    "url, needle",
    [
        ("http://master:8080", "detslurm has no master server"),
        ("ssh://", "is not a host name"),
        ("ssh://login:99999", "port '99999' is not a number from 1 to 65535"),
        ("ssh://login:x", "port 'x'"),
        ("ssh://a;b", "is not a host name"),
        ("ssh://@login", "is not a user name"),
    ],
)
def test_bad_urls_are_clear_errors(url: str, needle: str) -> None:
    with pytest.raises(RemoteError, match=None) as e:
        parse_url(url)
    assert needle in str(e.value)


def test_split_master() -> None:
    assert split_master(["-m", "ssh://h", "e", "list"], {}) == ("ssh://h", ["e", "list"])
    assert split_master(["--master=ssh://h", "e", "list"], {}) == ("ssh://h", ["e", "list"])
    assert split_master(["--master", "ssh://h", "e"], {"DET_MASTER": "ssh://other"}) == ("ssh://h", ["e"])
    assert split_master(["e", "list"], {"DET_MASTER": "ssh://other"}) == ("ssh://other", ["e", "list"])
    # A Determined user's http DET_MASTER means nothing to detslurm: local mode.
    assert split_master(["e", "list"], {"DET_MASTER": "http://master:8080"}) == (None, ["e", "list"])
    # -m after the subcommand belongs to the subcommand.
    assert split_master(["e", "create", "-m", "x"], {}) == (None, ["e", "create", "-m", "x"])
    with pytest.raises(RemoteError, match="needs a value"):
        split_master(["-m"], {})


def test_explicit_http_master_is_refused(det: Any) -> None:
    code, out, err = det("-m", "http://master:8080", "e", "list")
    assert code == 1 and out == "" and "detslurm has no master server" in err


HOSTILE = [
    "plain",
    "two words",
    "it's",
    '"dq"',
    "$(touch PWNED)",
    "`touch PWNED`",
    "a;touch PWNED",
    "*",
    "\nnl",
    "-x",
    "",
]


def test_remote_command_quotes_every_argument(tmp_path: Path) -> None:
    """What the login node's shell runs: each argument arrives as itself, nothing is executed."""
    fake = tmp_path / "venv/bin/det"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "[%s]\\n" "$a"; done\n')
    fake.chmod(0o755)
    rs = RemoteSettings(setup=("export GREETING='hi there'",))
    # A venv directory means its bin/det.
    cmd = remote_command(Target("h", det_path=str(tmp_path / "venv")), rs, HOSTILE)
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "".join(f"[{a}]\n" for a in HOSTILE)
    assert not (tmp_path / "PWNED").exists()


def test_missing_remote_det_is_a_clear_error(tmp_path: Path) -> None:
    cmd = remote_command(Target("h"), RemoteSettings(det=str(tmp_path / "nope")), ["e", "list"])
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
    assert r.returncode == 127 and "detslurm is not installed on the login node" in r.stderr
    assert "remote.det" in r.stderr


def test_remote_settings_validation() -> None:
    rs = remote_settings({"det": "/opt/det", "setup": ["module load detslurm"], "persist_s": 60}, {}, "cfg.yaml")
    assert rs == RemoteSettings(det="/opt/det", setup=("module load detslurm",), persist_s=60.0)
    env = {"DETSLURM_REMOTE_DET": "/x/det", "DETSLURM_REMOTE_PERSIST_S": "0"}
    assert remote_settings(None, env, "c") == RemoteSettings(det="/x/det", persist_s=0.0)
    with pytest.raises(ConfigError) as e:
        remote_settings({"det": 3, "setup": "ok", "persist_s": "soon", "dett": 1}, {}, "cfg.yaml")
    assert "unknown key 'dett'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        remote_settings({"det": 3, "setup": [1], "persist_s": "soon"}, {}, "cfg.yaml")
    msg = str(e.value)
    assert "remote.det must be a path" in msg and "remote.setup must be a list" in msg and "persist_s" in msg


def test_remote_det_under_the_remote_home(tmp_path: Path) -> None:
    fake = tmp_path / "my venv/bin/det"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\necho found "$@"\n')
    fake.chmod(0o755)
    cmd = remote_command(Target("h"), RemoteSettings(det="~/my venv"), ["e", "list"])
    r = subprocess.run(
        ["sh", "-c", cmd], capture_output=True, text=True, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    )
    assert r.stdout == "found e list\n", r.stderr


def test_ssh_config_aliases_and_proxyjump_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("paramiko")
    from detslurm.cli.remote import sshconf

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    cfg = tmp_path / "ssh_config"
    cfg.write_text(
        "Host hpc\n  HostName login01.hpc.example.org\n  User alice\n  Port 2201\n  IdentityFile ~/.ssh/hpc_key\n"
        "  ProxyJump carol@gw1:2222,gw2\n  UserKnownHostsFile ~/.ssh/hpc_known\n\n"
        "Host gw2\n  HostName gateway2.example.org\n  User bob\n  IdentitiesOnly yes\n  HostKeyAlias gw-alias\n"
    )
    monkeypatch.setenv("DETSLURM_SSH_CONFIG", str(cfg))
    gw1, gw2, login = sshconf.resolve_chain(Target("hpc"))
    assert (gw1.hostname, gw1.user, gw1.port) == ("gw1", "carol", 2222)
    assert (gw2.hostname, gw2.user, gw2.port, gw2.identities_only) == ("gateway2.example.org", "bob", 22, True)
    assert gw2.key_name == "gw-alias"
    assert (login.hostname, login.user, login.port) == ("login01.hpc.example.org", "alice", 2201)
    assert login.identity_files == (home / ".ssh/hpc_key",)
    assert login.known_hosts[0] == home / ".ssh/hpc_known" and login.key_name == "[login01.hpc.example.org]:2201"
    # The URL's user and port win over the config's, as with ssh's own command line.
    (_, _, login) = sshconf.resolve_chain(Target("hpc", user="dave", port=22))
    assert (login.user, login.port, login.key_name) == ("dave", 22, "login01.hpc.example.org")


def test_socket_path_fits_sun_path_under_a_long_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI's pytest temp dirs made $XDG_RUNTIME_DIR/detslurm/ssh-<digest>.sock longer than
    sockaddr_un holds, and the holder died with "AF_UNIX path too long"."""
    import os
    import socket

    from detslurm.cli.remote.holder import socket_path
    from detslurm.cli.remote.target import SUN_PATH_MAX

    long_run = tmp_path / ("r" * (SUN_PATH_MAX - len(str(tmp_path)) - 12))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(long_run))
    path = socket_path(Target("login"))
    assert len(os.fsencode(path)) <= SUN_PATH_MAX
    assert path.parent == Path(f"/tmp/detslurm-{os.getuid()}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # the holder's bind, for real
    path.unlink()
    # A short runtime dir (like /run/user/UID) is still used as it is.
    import shutil
    import tempfile

    short = Path(tempfile.mkdtemp(prefix="ds-run-"))
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(short))
        assert socket_path(Target("login")).parent == short / "detslurm"
    finally:
        shutil.rmtree(short)


def test_socket_dir_refuses_a_planted_link_or_open_dir(tmp_path: Path) -> None:
    from detslurm.cli.remote.target import _private_dir

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(mine)
    with pytest.raises(RemoteError, match="mode 0700"):
        _private_dir(tmp_path / "link")
    (tmp_path / "open").mkdir(mode=0o777)
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(RemoteError, match="mode 0700"):
        _private_dir(tmp_path / "open")
    assert _private_dir(mine) == mine


def test_a_slow_server_banner_is_waited_for(tmp_path: Path) -> None:
    """A login node that takes 17 s to answer (sshd forking on a busy machine) still gets its
    handshake: paramiko alone gives up on the banner after 15 s. This server then hangs up, so
    the error must come from after the banner, not from waiting for it."""
    import socket
    import threading
    import time

    from detslurm.cli.remote.connect import open_hop
    from detslurm.cli.remote.sshconf import Hop

    server = socket.create_server(("127.0.0.1", 0))

    def slow() -> None:
        conn, _ = server.accept()
        time.sleep(17)
        conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
        conn.close()

    threading.Thread(target=slow, daemon=True).start()
    hop = Hop("slow", "127.0.0.1", server.getsockname()[1], "u", (), False, (tmp_path / "kh",), None, None)
    started = time.monotonic()
    with pytest.raises(RemoteError) as e:
        open_hop(socket.create_connection(server.getsockname()), hop, lambda _t, _e: "")
    server.close()
    assert time.monotonic() - started >= 17
    assert "banner" not in str(e.value) and "SSH handshake with slow" in str(e.value)
