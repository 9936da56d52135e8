"""The everyday `det experiment` verbs beyond create/list/describe: fork, continue, archive,
labels, `set ...` and download, in Determined's spelling and output.

Commands are collected in :data:`COMMANDS`; cli/experiment.py adds them to its group (this
module does not import that one, so either can be read on its own).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from detslurm.cli.app import App, pass_app
from detslurm.cli.lazy import lazy_module
from detslurm.expconf.view import ConfigView

# Loaded on first use (cli/lazy.py): `det e list` and the other reads must not pay for the
# ORM, the controller or pydantic when their fast path needs none of them.
if TYPE_CHECKING:
    from detslurm import client, views
    from detslurm.cli import backend as backend_mod
    from detslurm.controller import edit
else:
    client = lazy_module("detslurm.client")
    views = lazy_module("detslurm.views")
    backend_mod = lazy_module("detslurm.cli.backend")
    edit = lazy_module("detslurm.controller.edit")

COMMANDS: list[click.Command] = []


def _command(fn: click.Command) -> click.Command:
    COMMANDS.append(fn)
    return fn


@_command
@click.command("fork")
@click.argument("exp_id", type=int)
@click.option("--config", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value.")
@click.option("--config-file", type=click.Path(dir_okay=False, path_type=Path), help="YAML laid over the config.")
@click.option("--paused", is_flag=True, help="Create the new experiment without starting it.")
@pass_app
def fork(app: App, exp_id: int, overrides: tuple[str, ...], config_file: Path | None, paused: bool) -> None:
    """Create a new experiment from EXP_ID's config (with overrides) and its code."""
    from dataclasses import replace

    from detslurm.controller.create import create, plan_fork

    # The fork runs where its parent ran (Slurm or local): Determined's fork has no executor
    # choice either, and a fork of a Slurm experiment should not quietly run on the login node.
    backend = backend_mod.of_experiment(app, exp_id)
    # The unpacked context must outlive the create: the new experiment's tarball is written from it.
    with tempfile.TemporaryDirectory(prefix="detslurm-fork-") as staging:
        ctx = Path(staging) / "context"
        # As `det e create`: an in-allocation fork runs in the allocation this runs in.
        allocation = os.environ.get("SLURM_JOB_ID")
        plan = plan_fork(
            app.settings, app.store, exp_id, app.scope, overrides, ctx, _patch(config_file), allocation=allocation
        )
        # Checked and submitted as `det e create` is: an unknown pool in an override fails before
        # anything exists.
        new_id = create(app.store, app.settings, backend.place(), replace(plan, paused=paused), click.echo)
    assert new_id is not None  # not a dry run
    code = backend.after_create(new_id, paused=paused, follow=False, test_mode=False)
    if code:
        raise click.exceptions.Exit(code)


@_command
@click.command("continue")
@click.argument("exp_id", type=int)
@click.option("--config", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value (single).")
@click.option("--config-file", type=click.Path(dir_okay=False, path_type=Path), help="YAML laid over the config.")
@click.option("--detach", is_flag=True, help="Local experiments: only mark it active; do not run it here.")
@pass_app
def continue_(app: App, exp_id: int, overrides: tuple[str, ...], config_file: Path | None, detach: bool) -> None:
    """Train an ended experiment's trials on from their latest checkpoints (same ids)."""
    # The store change first (ACTIVE again, trials reopened), then the backend carries it out
    # exactly as after `det e activate`: the daemon resubmits, a local driver runs it here.
    n = edit.continue_experiment(app.store, exp_id, overrides, app.scope, _patch(config_file))
    click.echo(f"Continued experiment {exp_id} ({n} trial{'s' if n != 1 else ''} resume from their latest checkpoint)")
    backend_mod.of_experiment(app, exp_id).resume(exp_id, detach=detach)


def _patch(config_file: Path | None) -> dict[str, Any] | None:
    """The --config-file mapping (a clear error naming the file when it cannot be read)."""
    if config_file is None:
        return None
    from detslurm.errors import ConfigError
    from detslurm.expconf import parse_yaml

    try:
        text = config_file.read_text()
    except OSError as e:
        raise ConfigError([f"{config_file}: cannot read the config file: {e.strerror}"]) from None
    return parse_yaml(text, str(config_file))


def _archive_cmd(name: str, archived: bool) -> click.Command:
    @click.command(
        name, help=f"{name.capitalize()} an ended experiment ({'hidden' if archived else 'shown'} by `det e list`)."
    )
    @click.argument("exp_id", type=int)
    @pass_app
    def cmd(app: App, exp_id: int) -> None:
        edit.set_archived(app.store, exp_id, archived, app.scope)
        click.echo(f"{name.capitalize()}d experiment {exp_id}")

    return cmd


# One factory for both: they differ only in the flag they set and the word they print.
COMMANDS += [_archive_cmd("archive", True), _archive_cmd("unarchive", False)]


@click.group("label")
def label() -> None:
    """Add or remove experiment labels."""


@label.command("add")
@click.argument("exp_id", type=int)
@click.argument("label_text", metavar="LABEL")
@pass_app
def label_add(app: App, exp_id: int, label_text: str) -> None:
    """Add LABEL to an experiment."""
    edit.set_labels(app.store, exp_id, label_text, True, app.scope)
    click.echo(f"Added label {label_text} to experiment {exp_id}")


@label.command("remove")
@click.argument("exp_id", type=int)
@click.argument("label_text", metavar="LABEL")
@pass_app
def label_remove(app: App, exp_id: int, label_text: str) -> None:
    """Remove LABEL from an experiment."""
    edit.set_labels(app.store, exp_id, label_text, False, app.scope)
    click.echo(f"Removed label {label_text} from experiment {exp_id}")


COMMANDS.append(label)


@click.group("set")
def set_() -> None:
    """Change an experiment's description, name, max-slots, weight or priority."""


@set_.command("description")
@click.argument("exp_id", type=int)
@click.argument("description")
@pass_app
def set_description(app: App, exp_id: int, description: str) -> None:
    """Set the description."""
    edit.set_description(app.store, exp_id, description, app.scope)
    click.echo(f"Set description of experiment {exp_id} to '{description}'")


@set_.command("name")
@click.argument("exp_id", type=int)
@click.argument("name")
@pass_app
def set_name(app: App, exp_id: int, name: str) -> None:
    """Rename the experiment."""
    edit.set_name(app.store, exp_id, name, app.scope)
    click.echo(f"Set name of experiment {exp_id} to '{name}'")


@set_.command("max-slots")
@click.argument("exp_id", type=int)
@click.argument("max_slots", type=click.IntRange(min=0))
@pass_app
def set_max_slots(app: App, exp_id: int, max_slots: int) -> None:
    """Cap the slots the experiment holds at once (its job arrays' throttle, now and later)."""
    live = edit.set_resource(app.store, exp_id, "max_slots", max_slots, app.scope)
    click.echo(f"Set `max_slots` of experiment {exp_id} to {max_slots}")
    if live.mine and live.job_ids:
        arrays = backend_mod.of_experiment(app, exp_id).throttle(list(live.job_ids), max_slots, live.slots_per_trial)
        if arrays:
            click.echo(f"Throttled Slurm job array{'s' if len(arrays) > 1 else ''} {', '.join(arrays)}")


@set_.command("weight")
@click.argument("exp_id", type=int)
@click.argument("weight", type=click.FloatRange(min=0))
@pass_app
def set_weight(app: App, exp_id: int, weight: float) -> None:
    """Set the fair-share weight (kept and shown; Slurm has no per-job weight)."""
    # Determined's fair share orders one master's jobs; Slurm's fair share is per account and
    # set by the site, so there is nothing per job to tell it.
    edit.set_resource(app.store, exp_id, "weight", weight, app.scope)
    # As Determined on Slurm: the value is saved in the config, and Slurm is not told.
    click.echo(f"Set `weight` of experiment {exp_id} to {weight} (kept in its config; Slurm has no per-job weight)")


@set_.command("priority")
@click.argument("exp_id", type=int)
@click.argument("priority", type=click.IntRange(1, 99))
@pass_app
def set_priority(app: App, exp_id: int, priority: int) -> None:
    """Set the priority (1..99, smaller is higher): its queued and running jobs at once, and every later one."""
    # Saved first: even if Slurm cannot be reached now, every later submission gets the new nice.
    live = edit.set_resource(app.store, exp_id, "priority", priority, app.scope)
    click.echo(f"Set `priority` of experiment {exp_id} to {priority}")
    # Only the owner's det touches the jobs: root's --all-users changes the row, not Slurm.
    if live.mine and (live.job_ids or live.workers_of):
        backend_mod.of_experiment(app, exp_id).reprioritize(list(live.job_ids), priority, live.workers_of)


COMMANDS.append(set_)


@_command
@click.command("download")
@click.argument("exp_id", type=int)
@click.option("-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--top-n", type=click.IntRange(min=1), default=1, show_default=True, help="How many checkpoints.")
@click.option("--sort-by", default=None, metavar="METRIC", help="Rank by this validation metric (default: searcher's).")
@click.option("--smaller-is-better", type=bool, default=None, help="With --sort-by: the metric's direction.")
@click.option("-q", "--quiet", is_flag=True, help="Only print the paths.")
@pass_app
def download(
    app: App,
    exp_id: int,
    output_dir: Path | None,
    top_n: int,
    sort_by: str | None,
    smaller_is_better: bool | None,
    quiet: bool,
) -> None:
    """Download the experiment's best checkpoints (by validation metric) to checkpoints/<uuid>."""
    with app.store.read() as s:
        searcher = ConfigView(views.get_experiment(s, exp_id, app.scope).config).searcher
        metric = sort_by or searcher.metric
        sib = searcher.smaller_is_better if smaller_is_better is None else smaller_is_better
        # Ranked inside the read: the validation lookup needs the session.
        best = [
            c.uuid for c in views.ranked_checkpoints(s, views.checkpoints(s, exp_id, app.scope), metric, sib, top_n)
        ]
    if not best:
        raise click.ClickException(
            f"experiment {exp_id} has no completed checkpoint with a validation metric {metric!r}"
        )
    # Through the client, as `det c download`: its copy refuses odd uuids, partial checkpoints and
    # links out of the checkpoint (docs/design/security.md).
    cl = client.Client(app.store, app.scope)
    for uuid in best:
        path = cl.get_checkpoint(uuid).download(output_dir / uuid if output_dir else None)
        if quiet:
            click.echo(str(path))
        else:
            click.echo(f"Downloaded checkpoint {uuid} to {path}")
