"""The connection holder (OpenSSH's ControlMaster, small): one background process per login
node keeps an authenticated SSH connection for ``remote.persist_s`` seconds after its last use,
so that a site's two-factor prompt is answered once, not at every `det` command.

The first command starts it (`python -m detslurm.cli.remote.holder_server`); it inherits the
terminal only to ask for the login, then detaches. Later commands talk to it over a unix socket in a 0700
per-user directory, the socket itself 0600 and owned by the user; the holder also checks each
peer's uid (SO_PEERCRED; where the platform lacks it, that the socket's directory is still
private). Per request it opens one SSH channel: an exec (framed stdout, stderr
and exit code back, stdin forth) or the SFTP subsystem (one frame saying whether it
opened, then raw bytes both ways).
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from detslurm.cli.remote.target import RemoteError, RemoteSettings, Target, missing_extra, runtime_dir

# A frame is one type byte and a 4-byte big-endian length, then the payload. Exec needs framing
# to keep stdout, stderr and the exit code apart on one stream; SFTP is already a framed byte
# protocol, so its channel is relayed raw.
_HEAD = struct.Struct("!cI")
REQ, OUT, ERR, EXIT, IN, EOF = b"R", b"O", b"E", b"X", b"I", b"C"
# In the socket's name: a holder left running by a det that spoke an older protocol (version 1:
# no reply frame before SFTP's bytes) is never used by this one, which starts its own.
PROTOCOL = b"2"


def send_frame(sock: socket.socket, kind: bytes, data: bytes) -> None:
    sock.sendall(_HEAD.pack(kind, len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def recv_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    kind, n = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    return kind, _recv_exact(sock, n)


def socket_path(target: Target) -> Path:
    """One holder per URL and SSH config (a changed config must not reuse an old route)."""
    cfg = Path(os.path.expanduser("~/.ssh/config"))
    salt = cfg.read_bytes() if cfg.is_file() else b""
    digest = hashlib.sha256(PROTOCOL + target.url.encode() + b"\0" + salt).hexdigest()[:20]
    name = f"ssh-{digest}.sock"
    return runtime_dir(len(name)) / name


class RelayChannel:
    """The client end of one exec through the holder, with the subset of paramiko.Channel's
    interface that dispatch and transfer use."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.out = bytearray()
        self.err = bytearray()
        self.code: int | None = None

    def fileno(self) -> int:
        return self.sock.fileno()

    def _poll(self, block: bool) -> None:
        while self.code is None and (block or select.select([self.sock], [], [], 0)[0]):
            try:
                kind, data = recv_frame(self.sock)
            except (EOFError, OSError):
                self.code = -1
                return
            if kind == OUT:
                self.out += data
            elif kind == ERR:
                self.err += data
            elif kind == EXIT:
                self.code = struct.unpack("!i", data)[0]
            # A blocking read returns as soon as there is output to hand over, so that a
            # waiting caller (recv_exit_status) and streaming callers both make progress.
            if block and (self.out or self.err):
                return

    def recv_ready(self) -> bool:
        self._poll(False)
        return bool(self.out)

    def recv_stderr_ready(self) -> bool:
        self._poll(False)
        return bool(self.err)

    def recv(self, n: int) -> bytes:
        data, self.out[:] = bytes(self.out[:n]), self.out[n:]
        return data

    def recv_stderr(self, n: int) -> bytes:
        data, self.err[:] = bytes(self.err[:n]), self.err[n:]
        return data

    def exit_status_ready(self) -> bool:
        self._poll(False)
        return self.code is not None

    def recv_exit_status(self) -> int:
        while self.code is None:
            self._poll(True)
        return self.code

    def sendall(self, data: bytes) -> None:
        send_frame(self.sock, IN, data)

    def shutdown_write(self) -> None:
        send_frame(self.sock, EOF, b"")

    def close(self) -> None:
        self.sock.close()


class _SftpSocket(socket.socket):
    """paramiko's SFTP client names its logger after its channel; a plain socket has no name."""

    def get_name(self) -> str:
        return "detslurm-holder"


class HeldConnection:
    """A connection served by a running holder (same interface as connect.Connection)."""

    def __init__(self, path: Path, login: str) -> None:
        self.path = path
        self.login = login

    def _open(self, request: dict[str, str], cls: type[socket.socket] = socket.socket) -> socket.socket:
        s = cls(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(self.path))
            send_frame(s, REQ, json.dumps(request).encode())
        except OSError as e:
            s.close()
            raise RemoteError(f"the SSH connection holder at {self.path} went away: {e}") from None
        return s

    def open_exec(self, command: str) -> RelayChannel:
        return RelayChannel(self._open({"op": "exec", "command": command}))

    def open_tcp(self, port: int, host: str = "127.0.0.1") -> socket.socket:
        """A connection to the login node's loopback ``host``:``port``, relayed by the holder."""
        return self._open({"op": "tcp", "port": str(int(port)), "host": host})

    def sftp(self) -> Any:
        import paramiko

        sock = self._open({"op": "sftp"}, _SftpSocket)
        try:
            kind, data = recv_frame(sock)
        except (EOFError, OSError) as e:
            sock.close()
            raise RemoteError(f"the SSH connection holder at {self.path} went away: {e}") from None
        if kind == ERR:
            sock.close()
            raise RemoteError(data.decode(errors="replace"))
        return paramiko.SFTPClient(sock)

    def close(self) -> None:
        pass  # the holder stays for later commands


def _trusted(path: Path) -> bool:
    """Only a socket we own, that no one else can write to, is ours to send commands through."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _alive(path: Path) -> bool:
    if not _trusted(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def connection(target: Target, rs: RemoteSettings) -> Any:
    """A held connection when ``remote.persist_s`` > 0 (starting the holder, which logs in, if
    none is running), else a fresh direct one."""
    if rs.persist_s <= 0:
        # Imported here: paramiko is an extra, and a broken install fails at its import.
        try:
            from detslurm.cli.remote.connect import connect
        except ImportError as e:
            raise missing_extra(e) from None
        return connect(target)
    path = socket_path(target)
    # A stale socket (the holder idled out, crashed, or the laptop slept past persist_s) is
    # not alive: a new holder replaces it, asking for the login again.
    if not _alive(path):
        _start(target, rs, path)
    return HeldConnection(path, target.url)


def _start(target: Target, rs: RemoteSettings, path: Path) -> None:
    args = [sys.executable, "-m", "detslurm.cli.remote.holder_server", target.url, str(rs.persist_s), str(path)]
    # stdin and stderr are the user's terminal: the holder asks for the login there.
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    if line.startswith("ready"):
        return
    proc.wait()
    if line.startswith("error "):
        raise RemoteError(str(json.loads(line[len("error ") :])))
    raise RemoteError(f"the SSH connection holder for {target.url} exited without logging in")
