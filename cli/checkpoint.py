"""`det checkpoint` (alias `det c`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from detslurm.cli.app import App, pass_app
from detslurm.cli.lazy import lazy_module
from detslurm.cli.render import dump_json, fmt_time, table
from detslurm.download_dir import LOCATE_COMMAND

# Loaded on first use (cli/lazy.py): list and describe answer from the read layer (store.reads)
# and must not pay for the ORM or the controller.
if TYPE_CHECKING:
    from detslurm import client
    from detslurm.controller import ckpt_ops
else:
    client = lazy_module("detslurm.client")
    ckpt_ops = lazy_module("detslurm.controller.ckpt_ops")


@click.group(name="checkpoint")
def checkpoint() -> None:
    """List, describe and download checkpoints."""


# Columns and headers follow Determined's `det checkpoint list`, so scripts that read its
# table keep working; --json gives the read layer's dicts (store.reads), as the client's info.
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
    cks = app.reads.checkpoint_dicts(exp_id, app.scope.owner)
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
    c = app.reads.checkpoint(uuid, app.scope.owner)  # another user's is "not found"
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


# The login side of a remote download (cli/remote/transfer.py): the directory the laptop may
# copy, checked here as a local download checks it, never the path the trial reported.
@checkpoint.command(LOCATE_COMMAND, hidden=True)
@click.argument("uuid")
@pass_app
def locate(app: App, uuid: str) -> None:
    """Print {"uuid", "directory"} of a checkpoint a download may copy from, as JSON."""
    ck = client.Client(app.store, app.scope).get_checkpoint(uuid)
    click.echo(json.dumps({"uuid": ck.uuid, "directory": str(ck.checked_source())}))


def _uuids(text: str) -> list[str]:
    # Determined takes a comma-separated list of UUIDs in one argument.
    out = [u.strip() for u in text.split(",") if u.strip()]
    if not out:
        raise click.BadParameter("give one or more checkpoint UUIDs, separated by commas", param_hint="UUIDS")
    return out


@checkpoint.command("delete")
@click.argument("uuids")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_app
def delete(app: App, uuids: str, yes: bool) -> None:
    """Delete checkpoints (comma-separated UUIDS): their files go, their rows stay as DELETED."""
    wanted = _uuids(uuids)
    if not yes:
        click.confirm(f"Delete {len(wanted)} checkpoint(s) and their files?", abort=True)
    for uuid in ckpt_ops.delete_checkpoints(app.store, wanted, app.scope):
        click.echo(f"Deleted checkpoint {uuid}")


@checkpoint.command("rm")
@click.argument("uuids")
@click.option("--glob", "globs", multiple=True, required=True, help="Remove the files matching this pattern.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_app
def rm(app: App, uuids: str, globs: tuple[str, ...], yes: bool) -> None:
    """Remove files matching --glob from checkpoints (they become PARTIALLY_DELETED)."""
    wanted = _uuids(uuids)
    if not yes:
        click.confirm(f"Remove files matching {', '.join(globs)} from {len(wanted)} checkpoint(s)?", abort=True)
    done = ckpt_ops.remove_files(app.store, wanted, globs, app.scope)
    for r in done:
        click.echo(f"Removed {len(r.files)} file(s) from checkpoint {r.uuid}")
    if not done:
        click.echo("No checkpoint file matched")
