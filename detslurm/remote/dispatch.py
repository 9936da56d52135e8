"""Run one `det` command on the login node: argv goes to the remote det, quoted for its shell,
and its output, errors and exit code come back as if it ran here. Only the commands that need
this machine's files are handled here first: `e create` uploads the config and context,
`checkpoint download` copies files back."""

from __future__ import annotations

import contextlib
import os
import select
import shlex
from collections.abc import Iterator, Sequence
from typing import Any

import click

from detslurm.remote.target import RemoteError, RemoteSettings, Target, load_remote_settings, parse_url

_EXPERIMENT = {"e", "experiment"}
_CHECKPOINT = {"c", "checkpoint"}


def remote_command(target: Target, rs: RemoteSettings, argv: Sequence[str]) -> str:
    """The exec request: a bash login shell (so the site's profile and `module` work), the
    configured setup lines, then the remote det with every argument shell-quoted."""
    det = target.det_path or rs.det
    args = " ".join(shlex.quote(a) for a in argv)
    # ~/ in a configured path means the remote home; quoting would keep the tilde literal.
    det_word = f'"$HOME"/{shlex.quote(det[2:])}' if det.startswith("~/") else shlex.quote(det)
    lines = [
        # The remote side is local mode: a DET_MASTER its profile sets must not bounce us on.
        "unset DET_MASTER",
        *rs.setup,
        f"det={det_word}",
        # A venv directory means its bin/det (ssh://host/opt/venvs/det works as well as .../bin/det).
        'if [ -d "$det" ]; then det="$det/bin/det"; fi',
        'command -v "$det" >/dev/null 2>&1 || { echo "Error: detslurm is not installed on the login node: '
        '$det not found (set remote.det or remote.setup in your detslurm config, or ssh://host/path/to/det)" >&2;'
        " exit 127; }",
        f'exec "$det" {args}',
    ]
    return "bash -lc " + shlex.quote("\n".join(lines))


def run_argv(conn: Any, target: Target, rs: RemoteSettings, argv: Sequence[str], stdin: bool = True) -> int:
    """Run `det ARGV` remotely, streaming; returns the remote exit code."""
    from detslurm.remote.connect import pump, stdin_fd

    chan = conn.open_exec(remote_command(target, rs, argv))
    try:
        return pump(chan, stdin_fd() if stdin else None)
    finally:
        chan.close()


def capture_argv(conn: Any, target: Target, rs: RemoteSettings, argv: Sequence[str]) -> tuple[int, str, str]:
    """Run `det ARGV` remotely and collect its output (for the JSON the transfers need)."""
    chan = conn.open_exec(remote_command(target, rs, argv))
    chan.shutdown_write()
    return collect(chan)


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


def run_remote(url: str, argv: Sequence[str]) -> int:
    """cli.main's entry for remote mode: connect (through the holder when enabled), then run."""
    from detslurm.remote import holder

    target = parse_url(url)
    rs = load_remote_settings(os.environ)
    with _clear_errors(target):
        conn = holder.connection(target, rs)
        try:
            return _dispatch(conn, target, rs, list(argv))
        finally:
            conn.close()


@contextlib.contextmanager
def _clear_errors(target: Target) -> Iterator[None]:
    """A dropped connection, an SSH protocol error or a failed local write mid-command becomes
    one clear line through cli.main's error boundary, not an "internal error"."""
    try:
        yield
    except (OSError, EOFError) as e:
        raise RemoteError(f"remote mode ({target.url}): {e}") from None
    except Exception as e:
        if not type(e).__module__.startswith("paramiko"):
            raise
        raise RemoteError(f"remote mode ({target.url}): SSH error: {e}") from None


def _dispatch(conn: Any, target: Target, rs: RemoteSettings, args: list[str]) -> int:
    from detslurm.remote import forward, transfer

    if len(args) >= 2 and args[0] in _EXPERIMENT and args[1] == "create" and not _wants_help(args):
        return transfer.create(conn, target, rs, args)
    if len(args) >= 2 and args[0] in _CHECKPOINT and args[1] == "download" and not _wants_help(args):
        return transfer.download_checkpoint(conn, target, rs, args)
    if forward.wants_forward(args):
        return forward.run_forwarded(conn, target, rs, args)
    return run_argv(conn, target, rs, args)


def _wants_help(args: Sequence[str]) -> bool:
    return "-h" in args or "--help" in args


def note(msg: str) -> None:
    click.echo(msg, err=True)
