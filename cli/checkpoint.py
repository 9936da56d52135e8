"""`det checkpoint` (alias `det c`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from detslurm import client, views
from detslurm.cli.app import App, pass_app
from detslurm.cli.render import dump_json, fmt_time, table


@click.group(name="checkpoint")
def checkpoint() -> None:
    """List, describe and download checkpoints."""


# Columns and headers follow Determined's `det checkpoint list`, so scripts that read its
# table keep working; --json gives the same dicts views.checkpoint_dict builds.
def _row(c: dict[str, Any]) -> list[Any]:
    return [
        c["experiment_id"],
        c["trial_id"],
        c["steps_completed"],
        fmt_time(c["report_time"]),
        c["uuid"],
        # A checkpoint saved without a validation has no metric: show a blank cell, not "None".
        "" if c["validation_metric"] is None else c["validation_metric"],
        # Metadata is written by the trial (untrusted, any shape): sorted JSON keeps the cell stable.
        json.dumps(c["metadata"], sort_keys=True),
    ]


_HEADERS = [
    "Experiment ID",
    "Trial ID",
    "Steps Completed",
    "Report Time",
    "Checkpoint UUID",
    "Validation Metrics",
    "Metadata",
]


@checkpoint.command("list")
@click.argument("exp_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@pass_app
def list_(app: App, exp_id: int, as_json: bool) -> None:
    """List an experiment's checkpoints."""
    with app.store.read() as s:
        cks = [views.checkpoint_dict(s, c) for c in views.checkpoints(s, exp_id, app.scope)]
    if as_json:
        dump_json(cks)
        return
    # Only the list shows State: it includes deleted/partial checkpoints, while describe and
    # download go through Client.get_checkpoint, which resolves one usable checkpoint.
    table(_HEADERS + ["State"], [_row(c) + [c["state"]] for c in cks])


@checkpoint.command("describe")
@click.argument("uuid")
@click.option("--json", "as_json", is_flag=True)
@pass_app
def describe(app: App, uuid: str, as_json: bool) -> None:
    """Describe one checkpoint."""
    c = client.Client(app.store, app.scope).get_checkpoint(uuid).info
    if as_json:
        dump_json(c)
        return
    table(_HEADERS, [_row(c)])


@checkpoint.command("download")
@click.argument("uuid")
@click.option("-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("-q", "--quiet", is_flag=True, help="Only print the path.")
@pass_app
def download(app: App, uuid: str, output_dir: Path | None, quiet: bool) -> None:
    """Copy a checkpoint to a local directory (default checkpoints/<uuid>)."""
    # The scope limits the lookup to the caller's own experiments, so a guessed UUID of another
    # user's checkpoint is not found rather than copied.
    ck = client.Client(app.store, app.scope).get_checkpoint(uuid)
    path = ck.download(output_dir)
    if quiet:
        click.echo(str(path))
        return
    click.echo("Local checkpoint path:")
    click.echo(str(path))
    table(_HEADERS, [_row(ck.info)])
