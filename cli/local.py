"""Driving a local experiment in the foreground (``det e create --local``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
import filelock

from detslurm import views
from detslurm.cli import logs as logs_mod
from detslurm.cli.app import App
from detslurm.controller import ops
from detslurm.errors import StateError
from detslurm.identity import os_user
from detslurm.store.models import ExperimentState

if TYPE_CHECKING:
    from detslurm.controller.controller import Controller

# The executor name `det e create --local` stores.
EXECUTOR = "local"


def drive(app: App, exp_id: int, follow: bool = False, quiet: bool = False) -> ExperimentState:
    """Run the experiment's trials as local processes until it ends or is paused.

    Raises StateError when another process drives it already (one driver per experiment), or
    when it is another user's (root's --all-users may change it, never run it: its trials would
    run as root)."""
    with app.store.read() as s:
        exp = views.get_experiment(s, exp_id, app.scope)
        owner, exp_dir = exp.owner, exp.exp_dir
    if owner != os_user():
        raise StateError(f"experiment {exp_id} belongs to {owner}; only its owner's detslurm runs its trials")
    # A file lock in the experiment's own dir, not a store row: it is released by the kernel
    # when a driver dies, so a crashed `det` never leaves the experiment undrivable.
    lock = filelock.FileLock(str(Path(exp_dir) / ".driver.lock"))
    try:
        # Fail at once rather than wait: two drivers would each start the same trials.
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise StateError(f"experiment {exp_id} is already being run by another detslurm process") from None
    try:
        return _loop(app, exp_id, follow, quiet)
    finally:
        lock.release()


class _Round:
    """One polling round of the driver: tick, report trial state changes, pump the follower."""

    def __init__(self, app: App, ctl: Controller, exp_id: int, follow: bool, quiet: bool) -> None:
        self.app, self.ctl, self.exp_id = app, ctl, exp_id
        self.follow, self.quiet = follow, quiet
        # Last state printed per trial: a line is printed only on a change, not every poll.
        self.seen: dict[int, str] = {}
        self.follower: logs_mod.Follower | None = None

    def __call__(self) -> ExperimentState | None:
        # Only this experiment: other local experiments belong to the `det` processes driving them.
        self.ctl.tick_experiment(self.exp_id)
        with self.app.store.read() as s:
            state, trials, busy = views.drive_snapshot(s, self.exp_id, self.app.scope)
        if not self.quiet:
            for tid, st in sorted(trials.items()):
                if self.seen.get(tid) != st:
                    click.echo(f"trial {tid}: {st}")
                    self.seen[tid] = st
        if self.follow and self.follower is None and trials:
            # The lowest id is the first trial created, the one Determined's --follow-first-trial shows.
            self.follower = logs_mod.Follower(self.app, min(trials))
            click.echo(f"Following first trial with ID {min(trials)}")
        if self.follower is not None:
            self.follower.pump()
        # Paused counts as done only once its trials have checkpointed and exited.
        if not (state.is_terminal or (state == ExperimentState.PAUSED and not busy)):
            return None
        if self.follower is not None:
            self.follower.pump()
            click.echo(f"Trial log stream ended. To reopen log stream, run: det trial logs -f {self.follower.trial_id}")
        return state


def _loop(app: App, exp_id: int, follow: bool, quiet: bool) -> ExperimentState:
    # The controller and its executor are imported here: reads that never drive skip them.
    from detslurm.controller.controller import Controller
    from detslurm.controller.local import LocalExecutor

    # max_local_trials caps concurrent trial processes: this machine has no scheduler to queue them.
    ctl = Controller(app.store, LocalExecutor(app.settings.max_local_trials))
    step = _Round(app, ctl, exp_id, follow, quiet)
    interrupted = 0
    while True:
        try:
            return app.poll_until(step)
        except KeyboardInterrupt:
            # First Ctrl-C: pause (trials checkpoint and stop; polling goes on until they did).
            # Second: kill the processes now.
            interrupted += 1
            if interrupted == 1:
                click.echo("\nPausing: trials checkpoint and stop (Ctrl-C again to kill them).", err=True)
                # Pausing goes through the store, like `det e pause`: the next tick asks the trials to
                # checkpoint (preemption), so the experiment can be activated later without lost work.
                ops.pause(app.store, exp_id)
            else:
                _kill_all(app, ctl, exp_id)
                raise


def _kill_all(app: App, ctl: Controller, exp_id: int) -> None:
    with app.store.read() as s:
        jobs = views.active_job_ids(s, exp_id, app.scope)
    # The second Ctrl-C means now: kill the processes without waiting for a checkpoint.
    ctl.executor.kill_many(jobs)
