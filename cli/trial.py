"""`det trial` (alias `det t`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from detslurm.cli import logs as logs_mod
from detslurm.cli import state_change
from detslurm.cli.app import App, pass_app
from detslurm.cli.lazy import lazy_module
from detslurm.cli.render import dump_json, fmt_time, table
from detslurm.expconf.view import ConfigView
from detslurm.store.reads import trial_reason

# Loaded on first use (cli/lazy.py): `det t logs` and `det t describe` must not pay for the ORM,
# the controller or pydantic (the read layer, store.reads, needs none of them).
if TYPE_CHECKING:
    from detslurm import client, views
    from detslurm.cli import slurm as slurm_mod
    from detslurm.cli import stop_time
else:
    client = lazy_module("detslurm.client")
    views = lazy_module("detslurm.views")
    slurm_mod = lazy_module("detslurm.cli.slurm")
    stop_time = lazy_module("detslurm.cli.stop_time")


@click.group(name="trial")
def trial() -> None:
    """Inspect and control trials."""


@trial.command("describe")
@click.argument("trial_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@click.option("--metrics", is_flag=True, help="Also list every reported metric.")
@pass_app
def describe(app: App, trial_id: int, as_json: bool, metrics: bool) -> None:
    """Show a trial, its runs and (optionally) its metrics."""
    slurm_mod.reconcile(app)
    reads = app.reads
    d = reads.trial(trial_id, app.scope.owner)  # another user's trial is "not found"
    runs = reads.run_dicts(trial_id)
    rows = reads.metrics(trial_id) if metrics else []
    if as_json:
        # "metrics" stays in the JSON as null without --metrics, so its shape does not change.
        dump_json({"trial": d, "runs": runs, "metrics": rows if metrics else None})
        return
    _print_trial(d)
    click.echo("\nRuns:")
    _print_runs(runs)
    if any(r["preempt_stop_s"] is not None for r in runs):  # a stop time was measured: is it over budget?
        pool = reads.experiment(int(d["experiment_id"]), app.scope.owner)[0]["resource_pool"]
        for line in stop_time.warnings(app, pool, [(trial_id, r["run_id"], r["preempt_stop_s"]) for r in runs]):
            click.echo(line, err=True)
    if metrics:
        click.echo("\nMetrics:")
        table(
            ["Group", "Steps", "Report Time", "Metrics"],
            [
                [m["group"], m["steps_completed"], fmt_time(m["report_time"]), json.dumps(m["metrics"], sort_keys=True)]
                for m in rows
            ],
        )


def _print_trial(d: dict[str, Any]) -> None:
    # Restarts counts only the ends charged to max_restarts (a crash, an error), not the
    # cluster's preemptions or dead nodes (controller/decide.py).
    headers = ["Trial ID", "Experiment ID", "State", "Restarts", "Batches", "Latest Checkpoint", "Searcher Metric"]
    metric = "" if d["searcher_metric"] is None else d["searcher_metric"]
    row = [d["id"], d["experiment_id"], d["state"], d["restarts"], d["batches"], d["latest_checkpoint"] or "", metric]
    table([*headers, "Reason", "H-Params"], [[*row, trial_reason(d), json.dumps(d["hparams"], sort_keys=True)]])


def _print_runs(runs: list[dict[str, Any]]) -> None:
    table(
        # One row per run: every submission of the trial (first start, requeue, resume after
        # pause) is a run with its own Slurm job and log file.
        ["Run", "State", "Job ID", "Exit Code", "Exit Reason", "Started", "Ended"],
        [
            [
                r["run_id"],
                r["state"],
                r["job_id"] or "",
                "" if r["exit_code"] is None else r["exit_code"],
                r["exit_reason"] or "",
                fmt_time(r["start_time"]),
                fmt_time(r["end_time"]),
            ]
            for r in runs
        ],
    )


@trial.command("logs")
@click.argument("trial_id", type=int)
@logs_mod.log_options
@pass_app
def logs(app: App, /, trial_id: int, **opts: Any) -> None:
    """Show a trial's logs (all of its runs)."""
    logs_mod.show(app, trial_id, **opts)


@trial.command("kill")
@click.argument("trial_id", type=int)
@pass_app
def kill(app: App, trial_id: int) -> None:
    """Kill a trial (the searcher treats it as canceled)."""
    # Recorded in the store like the experiment commands, and the trial's live job is canceled
    # at once (the daemon would at its next tick); the SDK's Trial.kill() is this same change.
    state_change.kill_trial(app, trial_id, click.echo)


@trial.command("download")
@click.argument("trial_id", type=int)
@click.option("--best", is_flag=True, help="The best checkpoint by validation metric.")
@click.option("--latest", is_flag=True, help="The latest checkpoint.")
@click.option("--uuid", "uuid", default=None, help="This checkpoint of the trial.")
@click.option("-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--sort-by", default=None, metavar="METRIC", help="With --best: rank by this metric.")
@click.option("--smaller-is-better", type=bool, default=None, help="With --sort-by: the metric's direction.")
@click.option("-q", "--quiet", is_flag=True, help="Only print the path.")
@pass_app
def download(
    app: App,
    trial_id: int,
    best: bool,
    latest: bool,
    uuid: str | None,
    output_dir: Path | None,
    sort_by: str | None,
    smaller_is_better: bool | None,
    quiet: bool,
) -> None:
    """Download one of a trial's checkpoints (--best, --latest or --uuid) to checkpoints/<uuid>."""
    if best + latest + (uuid is not None) != 1:
        raise click.UsageError("give exactly one of --best, --latest and --uuid")
    chosen = _choose_checkpoint(app, trial_id, "latest" if latest else "best", uuid, sort_by, smaller_is_better)
    ck = client.Client(app.store, app.scope).get_checkpoint(chosen)
    path = ck.download(output_dir)
    if quiet:
        click.echo(str(path))
        return
    click.echo("Local checkpoint path:")
    click.echo(str(path))


def _choose_checkpoint(
    app: App, trial_id: int, which: str, uuid: str | None, sort_by: str | None, sib: bool | None
) -> str:
    with app.store.read() as s:
        t = views.get_trial(s, trial_id, app.scope)
        cks = views.trial_checkpoints(s, trial_id, app.scope)
        if uuid is not None:
            if uuid not in {c.uuid for c in cks}:
                raise click.ClickException(f"trial {trial_id} has no checkpoint {uuid}")
            return uuid
        if which == "latest":
            done = [c.uuid for c in cks if c.state == "COMPLETED"]
            if not done:
                raise click.ClickException(f"trial {trial_id} has no completed checkpoint")
            return done[-1]  # ordered by steps completed
        searcher = ConfigView(t.experiment.config).searcher
        metric = sort_by or searcher.metric
        best = views.ranked_checkpoints(s, cks, metric, searcher.smaller_is_better if sib is None else sib, 1)
        if not best:
            raise click.ClickException(f"trial {trial_id} has no completed checkpoint with a validation {metric!r}")
        return best[0].uuid
