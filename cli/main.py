"""`det`: the root group and the one error boundary.

Every error a user can cause becomes one clear message and a non-zero exit code; a traceback
is shown only with DETSLURM_DEBUG=1.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Sequence

import click

from detslurm import __version__
from detslurm.cli.app import App
from detslurm.errors import DetSlurmError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="detslurm")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """detslurm: Determined-style experiments on Slurm, with no master server."""
    ctx.obj = App()


def _register() -> None:
    from detslurm.cli import checkpoint, daemon, experiment, job, resource_pool, trial

    cli.add_command(experiment.experiment)
    cli.add_command(experiment.experiment, name="e")
    cli.add_command(trial.trial)
    cli.add_command(trial.trial, name="t")
    cli.add_command(checkpoint.checkpoint)
    cli.add_command(checkpoint.checkpoint, name="c")
    cli.add_command(daemon.daemon)
    cli.add_command(job.job)
    cli.add_command(resource_pool.resource_pool)
    cli.add_command(resource_pool.resource_pool, name="rp")


_register()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        # With standalone_mode=False click returns the code of a raised Exit instead of exiting.
        rv = cli.main(args=list(argv) if argv is not None else None, prog_name="det", standalone_mode=False)
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
        if os.environ.get("DETSLURM_DEBUG"):
            traceback.print_exc()
        click.echo(f"Error: internal error ({type(e).__name__}: {e}); set DETSLURM_DEBUG=1 for details", err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
