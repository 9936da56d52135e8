"""The state changes of `det e pause/activate/cancel/kill` and `det t kill`, each done whole in
one place: the store's row first (controller/ops.py), then what should not wait for the daemon's
next tick. A kill cancels every live job of what it killed and a pause the jobs still queued,
at once; an activate starts the owner's daemon (a Slurm experiment) or, unless detached, drives
a local experiment here. The CLI's commands, the dashboard's buttons and the Python SDK
(detslurm/client, on the login node too when it runs over ssh://) all call these.

What they say goes through ``echo`` (click.echo's shape): the CLI prints it, the SDK logs it
(over ssh:// the login node's stdout carries the answer, nothing else).
"""

from __future__ import annotations

import enum
import logging
import os
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from detslurm.cli.app import App


class Echo(Protocol):
    """click.echo's shape (controller/create.py's Echo too)."""

    def __call__(self, message: str, *, nl: bool = True, err: bool = False) -> object: ...


def log_echo(logger: str) -> Echo:
    """An echo into the log (``err``: a warning) for callers without a terminal of their own."""

    def echo(message: str, *, nl: bool = True, err: bool = False) -> None:
        logging.getLogger(logger).log(logging.WARNING if err else logging.INFO, "%s", message.rstrip("\n"))

    return echo


class Verb(str, enum.Enum):
    """The experiment state changes, each named as its `det e` command and its controller/ops.py function."""

    ACTIVATE = "activate"
    PAUSE = "pause"
    CANCEL = "cancel"
    KILL = "kill"


_PAST = {Verb.ACTIVATE: "Activated", Verb.PAUSE: "Paused", Verb.CANCEL: "Canceled", Verb.KILL: "Killed"}


def change_state(app: App, verb: Verb, exp_id: int, *, detach: bool, echo: Echo) -> None:
    """`det e <verb> EXP_ID`: ``detach`` only for activate (a local experiment is then only
    marked active, not driven by this process)."""
    from detslurm.controller import ops

    verb = Verb(verb)
    if verb == Verb.ACTIVATE:
        _activate(app, exp_id, detach=detach, echo=echo)
        return
    getattr(ops, verb.value)(app.store, exp_id, app.scope)
    echo(f"{_PAST[verb]} experiment {exp_id}")
    # A cancel lets the running trials checkpoint first: the daemon's tick asks them to. Queued
    # jobs on pause and every job on kill need no checkpoint: Slurm is told now.
    if verb in (Verb.PAUSE, Verb.KILL):
        stop_now(app, exp_id, kill=verb == Verb.KILL, echo=echo)


def kill_trial(app: App, trial_id: int, echo: Echo) -> None:
    """`det t kill TRIAL_ID`: the row, then the trial's live job canceled at once; the searcher
    sees the trial as ended early."""
    from detslurm import views
    from detslurm.controller import ops

    ops.kill_trial(app.store, trial_id, app.scope)
    echo(f"Killed trial {trial_id}")
    with app.store.read() as s:
        exp_id = views.get_trial(s, trial_id, app.scope).experiment_id
    stop_now(app, exp_id, kill=True, trial_id=trial_id, echo=echo)


def stop_now(app: App, exp_id: int, *, kill: bool, echo: Echo, trial_id: int | None = None) -> None:
    """Reach the scheduler at once after a kill or a pause, and say which jobs it canceled; a
    failure only warns (the state change is recorded, and the daemon's next tick carries it out)."""
    from detslurm.cli import backend
    from detslurm.errors import DetSlurmError

    try:
        jobs = backend.of_experiment(app, exp_id).stop_now(exp_id, kill=kill, trial_id=trial_id)
    except DetSlurmError as e:
        echo(f"Warning: Slurm could not be told at once ({e}); the daemon will do it at its next tick", err=True)
        return
    if jobs:
        what = "job" if len(jobs) == 1 else "jobs"
        echo(f"Canceled Slurm {what} {', '.join(jobs)}" + ("" if kill else " (queued, not started yet)"))


def _activate(app: App, exp_id: int, *, detach: bool, echo: Echo) -> None:
    from detslurm.cli import backend
    from detslurm.controller import in_allocation, ops

    # Moved while still paused: the daemon never starts a run in an allocation that has ended.
    where = in_allocation.rebind(
        app.store, exp_id, app.scope, os.environ.get("SLURM_JOB_ID"), lambda job: _still_held(app, job)
    )
    ops.activate(app.store, exp_id, app.scope)
    echo(f"Activated experiment {exp_id}" + (f": {where}" if where else ""))
    # Marked ACTIVE first: a local experiment is then driven in the foreground, a Slurm one by
    # the daemon this starts.
    note = backend.of_experiment(app, exp_id).resume(exp_id, detach=detach)
    if note:
        echo(f"Experiment {exp_id}: {note}")


def _still_held(app: App, job: str) -> bool:
    """Whether trials may still start in held job ``job`` (one scontrol call)."""
    from detslurm.controller.step_executor import StepExecutor

    steps = StepExecutor(app.client, app.site())
    return steps.ending(job, steps.allocation(job)) is None
