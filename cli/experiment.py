"""`det experiment` (alias `det e`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import yaml
from sqlalchemy import select

from detslurm import views
from detslurm.cli import logs as logs_mod
from detslurm.cli import slurm as slurm_mod
from detslurm.cli.app import App, pass_app
from detslurm.cli.render import dump_json, fmt_pct, fmt_time, table
from detslurm.controller import ops
from detslurm.errors import DetSlurmError
from detslurm.store.models import Experiment, ExperimentState


def _local() -> Any:
    from detslurm.cli import local

    return local


@click.group(name="experiment")
def experiment() -> None:
    """Create, inspect and control experiments."""


def _test_mode_report(app: App, exp_id: int, state: ExperimentState) -> int:
    with app.store.tx() as s:
        exp = views.get_experiment(s, exp_id)
        trial = exp.trials[0] if exp.trials else None
        tested = trial is not None and trial.runner_state == "test_done"
        tid = trial.id if trial else None
    if state == ExperimentState.COMPLETED and tested:
        click.echo("Model definition test succeeded! 🎉")
        return 0
    click.echo(
        "Model definition test failed: the trial must report training metrics, validation metrics and "
        "a checkpoint, then exit 0. Trial logs:",
        err=True,
    )
    if tid is not None:
        for line in list(logs_mod.lines(app, tid))[-40:]:
            click.echo(line, err=True)
    return 1


@experiment.command("create")
@click.argument("config_file", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("context_dir", type=click.Path(file_okay=False, path_type=Path), default=".", required=False)
@click.option("--local", "run_local", is_flag=True, help="Run every trial as a local process, in the foreground.")
@click.option("-t", "--test-mode", is_flag=True, help="One trial, one batch: a quick check of the model code.")
@click.option("-f", "--follow-first-trial", "follow", is_flag=True, help="Stream the first trial's logs.")
@click.option("--paused", is_flag=True, help="Create the experiment without starting it.")
@click.option("--config", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value.")
@click.option("--dry-run", is_flag=True, help="Validate and print the plan; create nothing.")
@pass_app
def create(
    app: App,
    config_file: Path,
    context_dir: Path,
    run_local: bool,
    test_mode: bool,
    follow: bool,
    paused: bool,
    overrides: tuple[str, ...],
    dry_run: bool,
) -> None:
    """Create an experiment from CONFIG_FILE and the code in CONTEXT_DIR."""
    # Creating needs the config schema, context packaging and sbatch rendering; reads do not.
    from detslurm.controller.create import execute_create, plan_create
    from detslurm.slurm.render import resource_plan

    plan = plan_create(app.settings, config_file, context_dir, overrides, test_mode=test_mode, paused=paused)
    site = None if run_local else app.site()
    if site is not None:
        resource_plan(plan.config, site)  # an unknown pool fails here, before anything exists
    if dry_run:
        _print_dry_run(app, plan, run_local)
        return
    if not run_local:
        slurm_mod.require_slurm(app)
        exp_id = execute_create(app.store, app.settings, plan, executor="slurm")
        click.echo(f"Created experiment {exp_id}")
        slurm_mod.after_create(app, exp_id, paused=paused, follow=follow, test_mode=test_mode)
        return
    exp_id = execute_create(app.store, app.settings, plan, executor="local")
    click.echo(f"Created experiment {exp_id}")
    if paused:
        return
    if test_mode:
        click.echo("Testing training, validation and checkpointing")
    state = _local().drive(app, exp_id, follow=follow, quiet=test_mode)
    if test_mode:
        raise click.exceptions.Exit(_test_mode_report(app, exp_id, state))
    click.echo(f"Experiment {exp_id} {state.value}")
    if state not in (ExperimentState.COMPLETED, ExperimentState.PAUSED):
        raise click.exceptions.Exit(1)


def _print_dry_run(app: App, plan: Any, run_local: bool) -> None:
    """The plan, then exactly what the first submission would run: for Slurm, the sbatch
    command lines and scripts the executor builds (a shell script: comments and heredocs)."""
    from detslurm.controller.create import dry_run

    click.echo(plan.describe())
    if run_local:
        from detslurm.controller.local import LocalExecutor

        for spec in dry_run(app.store, app.settings, plan, LocalExecutor(app.settings.max_local_trials)):
            click.echo(f"# local trial run {spec.name}: {' '.join(spec.argv)} (in {spec.run_dir})")
    else:
        from detslurm.controller.slurm_executor import SlurmExecutor
        from detslurm.slurm.client import client_from_env

        executor = SlurmExecutor(client_from_env(), app.site(), offline=True)
        for sub in executor.plan_many(dry_run(app.store, app.settings, plan, executor)):
            click.echo(sub.request.render())
    click.echo("# dry run: nothing was created or submitted")


def _exp_rows(app: App, show_all: bool) -> list[dict[str, Any]]:
    with app.store.tx() as s:
        q = select(Experiment).order_by(Experiment.id)
        if not show_all:
            q = q.where(Experiment.archived.is_(False))
        return [views.experiment_dict(e) for e in s.scalars(q)]


@experiment.command("list")
@click.option("-a", "--all", "show_all", is_flag=True, help="Include archived experiments.")
@click.option("--json", "as_json", is_flag=True)
@pass_app
def list_(app: App, show_all: bool, as_json: bool) -> None:
    """List experiments."""
    slurm_mod.reconcile(app)
    if as_json:
        dump_json(_exp_rows(app, show_all))
        return
    # Only the shown columns: loading whole rows (configs, searcher states) of thousands of
    # experiments would take seconds.
    e = Experiment
    q = select(e.id, e.owner, e.name, e.parent_id, e.state, e.progress, e.start_time, e.end_time, e.resource_pool)
    if not show_all:
        q = q.where(e.archived.is_(False))
    with app.store.tx() as s:
        rows = list(s.execute(q.order_by(e.id)))
    table(
        ["ID", "Owner", "Name", "Parent ID", "State", "Progress", "Started", "Ended", "Resource Pool"],
        [
            [i, owner, name, parent or "", state, fmt_pct(float(progress)), fmt_time(start), fmt_time(end), pool]
            for i, owner, name, parent, state, progress, start, end, pool in rows
        ],
    )


experiment.add_command(list_, "ls")


@experiment.command("describe")
@click.argument("exp_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@pass_app
def describe(app: App, exp_id: int, as_json: bool) -> None:
    """Show an experiment, its trials and their workloads."""
    slurm_mod.reconcile(app)
    with app.store.tx() as s:
        exp = views.get_experiment(s, exp_id)
        e = views.experiment_dict(exp)
        trials = [views.trial_dict(s, t) for t in exp.trials]
        metric = exp.config["searcher"]["metric"]
        work = [
            (t["id"], m.steps_completed, m.group, m.report_time, m.metrics)
            for t in trials
            for m in views.metrics(s, int(t["id"]))
        ]
    if as_json:
        dump_json([{"experiment": e, "trials": trials}])
        return
    click.echo("Experiment:")
    table(
        [
            "Experiment ID",
            "State",
            "Progress",
            "Started",
            "Ended",
            "Name",
            "Description",
            "Archived",
            "Resource Pool",
            "Labels",
        ],
        [
            [
                e["id"],
                e["state"],
                fmt_pct(float(e["progress"])),
                fmt_time(e["start_time"]),
                fmt_time(e["end_time"]),
                e["name"],
                e["description"] or "",
                e["archived"],
                e["resource_pool"],
                ", ".join(e["labels"]),
            ]
        ],
    )
    click.echo("\nTrials:")
    table(
        ["Trial ID", "Experiment ID", "State", "Started", "Ended", "H-Params"],
        [
            [
                t["id"],
                t["experiment_id"],
                t["state"],
                fmt_time(t["start_time"]),
                fmt_time(t["end_time"]),
                json.dumps(t["hparams"], indent=2),
            ]
            for t in trials
        ],
    )
    click.echo("\nWorkloads:")
    table(
        ["Trial ID", "# of Batches", "Group", "Report Time", f"Metrics ({metric} is the searcher metric)"],
        [[tid, steps, group, fmt_time(rt), json.dumps(m, sort_keys=True)] for tid, steps, group, rt, m in work],
    )


@experiment.command("config")
@click.argument("exp_id", type=int)
@pass_app
def config(app: App, exp_id: int) -> None:
    """Print the experiment's config with defaults filled."""
    with app.store.tx() as s:
        click.echo(yaml.safe_dump(views.get_experiment(s, exp_id).config, sort_keys=False), nl=False)


@experiment.command("list-trials")
@click.argument("exp_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@pass_app
def list_trials(app: App, exp_id: int, as_json: bool) -> None:
    """List an experiment's trials."""
    slurm_mod.reconcile(app)
    with app.store.tx() as s:
        trials = [views.trial_dict(s, t) for t in views.get_experiment(s, exp_id).trials]
    if as_json:
        dump_json(trials)
        return
    table(
        ["Trial ID", "State", "H-Params", "Started", "Ended", "# of Batches"],
        [
            [
                t["id"],
                t["state"],
                json.dumps(t["hparams"], sort_keys=True),
                fmt_time(t["start_time"]),
                fmt_time(t["end_time"]),
                t["batches"],
            ]
            for t in trials
        ],
    )


experiment.add_command(list_trials, "lt")


@experiment.command("list-checkpoints")
@click.argument("exp_id", type=int)
@click.option("--best", type=int, default=None, help="Only the N best by the searcher metric.")
@click.option("--json", "as_json", is_flag=True)
@pass_app
def list_checkpoints(app: App, exp_id: int, best: int | None, as_json: bool) -> None:
    """List an experiment's checkpoints."""
    slurm_mod.reconcile(app)
    with app.store.tx() as s:
        exp = views.get_experiment(s, exp_id)
        sib = exp.config["searcher"]["smaller_is_better"]
        cks = [views.checkpoint_dict(s, c) for c in views.checkpoints(s, exp_id)]
    if best is not None:
        scored = [c for c in cks if c["validation_metric"] is not None and c["state"] == "COMPLETED"]
        scored.sort(key=lambda c: float(c["validation_metric"]) * (1 if sib else -1))
        cks = scored[:best]
    if as_json:
        dump_json(cks)
        return
    table(
        ["Trial ID", "# of Batches", "State", "Validation Metric", "UUID", "Resources", "Size"],
        [
            [
                c["trial_id"],
                c["steps_completed"],
                c["state"],
                _blank_none(c["validation_metric"]),
                c["uuid"],
                len(c["resources"]),
                f"{int(c['size']) / 1024:.1f} KiB",
            ]
            for c in cks
        ],
    )


def _blank_none(v: object) -> object:
    return "" if v is None else v


experiment.add_command(list_checkpoints, "lc")


@experiment.command("logs")
@click.argument("exp_id", type=int)
@pass_app
def logs(app: App, exp_id: int) -> None:
    """Show the first trial's logs."""
    slurm_mod.reconcile(app)
    with app.store.tx() as s:
        exp = views.get_experiment(s, exp_id)
        if not exp.trials:
            raise DetSlurmError(f"experiment {exp_id} has no trials yet")
        tid = exp.trials[0].id
    for line in logs_mod.lines(app, tid):
        click.echo(line)


def _state_change(verb: str, past: str, fn: Callable[[Any, int], None]) -> click.Command:
    @click.command(verb, help=f"{verb.capitalize()} an experiment.")
    @click.argument("exp_id", type=int)
    @pass_app
    def cmd(app: App, exp_id: int) -> None:
        fn(app.store, exp_id)
        click.echo(f"{past} experiment {exp_id}")

    return cmd


experiment.add_command(_state_change("pause", "Paused", ops.pause))
experiment.add_command(_state_change("cancel", "Canceled", ops.cancel))
experiment.add_command(_state_change("kill", "Killed", ops.kill))


@experiment.command("activate")
@click.argument("exp_id", type=int)
@click.option("--detach", is_flag=True, help="Only mark it active; do not run it in this process.")
@pass_app
def activate(app: App, exp_id: int, detach: bool) -> None:
    """Activate (resume) a paused experiment; local experiments run in the foreground."""
    ops.activate(app.store, exp_id)
    click.echo(f"Activated experiment {exp_id}")
    with app.store.tx() as s:
        kind = views.get_experiment(s, exp_id).executor
    if kind == "local" and not detach:
        state = _local().drive(app, exp_id)
        click.echo(f"Experiment {exp_id} {state.value}")
    elif kind == "slurm":
        from detslurm import daemon as daemon_mod

        daemon_mod.start(app.settings)


experiment.add_command(activate, "unpause")


@experiment.command("wait")
@click.argument("exp_id", type=int)
@pass_app
def wait(app: App, exp_id: int) -> None:
    """Wait for an experiment to end; exit 1 unless it COMPLETED."""
    with app.store.tx() as s:
        kind = views.get_experiment(s, exp_id).executor
    import time

    if kind == "slurm":
        state = slurm_mod.wait(app, exp_id)
        click.echo(f"Experiment {exp_id} {state.value}")
        if state != ExperimentState.COMPLETED:
            raise click.exceptions.Exit(1)
        return
    while True:
        with app.store.tx() as s:
            state = ExperimentState(views.get_experiment(s, exp_id).state)
        if state.is_terminal:
            break
        if kind == "local" and state != ExperimentState.PAUSED:
            try:
                state = _local().drive(app, exp_id, quiet=True)
                continue
            except DetSlurmError:
                pass  # another process drives it: poll the store
        time.sleep(app.settings.poll_interval_s)
    click.echo(f"Experiment {exp_id} {state.value}")
    if state != ExperimentState.COMPLETED:
        raise click.exceptions.Exit(1)


@experiment.command("delete")
@click.argument("exp_id", type=int)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_app
def delete(app: App, exp_id: int, yes: bool) -> None:
    """Delete an ended experiment, its files and checkpoints."""
    if not yes:
        click.confirm(f"Delete experiment {exp_id}, its files and all its checkpoints?", abort=True)
    ops.delete(app.store, exp_id)
    click.echo(f"Deleted experiment {exp_id}")
