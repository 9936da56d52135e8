"""CLI glue for Slurm experiments: the daemon, following, waiting, one-step reconciles."""

from __future__ import annotations

import time

import click

from detslurm import daemon as daemon_mod
from detslurm import views
from detslurm.cli import logs as logs_mod
from detslurm.cli.app import App
from detslurm.store.models import ExperimentState, TrialState


def require_slurm(app: App) -> None:
    """Fail before creating anything when Slurm cannot be reached (clear error, nothing lost)."""
    from detslurm.slurm.client import client_from_env

    client_from_env().capabilities()


def reconcile(app: App) -> None:
    """Reads with no daemon running do one reconcile step themselves (so state is current)."""
    if daemon_mod.running_pid(app.settings) is None and _has_active_slurm(app):
        daemon_mod.reconcile_once(app.settings)


def _has_active_slurm(app: App) -> bool:
    from sqlalchemy import func, select

    from detslurm.store.models import Experiment

    terminal = [s.value for s in ExperimentState if s.is_terminal]
    with app.store.tx() as s:
        n = s.scalar(
            select(func.count())
            .select_from(Experiment)
            .where(Experiment.executor == "slurm")
            .where(Experiment.state.not_in(terminal))
        )
    return bool(n)


def after_create(app: App, exp_id: int, *, paused: bool, follow: bool, test_mode: bool) -> None:
    daemon_mod.reconcile_once(app.settings)  # submit right away
    if not paused:
        pid = daemon_mod.start(app.settings)
        click.echo(f"detslurm daemon running (pid {pid})")
    if test_mode:
        state = wait(app, exp_id, quiet=True)
        from detslurm.cli.experiment import _test_mode_report

        raise click.exceptions.Exit(_test_mode_report(app, exp_id, state))
    if follow:
        follow_first_trial(app, exp_id)


def _first_trial(app: App, exp_id: int) -> tuple[int | None, str | None, bool]:
    with app.store.tx() as s:
        exp = views.get_experiment(s, exp_id)
        if not exp.trials:
            return None, None, ExperimentState(exp.state).is_terminal
        t = exp.trials[0]
        return t.id, t.runner_state, TrialState(t.state).is_terminal


def follow_first_trial(app: App, exp_id: int) -> None:
    click.echo("Waiting for first trial to begin...")
    shown_reason = None
    follower = None
    while True:
        tid, runner, done = _first_trial(app, exp_id)
        if tid is not None and follower is None:
            follower = logs_mod.Follower(app, tid)
            click.echo(f"Following first trial with ID {tid}")
        if runner and runner.startswith("queued") and runner != shown_reason:
            click.echo(f"HPC job waiting to be scheduled: {runner.removeprefix('queued: ')}")
            shown_reason = runner
        if follower is not None:
            follower.pump()
        if done:
            if follower is not None:
                follower.pump()
                click.echo(f"Trial log stream ended. To reopen log stream, run: det trial logs -f {tid}")
            return
        time.sleep(app.settings.poll_interval_s)


def wait(app: App, exp_id: int, quiet: bool = False) -> ExperimentState:
    while True:
        reconcile(app)
        with app.store.tx() as s:
            state = ExperimentState(views.get_experiment(s, exp_id).state)
        if state.is_terminal:
            return state
        time.sleep(app.settings.poll_interval_s)
