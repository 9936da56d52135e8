"""Local experiments whose driver has ended: what every read does about them.

A local experiment has no daemon: the `det` that drives it in the foreground (cli/local.py)
holds a lock in its experiment dir for as long as it runs. A driver that ended without pausing
its experiment (SIGKILL, a crash, a third Ctrl-C) leaves runs not ended and the lock free; its
trials were sent the preemption signal by the kernel (controller/local.py). A read finds such an
experiment here and pauses it, so that it is never listed ACTIVE with nothing behind it.

Kept apart from cli/local.py, and light: every read imports it, and the controller is loaded
only when an undriven experiment is found.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import click

from detslurm.cli.app import App
from detslurm.cli.lazy import lazy_module
from detslurm.identity import os_user
from detslurm.store.states import ExperimentState

if TYPE_CHECKING:
    import filelock

    from detslurm import views
    from detslurm.controller import ops
else:
    filelock = lazy_module("filelock")
    views = lazy_module("detslurm.views")
    ops = lazy_module("detslurm.controller.ops")

# The executor name `det e create --local` stores.
EXECUTOR = "local"


def driver_lock(exp_dir: str) -> filelock.FileLock:
    """The lock the experiment's driver holds. A file lock in the experiment's own dir, not a
    store row: the kernel releases it when the driver dies, so a crashed `det` never leaves the
    experiment undrivable, and a read can tell that nothing drives it any more."""
    return filelock.FileLock(str(Path(exp_dir) / ".driver.lock"))


def is_driven(exp_dir: str) -> bool:
    """Whether a driver holds the experiment's lock now."""
    lock = driver_lock(exp_dir)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return True
    lock.release()
    return False


def settle_undriven(app: App) -> None:
    """Pause each of the caller's local experiments whose driver has ended (a kill in progress
    goes on) and step it once, so that its state says what happened. Runs still checkpointing
    are stepped again by the next read. One query when nothing is undriven."""
    for exp_id, exp_dir in app.reads.with_live_runs(EXECUTOR, os_user()):
        lock = driver_lock(exp_dir)
        try:
            lock.acquire(timeout=0)
        except (filelock.Timeout, OSError):
            continue  # driven: its driver steps it (or its dir is gone: nothing to step)
        try:
            _settle(app, exp_id)
        finally:
            lock.release()


def _settle(app: App, exp_id: int) -> None:
    # Only here, once a driver has died: the controller is what a read otherwise never loads.
    from detslurm.controller.apply import note
    from detslurm.controller.controller import Controller
    from detslurm.controller.local import LocalExecutor

    with app.store.read() as s:
        was = views.experiment_state(s, exp_id, app.scope)
    if was == ExperimentState.ACTIVE:
        ops.pause(app.store, exp_id)
        why = f"the det process that ran experiment {exp_id} ended: paused (det e activate {exp_id} resumes it)"
        with app.store.tx() as s:
            for t in views.get_experiment(s, exp_id, app.scope).trials:
                if not t.state.is_terminal:
                    note(s, t.id, why, "WARNING")
        # stderr: `det e list --json` keeps its stdout for the JSON.
        with contextlib.suppress(OSError):
            click.echo(f"Experiment {exp_id}: {why}", err=True)
    # A paused experiment submits nothing: this step only reads how the runs ended.
    Controller(app.store, LocalExecutor(app.settings.max_local_trials)).tick_experiment(exp_id)
