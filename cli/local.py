"""Driving a local experiment in the foreground (``det e create --local``)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import filelock

from detslurm import views
from detslurm.cli import logs as logs_mod
from detslurm.cli import outcome
from detslurm.cli.app import App
from detslurm.controller import ops
from detslurm.errors import StateError
from detslurm.identity import os_user
from detslurm.store.models import ExperimentState, TrialState

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

    def __init__(self, app: App, ctl: Controller, exp_id: int, follow: bool, quiet: bool, presses: _Presses) -> None:
        self.app, self.ctl, self.exp_id = app, ctl, exp_id
        self.follow, self.quiet = follow, quiet
        self.presses = presses
        # Last state printed per trial: a line is printed only on a change, not every poll.
        self.seen: dict[int, str] = {}
        self.follower: logs_mod.Follower | None = None

    def __call__(self) -> ExperimentState | None:
        # First Ctrl-C: pause (trials checkpoint and stop; polling goes on until they did).
        # Second: kill the processes now, and poll on until the kill is recorded.
        while (press := self.presses.take()) is not None:
            if press == 1:
                _pause(self.app, self.exp_id)
            else:
                _kill_all(self.app, self.ctl, self.exp_id)
        # Only this experiment: other local experiments belong to the `det` processes driving them.
        self.ctl.tick_experiment(self.exp_id)
        with self.app.store.read() as s:
            state, trials, busy = views.drive_snapshot(s, self.exp_id, self.app.scope)
        if not self.quiet:
            for tid, st in sorted(trials.items()):
                if self.seen.get(tid) != st:
                    # A failure is told with why and the trial's last traceback lines.
                    shown = [f"trial {tid}: {st}"]
                    if st == TrialState.ERROR:
                        shown = outcome.trial_failure(self.app, self.app.reads.trial(tid, self.app.scope.owner))
                    click.echo("\n".join(shown))
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
    with _Presses() as presses:
        return app.poll_until(_Round(app, ctl, exp_id, follow, quiet, presses))


class _Presses:
    """Ctrl-C presses while a driver runs, counted by a SIGINT handler and acted on between
    rounds (_Round): a KeyboardInterrupt raised inside a store transaction could leave the store
    locked for the very pause or kill the press asks for. The third press leaves at once."""

    LEAVE = 3

    def __init__(self) -> None:
        self.count = 0
        self.handled = 0
        self.previous: Any = None

    def __enter__(self) -> _Presses:
        # Not where Ctrl-C cannot reach us anyway: a thread other than the main one (signal refuses),
        # or a process started with SIGINT ignored (a background job of a script).
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
            self.previous = signal.signal(signal.SIGINT, self._press)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _press(self, signum: int, frame: object) -> None:
        self.count += 1
        if self.count >= self.LEAVE:
            raise KeyboardInterrupt

    def take(self) -> int | None:
        """The number of the next press not acted on yet (1 for the first), or None."""
        if self.handled >= self.count:
            return None
        self.handled += 1
        return self.handled


def _pause(app: App, exp_id: int) -> None:
    # Pausing goes through the store, like `det e pause`: the next tick asks the trials to
    # checkpoint (preemption), so the experiment can be activated later without lost work.
    try:
        ops.pause(app.store, exp_id)
    except StateError:
        # Already stopping (a cancel, a failed search): there is nothing to pause, only to wait for.
        with app.store.read() as s:
            state = views.experiment_state(s, exp_id, app.scope)
        what = f"Experiment {exp_id} is {state.value}: waiting for its trials to stop"
        click.echo(f"\n{what} (Ctrl-C again to kill them).", err=True)
        return
    click.echo("\nPausing: trials checkpoint and stop (Ctrl-C again to kill them).", err=True)


def _kill_all(app: App, ctl: Controller, exp_id: int) -> None:
    """The second Ctrl-C: `det e kill`, carried out at once. Recorded before the processes die,
    so their ends read as this kill (the trials end CANCELED, no restart spent), never as
    crashes found by the next `det e activate`."""
    click.echo(f"\nKilling experiment {exp_id} (Ctrl-C again to leave without waiting for it).", err=True)
    ops.kill(app.store, exp_id)
    with app.store.read() as s:
        jobs = views.active_job_ids(s, exp_id, app.scope)
    ctl.executor.kill_many(jobs)
