"""`det trial` (alias `det t`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import click

from detslurm import views
from detslurm.cli import logs as logs_mod
from detslurm.cli import slurm as slurm_mod
from detslurm.cli import stop_time
from detslurm.cli.app import App, pass_app
from detslurm.cli.render import dump_json, fmt_time, table
from detslurm.controller import ops
from detslurm.store.models import TrialState


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
    with app.store.read() as s:
        d = views.trial_dict(s, views.get_trial(s, trial_id, app.scope))
        trial_row = views.get_trial(s, trial_id, app.scope)
        runs = [views.run_dict(r) for r in views.runs(s, trial_id)]
        pool = trial_row.experiment.config.get("resources", {}).get("resource_pool", "") or ""
        rows: list[dict[str, Any]] = [
            {"group": m.group, "steps_completed": m.steps_completed, "metrics": m.metrics, "report_time": m.report_time}
            for m in views.metrics(s, trial_id)
        ]
    if as_json:
        # "metrics" stays in the JSON as null without --metrics, so its shape does not change.
        dump_json({"trial": d, "runs": runs, "metrics": rows if metrics else None})
        return
    _print_trial(d)
    click.echo("\nRuns:")
    _print_runs(runs)
    for line in stop_time.warnings(app, str(pool), [(trial_id, r["run_id"], r["preempt_stop_s"]) for r in runs]):
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
    table([*headers, "H-Params"], [[*row, json.dumps(d["hparams"], sort_keys=True)]])


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
@click.option("-f", "--follow", is_flag=True, help="Keep printing new output until the trial ends.")
@click.option("--head", type=int, default=None, help="Only the first N lines.")
@click.option("--tail", type=int, default=None, help="Only the last N lines.")
@click.option("--rank-id", "ranks", type=int, multiple=True, help="Only lines of these ranks ([rank=N] prefix).")
@pass_app
def logs(app: App, trial_id: int, follow: bool, head: int | None, tail: int | None, ranks: tuple[int, ...]) -> None:
    """Show a trial's logs (all of its runs)."""
    slurm_mod.reconcile(app)
    # Refused rather than combined: Determined's CLI allows one of them, and silently
    # preferring either would show lines the user did not ask for.
    if head is not None and tail is not None:
        raise click.UsageError("use at most one of --head and --tail")
    if follow:
        follower = logs_mod.Follower(app, trial_id, ranks)

        def step() -> bool | None:
            follower.pump()
            slurm_mod.reconcile(app)
            with app.store.read() as s:
                done = TrialState(views.get_trial(s, trial_id, app.scope).state).is_terminal
            if done:
                follower.pump()  # what it wrote before it ended
            # None keeps poll_until going; a final pump above catches output written just before the end.
            return True if done else None

        app.poll_until(step)
        return
    if head is not None:
        shown: Iterable[str] = logs_mod.head(app, trial_id, head, ranks)
    elif tail is not None:
        shown = logs_mod.tail(app, trial_id, tail, ranks)
    else:
        shown = logs_mod.lines(app, trial_id, ranks)
    for line in shown:
        click.echo(line)


@trial.command("kill")
@click.argument("trial_id", type=int)
@pass_app
def kill(app: App, trial_id: int) -> None:
    """Kill a trial (the searcher treats it as canceled)."""
    # Recorded in the store like the experiment commands; the daemon cancels the job at its
    # next tick, and the searcher sees the trial as ended early.
    ops.kill_trial(app.store, trial_id, app.scope)
    click.echo(f"Killed trial {trial_id}")
