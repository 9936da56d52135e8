"""Where an experiment runs, chosen once at the edge: Slurm (a per-user daemon drives it in the
background) or local processes (this `det` process drives it in the foreground).

Commands hold a :class:`Backend` and never compare executor names; this module is the only
place that maps the name stored with an experiment to its backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import click

from detslurm import daemon as daemon_mod
from detslurm import views
from detslurm.cli import local as local_mod
from detslurm.cli import logs as logs_mod
from detslurm.cli import outcome, undriven
from detslurm.cli import slurm as slurm_mod
from detslurm.cli.app import App
from detslurm.errors import DetSlurmError
from detslurm.identity import os_user
from detslurm.store.models import ExperimentState

if TYPE_CHECKING:
    from detslurm.controller.placement import Place


# A Protocol rather than a base class: the two backends share no code, only the shape the
# commands rely on, and tests may pass any object of that shape.
class Backend(Protocol):
    """What the CLI does differently for Slurm and local experiments."""

    @property
    def executor(self) -> str:
        """The executor name stored with the experiment (Experiment.executor)."""
        ...

    def place(self) -> Place:
        """Where a new experiment's trials run, for controller/create.py."""
        ...

    def after_create(self, exp_id: int, *, paused: bool, follow: bool, test_mode: bool) -> int:
        """Start the new experiment and stay with it as asked; the exit code of `det e create`."""
        ...

    def resume(self, exp_id: int, *, detach: bool) -> str | None:
        """Carry on with an experiment that was just activated; a note for the user, if any."""
        ...

    def wait(self, exp_id: int) -> ExperimentState:
        """Block until the experiment ends; its final state."""
        ...

    def stop_now(self, exp_id: int, *, kill: bool, trial_id: int | None = None) -> list[str]:
        """After `det e kill` (every live job), `det t kill` (the trial's) or `det e pause` (jobs
        not started yet): reach the scheduler at once instead of at the next tick; the job ids
        acted on."""
        ...

    def reprioritize(self, job_ids: list[str], priority: int, workers_of: tuple[int, str] | None = None) -> None:
        """Give the experiment's live jobs a new priority now (`det e set priority`), and its
        pilot workers (``workers_of``: the experiment's id and tag) those waiting in the queue."""
        ...

    def throttle(self, job_ids: list[str], max_slots: int, slots_per_trial: int) -> list[str]:
        """Apply a new max_slots to the experiment's live job arrays now; the arrays changed."""
        ...


class SlurmBackend:
    """Trials are Slurm jobs; the per-user daemon submits and watches them."""

    executor = slurm_mod.EXECUTOR

    def __init__(self, app: App) -> None:
        self.app = app

    def place(self) -> Place:
        from detslurm.controller.placement import SlurmPlace

        # The first submission is one tick in this process (under the controller lock), so the
        # jobs are in Slurm's queue when `det e create` returns; the daemon then takes over.
        return SlurmPlace(self.app.client, self.app.site(), lambda executor: slurm_mod.submit_now(self.app, executor))

    def after_create(self, exp_id: int, *, paused: bool, follow: bool, test_mode: bool) -> int:
        if paused:
            return 0  # `det e activate` starts it later
        pid = daemon_mod.start(self.app.settings)
        click.echo(f"detslurm daemon running (pid {pid})")
        if test_mode:
            return test_mode_report(self.app, exp_id, slurm_mod.wait(self.app, exp_id))
        if follow:
            logs_mod.follow_first_trial(self.app, exp_id)
            # The output was streamed; why the trial or the experiment failed was not.
            for line in outcome.after_follow(self.app, exp_id):
                click.echo(line)
        return 0

    def resume(self, exp_id: int, *, detach: bool) -> str | None:
        # Starting our daemon for someone else's experiment would run their trials as us.
        if is_mine(self.app, exp_id):  # another user's (root's --all-users) is their daemon's to run
            daemon_mod.start(self.app.settings)  # the daemon runs it; there is nothing to detach from
        return None

    def wait(self, exp_id: int) -> ExperimentState:
        return slurm_mod.wait(self.app, exp_id)

    def stop_now(self, exp_id: int, *, kill: bool, trial_id: int | None = None) -> list[str]:
        from detslurm.controller import ops
        from detslurm.controller.slurm_executor import SlurmExecutor

        executor = SlurmExecutor(self.app.client, self.app.site())
        # One scancel for all of them (batched by the executor), before this command returns.
        if kill:
            return ops.kill_jobs_now(self.app.store, exp_id, executor, self.app.scope, trial_id)
        return ops.cancel_queued_now(self.app.store, exp_id, executor, self.app.scope)

    def reprioritize(self, job_ids: list[str], priority: int, workers_of: tuple[int, str] | None = None) -> None:
        from detslurm.controller.step_executor import is_step
        from detslurm.queue import nice_for
        from detslurm.slurm.pilot_job import worker_of
        from detslurm.slurm.states import SlurmState

        client = self.app.client
        # Job steps of a held job have no priority of their own (the job's is the user's, or
        # the pilot worker's, found below).
        job_ids = [j for j in job_ids if not is_step(j)]
        if workers_of is not None:
            queued = [q for q in client.squeue() if q.state == SlurmState.PENDING]
            job_ids += [q.job_id for q in queued if worker_of(q.comment) == workers_of]
        if not job_ids:
            return
        nice = nice_for(priority)
        if nice < 0 and not client.may_raise_priority():
            # Slurm lets ordinary users only lower their jobs' priority (a positive nice).
            click.echo(
                f"Warning: priority {priority} is above the default (42); Slurm lets only operators raise a job's "
                "priority, so its jobs stay at the default",
                err=True,
            )
            nice = 0
        client.update(job_ids, Nice=str(nice))  # one scontrol call for all of them

    def throttle(self, job_ids: list[str], max_slots: int, slots_per_trial: int) -> list[str]:
        from detslurm.controller.step_executor import is_step
        from detslurm.slurm.render import array_throttle

        # Array tasks are "ARRAY_TASK"; the throttle belongs to the array, so one update per array
        # (0 lifts the limit, as an array submitted without max_slots has none). Job steps of a
        # held job belong to no array.
        arrays = sorted({j.split("_", 1)[0] for j in job_ids if "_" in j and not is_step(j)}, key=int)
        if arrays:
            n = array_throttle(max_slots, slots_per_trial)
            self.app.client.update(arrays, ArrayTaskThrottle=str(n))
        return arrays


class LocalBackend:
    """Trials are processes of this machine, driven by the `det` process that runs them."""

    executor = local_mod.EXECUTOR

    def __init__(self, app: App) -> None:
        self.app = app

    def place(self) -> Place:
        from detslurm.controller.placement import LocalPlace

        return LocalPlace(self.app.settings.max_local_trials)

    def after_create(self, exp_id: int, *, paused: bool, follow: bool, test_mode: bool) -> int:
        if paused:
            return 0
        if test_mode:
            click.echo("Testing training, validation and checkpointing")
        # Local trials are children of this process: there is no daemon, so `det e create --local`
        # stays in the foreground until the experiment stops.
        state = local_mod.drive(self.app, exp_id, follow=follow, quiet=test_mode)
        if test_mode:
            return test_mode_report(self.app, exp_id, state)
        # The failed trials were told as they failed (local.drive): only the experiment's end here.
        click.echo("\n".join(outcome.experiment_end(self.app, exp_id, state, trials=False)))
        # PAUSED counts as success: the user (or `det e pause` from another shell) asked for it.
        return 0 if state in (ExperimentState.COMPLETED, ExperimentState.PAUSED) else 1

    def resume(self, exp_id: int, *, detach: bool) -> str | None:
        if not is_mine(self.app, exp_id):  # only the owner runs its trials
            return None
        if detach:
            # Never ACTIVE with nothing behind it: a driver of its own, in the background.
            from detslurm.cli import background_driver

            with self.app.store.read() as s:
                exp_dir = views.get_experiment(s, exp_id, self.app.scope).exp_dir
            try:
                log = background_driver.start(self.app, exp_id, exp_dir)
            except DetSlurmError:
                # Back to PAUSED unless another driver runs it: never ACTIVE with nothing behind it.
                if not undriven.is_driven(exp_dir):
                    from detslurm.controller import ops

                    ops.pause(self.app.store, exp_id, self.app.scope)
                raise
            return f"it runs in the background; its driver's output: {log}"
        state = local_mod.drive(self.app, exp_id)
        click.echo("\n".join(outcome.experiment_end(self.app, exp_id, state, trials=False)))
        return None

    def stop_now(self, exp_id: int, *, kill: bool, trial_id: int | None = None) -> list[str]:
        return []  # local trials are children of the `det` driving them; its next round stops them

    def reprioritize(self, job_ids: list[str], priority: int, workers_of: tuple[int, str] | None = None) -> None:
        pass  # no scheduler queue: local trials start as soon as there is room

    def throttle(self, job_ids: list[str], max_slots: int, slots_per_trial: int) -> list[str]:
        return []  # max_local_trials, not max_slots, bounds local trials

    def wait(self, exp_id: int) -> ExperimentState:
        """Drive it here while nobody else does; otherwise watch the store (another `det` drives it)."""
        # As every read: one whose driver ended is paused first (it waits for `det e activate`
        # then), not resumed in this waiter's foreground.
        undriven.settle_undriven(self.app)

        def step() -> ExperimentState | None:
            with self.app.store.read() as s:
                state = views.experiment_state(s, exp_id, self.app.scope)
            if state.is_terminal:
                return state
            # A paused experiment is not driven: resuming it is for `det e activate`, not for a waiter.
            if state != ExperimentState.PAUSED:
                # DetSlurmError: another process drives it (or cannot now): poll the store.
                with contextlib.suppress(DetSlurmError):
                    state = local_mod.drive(self.app, exp_id, quiet=True)
                if state.is_terminal:
                    return state
            return None

        return self.app.poll_until(step)


# Experiments of the user's own scripts (detslurm/controller/detached.py): recorded, never driven.
# Only `det e wait` reaches their backend (ops refuse pause/activate/cancel/kill): the Slurm
# backend's wait does the read's reconcile step, which ingests detached runs too.
DETACHED = "detached"
_BACKENDS: dict[str, Callable[[App], Backend]] = {
    SlurmBackend.executor: SlurmBackend,
    LocalBackend.executor: LocalBackend,
    DETACHED: SlurmBackend,
}


def for_create(app: App, *, local: bool) -> Backend:
    """The backend `det e create` asked for (--local or Slurm)."""
    return LocalBackend(app) if local else SlurmBackend(app)


def of_experiment(app: App, exp_id: int) -> Backend:
    """The backend an existing experiment was created with."""
    with app.store.read() as s:
        name = views.get_experiment(s, exp_id, app.scope).executor
    cls = _BACKENDS.get(name)
    if cls is None:
        # The name is read from the store, which a newer detslurm may have written: refuse clearly
        # instead of guessing a backend.
        raise DetSlurmError(f"experiment {exp_id} has executor {name!r}, which this detslurm cannot run")
    return cls(app)


def is_mine(app: App, exp_id: int) -> bool:
    """Whether the experiment is the caller's own (only then may this process run or tick it)."""
    with app.store.read() as s:
        return views.get_experiment(s, exp_id, app.scope).owner == os_user()


def test_mode_report(app: App, exp_id: int, state: ExperimentState) -> int:
    """`det e create --test-mode`'s verdict: 0 when the one trial did it all, else 1 with what it
    did, what it did not, and its logs."""
    code, lines = outcome.test_verdict(app, exp_id, state)
    click.echo("\n".join(lines), err=code != 0)
    return code
