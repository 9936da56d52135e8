"""Running `det ARGV` on the login node: argv goes to the remote det, quoted for its shell, and
its output, errors and exit code come back as if it ran here."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

import click

from detslurm.cli.remote.channel import collect, pump, stdin_fd
from detslurm.cli.remote.target import RemoteSettings, Target


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


def note(msg: str) -> None:
    """A line about the transport itself (uploads, forwards), on stderr beside the command's own."""
    click.echo(msg, err=True)
