"""The holder process itself (see holder.py, its client side): log in once, then serve channels
over the unix socket until idle for persist_s or the SSH connection drops."""

from __future__ import annotations

import json
import os
import select
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detslurm.cli.remote.channel import relay
from detslurm.cli.remote.holder import EOF, ERR, EXIT, IN, OUT, REQ, recv_frame, send_frame
from detslurm.cli.remote.target import missing_extra, parse_url
from detslurm.errors import DetSlurmError
from detslurm.terminal import guarded


class Holder:
    def __init__(self, conn: Any, persist_s: float) -> None:
        self.conn = conn
        self.persist_s = persist_s
        self.active = 0
        self.last_use = time.monotonic()
        self.lock = threading.Lock()

    def idle(self) -> bool:
        with self.lock:
            return self.active == 0 and time.monotonic() - self.last_use > self.persist_s

    def serve_client(self, client: socket.socket) -> None:
        with self.lock:
            self.active += 1
        try:
            kind, data = recv_frame(client)
            req = json.loads(data) if kind == REQ else {}
            if req.get("op") == "exec":
                self._exec(client, str(req["command"]))
            elif req.get("op") == "sftp":
                self._sftp(client)
            elif req.get("op") == "tcp":
                self._tcp(client, int(req["port"]), str(req.get("host", "127.0.0.1")))
        except (EOFError, OSError, ValueError, KeyError, DetSlurmError):
            pass  # the command went away (Ctrl-C): its channel closes with it
        finally:
            client.close()
            with self.lock:
                self.active -= 1
                self.last_use = time.monotonic()

    def _exec(self, client: socket.socket, command: str) -> None:
        chan = self.conn.open_exec(command)
        with chan:
            stdin_open = True
            while True:
                # The client stays in the select after its stdin ends: its going away (Ctrl-C)
                # shows as EOF, and closing the channel then ends the remote command's output.
                ready, _, _ = select.select([chan, client], [], [], 1.0)
                if client in ready:
                    kind, data = recv_frame(client)
                    if kind == IN:
                        chan.sendall(data)
                    elif kind == EOF and stdin_open:
                        chan.shutdown_write()
                        stdin_open = False
                got = False
                while chan.recv_stderr_ready():
                    send_frame(client, ERR, chan.recv_stderr(65536))
                    got = True
                while chan.recv_ready():
                    send_frame(client, OUT, chan.recv(65536))
                    got = True
                if chan.exit_status_ready() and not got and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
            send_frame(client, EXIT, struct.pack("!i", chan.recv_exit_status()))

    def _tcp(self, client: socket.socket, port: int, host: str) -> None:
        # A port forward of `det -m ... dashboard`: bytes both ways, as for SFTP below. The
        # connection refuses any host but the login node's loopback (RemoteError, caught above).
        relay(client, self.conn.open_tcp(port, host))

    def _sftp(self, client: socket.socket) -> None:
        # One frame says whether the subsystem opened (an empty OUT) or why not (ERR); the
        # SFTP protocol's own bytes follow raw.
        try:
            chan = self.conn.open_sftp()
        except DetSlurmError as e:
            send_frame(client, ERR, str(e).encode())
            return
        send_frame(client, OUT, b"")
        relay(client, chan)  # closes both when either side ends


def _private_dir(d: Path) -> bool:
    """A directory of ours that no one else may enter: only we can reach a socket inside it."""
    try:
        st = d.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _peer_is_us(client: socket.socket, sock_dir: Path) -> bool:
    """Whether the connecting process is ours: its uid where the platform tells it (Linux's
    SO_PEERCRED), else (macOS has no SO_PEERCRED in Python's socket module) whether the socket's
    directory is still private to us, checked at each connection."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return _private_dir(sock_dir)
    creds = client.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return bool(uid == os.getuid())


def _listen(path: Path) -> socket.socket:
    path.unlink(missing_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is created 0600: only we may connect
    try:
        srv.bind(str(path))
    finally:
        os.umask(old)
    srv.listen(16)
    srv.settimeout(1.0)
    return srv


def _detach() -> None:
    """Let go of the user's terminal: the login is done, the holder lives on alone."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def main(argv: Sequence[str]) -> int:
    """argv: URL PERSIST_S SOCKET. Writes "ready" or "error MESSAGE" to stdout, then detaches."""
    url, persist_s, path = argv[0], float(argv[1]), Path(argv[2])
    try:
        # Imported here so that a broken SSH install (paramiko's own dependencies) is reported
        # as one line through the "error" protocol, not as a traceback on the user's terminal.
        try:
            from detslurm.cli.remote.connect import connect
        except ImportError as e:
            raise missing_extra(e) from None
        # The login's prompts (a site's two-factor text, sent by the server) reach the user's
        # terminal through the same cleaner as everything det prints.
        with guarded():
            conn = connect(parse_url(url))
        srv = _listen(path)
    except (DetSlurmError, OSError) as e:
        print(f"error {json.dumps(str(e))}", flush=True)  # JSON: one line, even for multi-line messages
        return 1
    except KeyboardInterrupt:
        print("error interrupted", flush=True)
        return 130
    print("ready", flush=True)
    _detach()
    holder = Holder(conn, persist_s)
    try:
        # Three ways to end: the SSH connection dropped (login node rebooted, network gone),
        # idle for persist_s, or the socket removed by the user (or replaced by a newer holder).
        while conn.transport.is_active() and not holder.idle() and path.exists():
            try:
                client, _ = srv.accept()
            except TimeoutError:
                continue
            # The socket's mode already keeps others out; the peer check also holds where a
            # platform ignores socket file permissions.
            if not _peer_is_us(client, path.parent):
                client.close()
                continue
            threading.Thread(target=holder.serve_client, args=(client,), daemon=True).start()
    finally:
        srv.close()
        path.unlink(missing_ok=True)
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
