"""Bytes of a running remote command or connection: streamed to this terminal, collected, or
relayed between two sockets. Works on any object with paramiko.Channel's read interface (a
direct channel, or the holder's relay), so nothing here imports paramiko."""

from __future__ import annotations

import os
import select
import sys
from typing import Any

import click


def pump(chan: Any, stdin_fd: int | None) -> int:
    """Stream a running command's stdout/stderr to ours (and our stdin to it) until it exits;
    returns its exit code (255 when it ended without one, as ssh does)."""
    stdin_open = stdin_fd is not None
    if not stdin_open:
        chan.shutdown_write()
    while True:
        waits: list[Any] = [chan] + ([stdin_fd] if stdin_open else [])
        ready, _, _ = select.select(waits, [], [], 1.0)
        if stdin_open and stdin_fd in ready:
            data = os.read(stdin_fd, 65536)  # type: ignore[arg-type]
            if data:
                chan.sendall(data)
            else:
                chan.shutdown_write()
                stdin_open = False
        drained = drain(chan)
        # The exit status can arrive before the last output does: stop only once both are in.
        if chan.exit_status_ready() and not drained and not chan.recv_ready() and not chan.recv_stderr_ready():
            break
    code = int(chan.recv_exit_status())
    return 255 if code < 0 else code


def drain(chan: Any) -> bool:
    """Show what the command has written so far; whether there was anything."""
    got = False
    while chan.recv_stderr_ready():
        click.echo(chan.recv_stderr(65536), nl=False, err=True)
        got = True
    while chan.recv_ready():
        data = chan.recv(65536)
        if not data:
            break
        click.echo(data, nl=False)
        got = True
    return got


def stdin_fd() -> int | None:
    """Our stdin's fd when it is a real file a remote prompt (e delete's confirmation) can read."""
    try:
        return sys.stdin.fileno() if sys.stdin is not None else None
    except (OSError, ValueError, AttributeError):
        return None


def collect(chan: Any) -> tuple[int, str, str]:
    """Wait for a remote command (its stdin already closed); (exit code, stdout, stderr)."""
    out, err = bytearray(), bytearray()
    try:
        while not (chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready()):
            if chan.recv_ready():
                out += chan.recv(65536)
            elif chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            else:
                select.select([chan], [], [], 0.05)
        code = chan.recv_exit_status()
    finally:
        chan.close()
    return code, out.decode(errors="replace"), err.decode(errors="replace")


def relay(a: Any, b: Any) -> None:
    """Copy bytes both ways between two socket-like objects until either side closes."""
    try:
        while True:
            ready, _, _ = select.select([a, b], [], [], 30.0)
            for src in ready:
                data = src.recv(65536)
                if not data:
                    return
                (b if src is a else a).sendall(data)
    except OSError:
        pass  # a browser tab closed mid-transfer: that connection ends, the others go on
    finally:
        a.close()
        b.close()
