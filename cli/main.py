"""`det`: the root group and the one error boundary.

Every error a user can cause becomes one clear message and a non-zero exit code; a traceback
is shown only with DETSLURM_DEBUG=1.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence

import click

from detslurm import __version__
from detslurm.cli.remote.target import split_master
from detslurm.errors import DetSlurmError
from detslurm.terminal import guarded

# name -> (module, group, short help). Subcommand modules import the store, Slurm and the
# controller; loading them only when their command runs keeps `det --help` (and every command
# that needs none of them) fast.
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "experiment": ("experiment", "experiment", "Create, inspect and control experiments."),
    "trial": ("trial", "trial", "Inspect and control trials."),
    "checkpoint": ("checkpoint", "checkpoint", "List, describe and download checkpoints."),
    "daemon": ("daemon", "daemon", "Start, stop and inspect the detslurm daemon (one per user)."),
    "job": ("job", "job", "The job queue: list it, reprioritize, reorder, hold, move between pools."),
    "dashboard": (
        "dashboard",
        "dashboard",
        "Serve the web dashboard on localhost; prints its URL (with its access token) once.",
    ),
    "tensorboard": ("tensorboard", "tensorboard", "Run TensorBoard on trials' metrics (localhost)."),
    "resource-pool": (
        "resource_pool",
        "resource_pool",
        "Resource pools (Slurm partitions, described in the site config).",
    ),
    "site": ("site", "site", "Site doctor and starter site config: what this Slurm offers detslurm."),
    "config": ("config", "config", "Show every setting's effective value and where it came from."),
}
_ALIASES = {"e": "experiment", "t": "trial", "c": "checkpoint", "rp": "resource-pool"}
# Not listed by `det --help`: the login node's side of the Python SDK over ssh:// (cli/sdk.py).
_HIDDEN = {"sdk-call": ("sdk", "sdk_call", "Answer one request of the Python SDK over ssh://.")}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*_COMMANDS, *_ALIASES])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = _COMMANDS.get(_ALIASES.get(cmd_name, cmd_name)) or _HIDDEN.get(cmd_name)
        if entry is None:
            return None
        module = importlib.import_module(f"detslurm.cli.{entry[0]}")
        cmd = getattr(module, entry[1])
        assert isinstance(cmd, click.Command)
        from detslurm.cli.examples import add_examples

        add_examples(cmd, _ALIASES.get(cmd_name, cmd_name))
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _COMMANDS[_ALIASES.get(name, name)][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="detslurm")
@click.option(
    "--all-users",
    is_flag=True,
    help="Root only: see and change every user's experiments in a shared store (they are never run here).",
)
# Taken off argv by main() before click sees it (detslurm.cli.remote.split_master); declared here
# only so that `det --help` shows it.
@click.option(
    "-m",
    "--master",
    metavar="ssh://[user@]login[:port]",
    expose_value=False,
    help="Run the command on a login node over SSH (also DET_MASTER=ssh://...).",
)
@click.pass_context
def cli(ctx: click.Context, all_users: bool) -> None:
    """detslurm: Determined-style experiments on Slurm, with no master server."""
    from detslurm.cli.app import App

    # main() hands its argv in as the context's first obj: root's audit log records it.
    argv = ctx.obj if isinstance(ctx.obj, list) else []
    app = App(all_users=all_users, argv=argv)
    if all_users and os.geteuid() == 0:
        # Before anything else runs: an --all-users command the log cannot record is refused.
        app.start_audit()
    ctx.obj = app


def local_command(path: Sequence[str]) -> click.Command:
    """The command `det PATH...` names here (``["e", "create"]``): remote mode reads the
    arguments of the commands it handles itself with their own declarations."""
    ctx = click.Context(cli, info_name="det")
    cmd: click.Command | None = cli
    for name in path:
        cmd = cmd.get_command(ctx, name) if isinstance(cmd, click.Group) else None
        if cmd is None:
            raise click.UsageError(f"no such command: det {' '.join(path)}")
    assert cmd is not None
    return cmd


def main(argv: Sequence[str] | None = None) -> int:
    # Everything printed to a terminal passes one cleaner (detslurm/terminal.py): much of it
    # is text trials, jobs and remote hosts wrote.
    with guarded():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        args = list(argv) if argv is not None else sys.argv[1:]
        master, args = split_master(args, os.environ)
        if master is not None:
            # Only remote mode loads the transport (SFTP uploads, port forwards, the holder).
            from detslurm.cli.remote.dispatch import run_remote

            return run_remote(master, args, local_command)
        # With standalone_mode=False click returns the code of a raised Exit instead of exiting.
        rv = cli.main(args=args, prog_name="det", standalone_mode=False, obj=list(args))
        return rv if isinstance(rv, int) else 0
    except click.exceptions.Exit as e:
        return int(e.exit_code)
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.Abort:
        click.echo("Aborted.", err=True)
        return 1
    except DetSlurmError as e:
        click.echo(f"Error: {e}", err=True)
        return e.exit_code
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        return 130
    except Exception as e:
        # Imported here, on the rare internal error: `det --help` never needs the settings.
        from detslurm.settings import DEBUG

        if DEBUG.get():
            traceback.print_exc()
        click.echo(f"Error: internal error ({type(e).__name__}: {e}); set DETSLURM_DEBUG=1 for details", err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
