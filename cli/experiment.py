"""`det experiment` (alias `det e`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import yaml

from detslurm.cli import background_driver, experiment_verbs, state_change
from detslurm.cli.app import App, pass_app
from detslurm.cli.create_args import config_and_context
from detslurm.cli.lazy import lazy_module
from detslurm.cli.render import dump_json, fmt_pct, fmt_time, table, write_csv
from detslurm.errors import ConfigError, DetSlurmError
from detslurm.expconf.view import ConfigView
from detslurm.store.reads import experiment_filter_rows, trial_reason
from detslurm.util import format_size, printable

# Loaded on first use (cli/lazy.py): `det e list` and the other reads must not pay for the
# ORM, the controller or pydantic (the read layer, store.reads, needs none of them).
if TYPE_CHECKING:
    from detslurm.cli import backend as backend_mod
    from detslurm.cli import logs as logs_mod
    from detslurm.cli import outcome, stop_time
    from detslurm.cli import slurm as slurm_mod
    from detslurm.controller import ops
    from detslurm.store import models
else:
    backend_mod = lazy_module("detslurm.cli.backend")
    logs_mod = lazy_module("detslurm.cli.logs")
    outcome = lazy_module("detslurm.cli.outcome")
    slurm_mod = lazy_module("detslurm.cli.slurm")
    stop_time = lazy_module("detslurm.cli.stop_time")
    ops = lazy_module("detslurm.controller.ops")
    models = lazy_module("detslurm.store.models")


@click.group(name="experiment")
def experiment() -> None:
    """Create, inspect and control experiments."""


@experiment.command("create")
# Not dir_okay=False: with --config-file, this one word is the context directory.
@click.argument("config_file", type=click.Path(path_type=Path), required=False)
@click.argument("context_dir", type=click.Path(file_okay=False, path_type=Path), required=False)
@click.option(
    "--config-file",
    "config_opt",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The experiment config, as an option (then the one argument is the context directory).",
)
@click.option("--local", "run_local", is_flag=True, help="Run every trial as a local process, in the foreground.")
@click.option(
    "--in-allocation",
    is_flag=True,
    help="Run the trials as job steps of the Slurm allocation this runs in (slurm.in_allocation).",
)
@click.option("-t", "--test-mode", "--test", "test_mode", is_flag=True, help="One trial, one batch: a quick check.")
@click.option("-f", "--follow-first-trial", "--follow", "follow", is_flag=True, help="Stream the first trial's logs.")
@click.option("--paused", is_flag=True, help="Create the experiment without starting it.")
@click.option("--config", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value.")
@click.option(
    "-i",
    "--include",
    "includes",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Add a file or directory to the context, under its own name (repeatable).",
)
@click.option("--template", metavar="NAME", help="Not supported: Determined's templates live on its master.")
@click.option("--dry-run", is_flag=True, help="Validate and print the plan; create nothing.")
@pass_app
def create(
    app: App,
    config_file: Path | None,
    context_dir: Path | None,
    config_opt: Path | None,
    run_local: bool,
    in_allocation: bool,
    test_mode: bool,
    follow: bool,
    paused: bool,
    overrides: tuple[str, ...],
    includes: tuple[Path, ...],
    template: str | None,
    dry_run: bool,
) -> None:
    """Create an experiment from CONFIG_FILE and the code in CONTEXT_DIR (`.` for the current
    directory)."""
    config_file, context_dir = config_and_context(config_file, context_dir, config_opt, template)
    if in_allocation:
        # The switch is the config's: the flag is one more --config, checked with the rest.
        overrides = (*overrides, "slurm.in_allocation=true")
    # Without --include the context directory is packaged in place; staging costs a full copy.
    if includes:
        import tempfile

        from detslurm.cli.context_include import stage_context

        # The staged copy is packaged when the experiment is created, so it lives until then.
        with tempfile.TemporaryDirectory(prefix="detslurm-context-") as staging:
            staged = stage_context(context_dir, includes, Path(staging) / context_dir.resolve().name)
            _create(app, config_file, staged, run_local, test_mode, follow, paused, overrides, dry_run)
        return
    _create(app, config_file, context_dir, run_local, test_mode, follow, paused, overrides, dry_run)


# Determined 0.38.1 takes the context as optional and, without it, sends no code at all; a
# trial here runs from its context's snapshot, so a create without one could only fail later,
# and quietly packaging the current directory (maybe a home directory) is worse: it is required.
def _create(
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
    # Creating needs the config schema, context packaging and sbatch rendering; reads do not.
    from detslurm.controller import create as create_mod

    try:
        plan = create_mod.plan_create(
            app.settings,
            config_file,
            context_dir,
            overrides,
            test_mode=test_mode,
            paused=paused,
            # The allocation det runs in, if any: where an in-allocation experiment's trials run.
            allocation=os.environ.get("SLURM_JOB_ID"),
        )
        backend = backend_mod.for_create(app, local=run_local)
        exp_id = create_mod.create(app.store, app.settings, backend.place(), plan, click.echo, dry_run=dry_run)
    except ConfigError as e:
        # Every path in the message (a schema error, a refusal) is told against the user's file.
        raise e.in_file(str(config_file)) from None
    if exp_id is None:
        return  # a dry run
    # The experiment exists from here on: a failure below (e.g. --test-mode's verdict) is an
    # exit code, and the experiment stays for `det e describe` and `det e logs`.
    code = backend.after_create(exp_id, paused=paused, follow=follow, test_mode=test_mode)
    if code:
        raise click.exceptions.Exit(code)


@experiment.command("list")
@click.option(
    "-a",
    "--all",
    "show_all",
    is_flag=True,
    help="Include archived experiments (and an Archived column); other users' only with root's det --all-users.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV instead of a table.")
@click.option("--state", "states", multiple=True, metavar="STATE", help="Only experiments in STATE (repeatable).")
@click.option("--label", "labels", multiple=True, metavar="LABEL", help="Only experiments with LABEL (repeatable).")
@click.option("--name", default=None, metavar="TEXT", help="Only experiments whose name contains TEXT.")
@pass_app
def list_(
    app: App,
    show_all: bool,
    as_json: bool,
    as_csv: bool,
    states: tuple[str, ...],
    labels: tuple[str, ...],
    name: str | None,
) -> None:
    """List experiments (your own, archived ones only with --all)."""
    if as_json and as_csv:
        raise click.UsageError("use at most one of --json and --csv")
    slurm_mod.reconcile(app)
    rows = experiment_filter_rows(
        app.reads.experiment_rows(app.scope.owner, include_archived=show_all), states=states, name=name
    )
    # Labels live in the configs: whole rows are read only when a label filter or --json needs them.
    dicts: list[dict[str, Any]] = []
    if labels or as_json:
        ids = {r.id for r in rows}
        dicts = [d for d in app.reads.experiment_dicts(app.scope.owner, include_archived=show_all) if d["id"] in ids]
    if labels:
        keep = {d["id"] for d in dicts if set(labels) <= set(d["labels"])}
        rows, dicts = [r for r in rows if r.id in keep], [d for d in dicts if d["id"] in keep]
    if as_json:
        dump_json(dicts)
        return
    headers = ["ID", "Owner", "Name", "Parent ID", "State", "Progress", "Started", "Ended", "Resource Pool"]
    values = [
        [
            r.id,
            r.owner,
            r.name,
            r.parent_id or "",
            r.state,
            fmt_pct(float(r.progress)),
            fmt_time(r.start_time),
            fmt_time(r.end_time),
            r.resource_pool,
            *([r.archived] if show_all else []),
        ]
        for r in rows
    ]
    # As Determined: the Archived column appears with -a, when archived ones can be listed.
    headers += ["Archived"] if show_all else []
    if as_csv:
        write_csv(headers, values)
    else:
        table(headers, values)


experiment.add_command(list_, "ls")


@experiment.command("describe")
@click.argument("exp_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@pass_app
def describe(app: App, exp_id: int, as_json: bool) -> None:
    """Show an experiment, its trials and their workloads."""
    slurm_mod.reconcile(app)
    reads = app.reads
    e, config = reads.experiment(exp_id, app.scope.owner)
    trials = reads.trial_dicts(exp_id, app.scope.owner)
    if as_json:
        # A one-element list, the shape Determined's `det e describe --json` prints for one id.
        dump_json([{"experiment": e, "trials": trials}])
        return
    recent = reads.recent_metrics([int(t["id"]) for t in trials], WORKLOADS_SHOWN)
    work = [(tid, *w) for tid, (shown, _) in recent.items() for w in shown]
    hidden = [tid for tid, (_, more) in recent.items() if more]
    # Only the header names it: read from the stored config (validated when it was stored).
    metric = ConfigView(config).searcher.metric or None
    _print_described(e, metric, trials, work, hidden)
    # Stop times measured after preemptions, compared with what the site allows (only when there
    # are some: the comparison loads the site config and asks Slurm).
    stops = reads.stop_times(exp_id)
    for line in stop_time.warnings(app, e["resource_pool"], stops) if stops else []:
        click.echo(line, err=True)


def _print_described(
    e: dict[str, Any], metric: Any, trials: list[dict[str, Any]], work: list[tuple[Any, ...]], hidden: list[int]
) -> None:
    """`det e describe`'s tables, from either path."""
    click.echo("Experiment:")
    _print_experiment(e)
    if e.get("error"):
        # Why it failed (a searcher metric the trials do not report, every trial errored).
        click.echo(f"Error: {printable(str(e['error']))}")
    if e.get("notes"):
        # The user's own text (the SDK's Experiment.set_notes); it may run over several lines.
        click.echo(f"Notes:\n{printable(str(e['notes']))}")
    click.echo("\nTrials:")
    table(
        ["Trial ID", "Experiment ID", "State", "Reason", "Started", "Ended", "H-Params"],
        [
            [
                t["id"],
                t["experiment_id"],
                t["state"],
                trial_reason(t),
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
    for tid in hidden:
        click.echo(
            f"Trial {tid}: only its last {WORKLOADS_SHOWN} workloads are shown; "
            f"det trial describe {tid} --metrics lists them all."
        )


# Workloads `det e describe` shows per trial: a trial reporting every few batches for days has
# millions, and a table of them all would take minutes to print and be read by nobody.
WORKLOADS_SHOWN = 1000


def _print_experiment(e: dict[str, Any]) -> None:
    headers = ["Experiment ID", "State", "Progress", "Started", "Ended", "Name", "Description", "Archived"]
    row = [
        e["id"],
        e["state"],
        fmt_pct(float(e["progress"])),
        fmt_time(e["start_time"]),
        fmt_time(e["end_time"]),
        e["name"],
        e["description"] or "",
        e["archived"],
    ]
    table([*headers, "Resource Pool", "Labels"], [[*row, e["resource_pool"], ", ".join(e["labels"])]])


@experiment.command("config")
@click.argument("exp_id", type=int)
@pass_app
def config(app: App, exp_id: int) -> None:
    """Print the experiment's config with defaults filled."""
    # The stored config already has defaults filled (validated at create); sort_keys=False
    # keeps the schema's section order rather than alphabetical.
    click.echo(yaml.safe_dump(app.reads.experiment(exp_id, app.scope.owner)[1], sort_keys=False), nl=False)


@experiment.command("list-trials")
@click.argument("exp_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@pass_app
def list_trials(app: App, exp_id: int, as_json: bool) -> None:
    """List an experiment's trials."""
    slurm_mod.reconcile(app)
    trials = app.reads.trial_dicts(exp_id, app.scope.owner)
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
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV instead of a table.")
@pass_app
def list_checkpoints(app: App, exp_id: int, best: int | None, as_json: bool, as_csv: bool) -> None:
    """List an experiment's checkpoints."""
    slurm_mod.reconcile(app)
    _, config = app.reads.experiment(exp_id, app.scope.owner)
    # The stored config (validated, defaults filled, when it was stored).
    sib = ConfigView(config).searcher.smaller_is_better
    cks = app.reads.checkpoint_dicts(exp_id, app.scope.owner)
    if best is not None:
        # "Best" needs a metric to rank by; deleted or partial checkpoints cannot be restored
        # from, so they are never among the best.
        scored = [c for c in cks if c["validation_metric"] is not None and c["state"] == "COMPLETED"]
        # Negating makes one ascending sort serve both directions of searcher.smaller_is_better.
        scored.sort(key=lambda c: float(c["validation_metric"]) * (1 if sib else -1))
        cks = scored[:best]
    if as_json:
        dump_json(cks)
        return
    headers = ["Trial ID", "# of Batches", "State", "Validation Metric", "UUID", "Resources", "Size"]
    values = [
        [
            c["trial_id"],
            c["steps_completed"],
            c["state"],
            _blank_none(c["validation_metric"]),
            c["uuid"],
            # The number of files in the checkpoint, as Determined's Resources column counts them.
            len(c["resources"]),
            format_size(int(c["size"])),
        ]
        for c in cks
    ]
    # Determined's `lc --csv`: the same columns, for scripts.
    (write_csv if as_csv else table)(headers, values)


def _blank_none(v: object) -> object:
    return "" if v is None else v


experiment.add_command(list_checkpoints, "lc")


@experiment.command("logs")
@click.argument("exp_id", type=int)
@logs_mod.log_options
@pass_app
def logs(app: App, /, exp_id: int, **opts: Any) -> None:
    """Show the first trial's logs (with the filters of `det trial logs`)."""
    slurm_mod.reconcile(app)
    # The first trial, as in Determined: an experiment's logs are its first trial's logs.
    tid = app.reads.first_trial_id(exp_id, app.scope.owner)
    if tid is None:
        raise DetSlurmError(f"experiment {exp_id} has no trials yet")
    logs_mod.show(app, tid, **opts)


# pause, cancel and kill record the wish in the store; the daemon (or the `det` that drives a
# local experiment) carries it out at its next tick. kill and pause also reach Slurm at once
# for jobs that need no checkpoint: every job on kill, the ones still queued on pause. The
# Python SDK's Experiment.pause() and friends are these same changes (cli/state_change.py).
def _state_change(verb: str) -> click.Command:
    @click.command(verb, help=f"{verb.capitalize()} an experiment.")
    @click.argument("exp_id", type=int)
    @pass_app
    def cmd(app: App, exp_id: int) -> None:
        state_change.change_state(app, state_change.Verb(verb), exp_id, detach=False, echo=click.echo)

    return cmd


experiment.add_command(_state_change("pause"))
experiment.add_command(_state_change("cancel"))
experiment.add_command(_state_change("kill"))


@experiment.command("activate")
@click.argument("exp_id", type=int)
@click.option(
    "--detach",
    is_flag=True,
    help=(
        "Return at once: a Slurm experiment's daemon runs it, a local one a driver in the "
        "background (its output in the experiment dir's driver.log)."
    ),
)
@pass_app
def activate(app: App, exp_id: int, detach: bool) -> None:
    """Activate (resume) a paused experiment; local experiments run in the foreground. This also
    resumes a local experiment whose foreground ended (a closed terminal, an SSH drop, a kill),
    from its trials' checkpoints. An in-allocation experiment continues in the allocation this
    runs in, else in its own while that runs, else as ordinary jobs."""
    state_change.change_state(app, state_change.Verb.ACTIVATE, exp_id, detach=detach, echo=click.echo)


experiment.add_command(activate, "unpause")


@experiment.command(background_driver.COMMAND, hidden=True)
@click.argument("exp_id", type=int)
@click.option("--ready-fd", type=int, required=True)
@pass_app
def drive_detached(app: App, exp_id: int, ready_fd: int) -> None:
    """The background driver of a local experiment activated with --detach (cli/background_driver.py)."""
    background_driver.drive(app, exp_id, ready_fd)


@experiment.command("wait")
@click.argument("exp_id", type=int)
@pass_app
def wait(app: App, exp_id: int) -> None:
    """Wait for an experiment to end; exit 1 unless it COMPLETED."""
    state = backend_mod.of_experiment(app, exp_id).wait(exp_id)
    click.echo("\n".join(outcome.experiment_end(app, exp_id, state, trials=True)))
    if state != models.ExperimentState.COMPLETED:
        # A nonzero exit for CANCELED, ERROR and the rest lets scripts chain on `det e wait`.
        raise click.exceptions.Exit(1)


@experiment.command("delete")
@click.argument("exp_id", type=int)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_app
def delete(app: App, exp_id: int, yes: bool) -> None:
    """Delete an ended experiment, its files and checkpoints."""
    if not yes:
        # Deleting removes checkpoints, which nothing can restore: ask unless --yes.
        click.confirm(f"Delete experiment {exp_id}, its files and all its checkpoints?", abort=True)
    ops.delete(app.store, exp_id, app.scope)
    click.echo(f"Deleted experiment {exp_id}")


# fork, continue, archive, label, set, download: cli/experiment_verbs.py.
for _cmd in experiment_verbs.COMMANDS:
    experiment.add_command(_cmd)
