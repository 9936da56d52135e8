"""Driving a local experiment in the foreground (``det e create --local``)."""

from __future__ import annotations

import time
from pathlib import Path

import click
import filelock

from detslurm.cli import logs as logs_mod
from detslurm.cli.app import App
from detslurm.controller.controller import ACTIVE_RUN, Controller
from detslurm.controller.local import LocalExecutor
from detslurm.errors import StateError
from detslurm.store.models import Experiment, ExperimentState, TrialRun


def _snapshot(app: App, exp_id: int) -> tuple[ExperimentState, dict[int, str], bool]:
    with app.store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        states = {t.id: t.state for t in exp.trials}
        busy = any(r.state in ACTIVE_RUN for t in exp.trials for r in t.runs)
        return ExperimentState(exp.state), states, busy


def drive(app: App, exp_id: int, follow: bool = False, quiet: bool = False) -> ExperimentState:
    with app.store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        lock = filelock.FileLock(str(Path(exp.exp_dir) / ".driver.lock"))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise StateError(f"experiment {exp_id} is already being run by another detslurm process") from None
    try:
        return _loop(app, exp_id, follow, quiet)
    finally:
        lock.release()


def _loop(app: App, exp_id: int, follow: bool, quiet: bool) -> ExperimentState:
    ctl = Controller(app.store, LocalExecutor(app.settings.max_local_trials))
    seen: dict[int, str] = {}
    follower: logs_mod.Follower | None = None
    interrupted = 0
    while True:
        try:
            ctl.tick_experiment(exp_id)
            state, trials, busy = _snapshot(app, exp_id)
            if not quiet:
                for tid, st in sorted(trials.items()):
                    if seen.get(tid) != st:
                        click.echo(f"trial {tid}: {st}")
                        seen[tid] = st
            if follow and follower is None and trials:
                follower = logs_mod.Follower(app, min(trials))
                click.echo(f"Following first trial with ID {min(trials)}")
            if follower is not None:
                follower.pump()
            if state.is_terminal or (state == ExperimentState.PAUSED and not busy):
                if follower is not None:
                    follower.pump()
                    click.echo(
                        f"Trial log stream ended. To reopen log stream, run: det trial logs -f {follower.trial_id}"
                    )
                return state
            time.sleep(app.settings.poll_interval_s)
        except KeyboardInterrupt:
            interrupted += 1
            if interrupted == 1:
                click.echo("\nPausing: trials checkpoint and stop (Ctrl-C again to kill them).", err=True)
                from detslurm.controller import ops

                ops.pause(app.store, exp_id)
            else:
                _kill_all(app, ctl, exp_id)
                raise


def _kill_all(app: App, ctl: Controller, exp_id: int) -> None:
    with app.store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        jobs = [r.job_id for t in exp.trials for r in t.runs if r.state in ACTIVE_RUN and r.job_id]
    ctl.executor.kill_many(jobs)


__all__ = ["drive", "TrialRun"]
