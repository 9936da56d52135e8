"""Run one `det` command on the login node (command.py). Only the commands that need this
machine's files or ports are handled here first: `e create` uploads the config and context,
`checkpoint download` copies files back (transfer.py), `dashboard` and `tensorboard start`
forward a port (forward.py)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import click

from detslurm.cli.remote import forward, holder, transfer
from detslurm.cli.remote.command import run_argv
from detslurm.cli.remote.target import (
    RemoteError,
    RemoteSettings,
    Target,
    load_remote_settings,
    parse_url,
    require_ssh,
)

_EXPERIMENT = {"e", "experiment"}
_CHECKPOINT = {"c", "checkpoint"}

# The click command `det PATH...` runs locally (given by cli.main, which owns the command tree):
# a transfer reads its arguments with the command's own declaration. Passed in rather than
# imported, so that the transport never imports the commands that import it.
Commands = Callable[[Sequence[str]], click.Command]


def run_remote(url: str, argv: Sequence[str], commands: Commands) -> int:
    """cli.main's entry for remote mode: connect (through the holder when enabled), then run."""
    target = parse_url(url)
    rs = load_remote_settings(os.environ)
    require_ssh()
    with _clear_errors(target):
        conn = holder.connection(target, rs)
        try:
            return _dispatch(conn, target, rs, list(argv), commands)
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


def _dispatch(conn: Any, target: Target, rs: RemoteSettings, args: list[str], commands: Commands) -> int:
    if len(args) >= 2 and args[0] in _EXPERIMENT and args[1] == "create" and not _wants_help(args):
        return transfer.create(conn, target, rs, args, commands(args[:2]))
    if len(args) >= 2 and args[0] in _CHECKPOINT and args[1] == "download" and not _wants_help(args):
        return transfer.download_checkpoint(conn, target, rs, args, commands(args[:2]))
    if forward.wants_forward(args):
        return forward.run_forwarded(conn, target, rs, args)
    return run_argv(conn, target, rs, args)


def _wants_help(args: Sequence[str]) -> bool:
    return "-h" in args or "--help" in args
