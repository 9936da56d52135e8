"""`det daemon`: the per-user background controller for Slurm experiments."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path

import click

from detslurm import daemon as daemon_mod
from detslurm.cli import logs as logs_mod
from detslurm.cli.app import App, pass_app
from detslurm.cli.render import dump_json, table
from detslurm.util import printable


@click.group(name="daemon")
def daemon() -> None:
    """Start, stop and inspect the detslurm daemon (one per user)."""


@daemon.command("start")
@click.option("--foreground", is_flag=True, help="Run in this process (for systemd --user or a Slurm job).")
@pass_app
def start(app: App, foreground: bool) -> None:
    """Start the daemon (a no-op when it runs already)."""
    if foreground:
        # A supervised daemon (systemd --user, a Slurm job) must not exit when idle: the supervisor
        # would restart it or the job would end. The spawned daemon does exit, to free the login node.
        raise click.exceptions.Exit(daemon_mod.run_forever(app.settings, idle_exit_s=float("inf")))
    # start() returns once the daemon holds its lock and wrote its pid, so the pid printed is live.
    pid = daemon_mod.start(app.settings)
    click.echo(f"detslurm daemon running (pid {pid}); log: {daemon_mod.Paths(app.settings).log}")


@daemon.command("stop")
@pass_app
def stop(app: App) -> None:
    """Stop the daemon. Trials keep running; the next start picks them up."""
    pid = daemon_mod.stop(app.settings)
    if pid is None:
        # Only a daemon proved ours (this host, this uid, same process) is ever signalled.
        click.echo(f"detslurm daemon was {daemon_mod.daemon_status(app.settings).detail}")
        return
    click.echo(f"stopped detslurm daemon (pid {pid})")


@daemon.command("status")
@click.option("--json", "as_json", is_flag=True, help="One JSON document instead of text.")
@pass_app
def status(app: App, as_json: bool) -> None:
    """Say whether the daemon runs (here: a daemon on another login node is not "running"), its
    polling interval and last tick. With root's `det --all-users`: every user's daemon here."""
    if app.all_users:
        _every_users(app, as_json)
        return
    st = daemon_mod.daemon_status(app.settings)
    if as_json:
        dump_json({"pid": st.pid, "detail": st.detail, "tick": dataclasses.asdict(st.tick) if st.tick else None})
    else:
        click.echo(f"detslurm daemon: {st.detail}")
    if st.pid is None:
        raise click.exceptions.Exit(1)


def _every_users(app: App, as_json: bool) -> None:
    from detslurm.daemon_scan import every_daemon
    from detslurm.identity import Scope

    Scope.all_users()  # only root may look at every user's daemons: anyone else is refused here
    found = every_daemon()
    if as_json:
        dump_json(
            [
                {
                    "user": d.user,
                    "uid": d.uid,
                    "pid": d.pid,
                    "data_dir": str(d.data_dir),
                    "started": d.started,
                    "tick": dataclasses.asdict(d.tick) if d.tick else None,
                }
                for d in found
            ]
        )
        return
    if not found:
        click.echo(f"no detslurm daemon runs on {socket.gethostname()}")
        return
    now = time.time()
    table(
        ["User", "PID", "Running for", "Experiments", "Polling and last tick", "Data dir"],
        [
            [
                d.user,
                d.pid,
                f"{(now - d.started) / 60:.0f} min",
                d.tick.experiments if d.tick else "",
                d.tick.describe(now) if d.tick else "no status yet",
                _shown(d.data_dir),
            ]
            for d in found
        ],
    )


def _shown(path: Path) -> str:
    """A directory another user named, as one line on root's terminal: no escape sequences, no
    line of its own, and bytes that are not UTF-8 replaced (printing them would fail)."""
    return printable(os.fsencode(path).decode("utf-8", "replace")).replace("\n", " ")


@daemon.command("logs")
@click.option("--tail", type=int, default=50, show_default=True)
@pass_app
def logs(app: App, tail: int) -> None:
    """Show the end of the daemon's log."""
    path = daemon_mod.Paths(app.settings).log
    if not path.exists():
        click.echo(f"no daemon log yet at {path}")
        return
    for line in logs_mod.file_tail(path, tail):
        click.echo(line)
