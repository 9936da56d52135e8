"""`det -m ssh://login dashboard` (and `tensorboard start`): the server runs on the login node,
bound to its 127.0.0.1; this side listens on the laptop's 127.0.0.1 and carries each browser
connection through the SSH connection (a direct-tcpip channel, as `ssh -L` does). The URL the
login node printed is printed again with the laptop's port."""

from __future__ import annotations

import re
import select
import socket
import threading
from collections.abc import Sequence
from typing import Any

import click

from detslurm.cli.remote.channel import drain, relay
from detslurm.cli.remote.command import remote_command
from detslurm.cli.remote.target import RemoteSettings, Target
from detslurm.dashboard.serve import URL_PREFIX, bind, url_of

# What `det dashboard` / `det tensorboard start` print (detslurm.dashboard.serve.URL_PREFIX).
_URL = re.compile(r"^Open http://(127\.0\.0\.1|\[::1\]):(\d+)(/\S*)?\s*$")
# Where a forwarded connection may go on the login node: its loopback only, never elsewhere.
LOOPBACK = ("127.0.0.1", "::1")


def wants_forward(args: Sequence[str]) -> bool:
    """Whether ``args`` start a local web server that the laptop must reach."""
    if "-h" in args or "--help" in args:
        return False
    return bool(args) and (args[0] == "dashboard" or list(args[:2]) == ["tensorboard", "start"])


def _accept_loop(listener: socket.socket, conn: Any, host: str, port: int) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return  # the listener was closed: the command is over
        try:
            remote = conn.open_tcp(port, host)
        except Exception as e:  # a refused channel costs this connection only
            click.echo(f"port forward to the login node's {port} failed: {e}", err=True)
            client.close()
            continue
        # One thread per browser connection: a page opens a handful (assets, fetches, log polls).
        threading.Thread(target=relay, args=(client, remote), daemon=True).start()


def _read_url(chan: Any) -> tuple[str, int, str] | int:
    """Echo the remote output up to the URL line: (remote host, port, path), or the exit code if the
    command ended first (its error already shown)."""
    buf = b""
    # Lines before the URL (a banner, a warning, an error) are the user's to see, in order.
    while True:
        if chan.recv_stderr_ready():
            click.echo(chan.recv_stderr(65536), nl=False, err=True)
            continue
        if chan.recv_ready():
            buf += chan.recv(65536)
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                m = _URL.match(line.decode(errors="replace"))
                if m:
                    return m.group(1).strip("[]"), int(m.group(2)), m.group(3) or "/"
                click.echo(line.decode(errors="replace"))
            continue
        if chan.exit_status_ready():
            if buf:
                click.echo(buf.decode(errors="replace"))
            return int(chan.recv_exit_status())
        select.select([chan], [], [], 0.2)


def run_forwarded(conn: Any, target: Target, rs: RemoteSettings, args: list[str]) -> int:
    """Run the server command remotely with a local port forwarded to it; returns its exit code."""
    # --exit-on-eof: when this side goes (Ctrl-C, a dropped connection), the server's stdin
    # closes and it stops, instead of running on, orphaned, on the login node.
    chan = conn.open_exec(remote_command(target, rs, [*args, "--exit-on-eof"]))
    try:
        got = _read_url(chan)
        if isinstance(got, int):
            return got
        host, port, path = got
        # Any free laptop port: the login node's port may be taken here, and the URL says which.
        listener = bind("127.0.0.1", 0)
        threading.Thread(target=_accept_loop, args=(listener, conn, host, port), daemon=True).start()
        click.echo(f"{URL_PREFIX}{url_of(listener, path)}")
        click.echo(f"(forwarded over SSH to {target.url}, port {port} there)", err=True)
        try:
            return _wait(chan)
        except KeyboardInterrupt:
            return 0
        finally:
            listener.close()
    finally:
        chan.close()


def _wait(chan: Any) -> int:
    """Show the server's output until it exits. Its stdin is left open (not shut down as
    channel.pump does without a stdin): the end of it is what stops the server."""
    while True:
        select.select([chan], [], [], 1.0)
        drained = drain(chan)
        if chan.exit_status_ready() and not drained and not chan.recv_ready() and not chan.recv_stderr_ready():
            return int(chan.recv_exit_status())
