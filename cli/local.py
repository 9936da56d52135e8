"""Driving a local experiment in the foreground (``det e create --local``).

The `det` process that drives a local experiment is the only thing that starts and watches its
trials: no daemon does. So the experiment lives as long as its foreground, and every way the
foreground ends pauses it with a checkpoint, never strands it:

- Ctrl-C, SIGHUP (a closed terminal, an SSH session that dropped), SIGTERM (``kill``), and an
  output that went away (``| head`` closed its end of the pipe): the driver pauses the
  experiment as `det e pause` does, waits until the trials have checkpointed and exited, and
  leaves. A second Ctrl-C kills instead (see :class:`_Stops`).
- Any other end, SIGKILL included: the kernel sends each trial's launcher the preemption signal
  (controller/local.py), so the trials checkpoint and exit all the same, and the next read
  (`det e list`, `det e describe`, ...) finds the experiment without a driver and pauses it
  (cli/undriven.py).

`det e activate` resumes it from the checkpoints in a new foreground. A driver started with
SIGHUP ignored (``nohup det e create --local ... &``) outlives the terminal.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from detslurm.cli import logs as logs_mod
from detslurm.cli import outcome
from detslurm.cli.app import App
from detslurm.cli.lazy import lazy_module

# The executor name `det e create --local` stores (cli/backend.py reads it here).
from detslurm.cli.undriven import EXECUTOR as EXECUTOR
from detslurm.cli.undriven import driver_lock
from detslurm.errors import StateError
from detslurm.identity import os_user
from detslurm.store.states import ExperimentState, TrialState

# Loaded on first use: `det e create` and the other commands that import this module may never drive.
if TYPE_CHECKING:
    import filelock

    from detslurm import views
    from detslurm.controller import ops
    from detslurm.controller.controller import Controller
else:
    filelock = lazy_module("filelock")
    views = lazy_module("detslurm.views")
    ops = lazy_module("detslurm.controller.ops")


def drive(
    app: App, exp_id: int, follow: bool = False, quiet: bool = False, on_driving: Callable[[], None] | None = None
) -> ExperimentState:
    """Run the experiment's trials as local processes until it ends or is paused.
    ``on_driving`` is called once this process holds the experiment's driver lock.

    Raises StateError when another process drives it already (one driver per experiment), or
    when it is another user's (root's --all-users may change it, never run it: its trials would
    run as root)."""
    with app.store.read() as s:
        exp = views.get_experiment(s, exp_id, app.scope)
        owner, exp_dir = exp.owner, exp.exp_dir
    if owner != os_user():
        raise StateError(f"experiment {exp_id} belongs to {owner}; only its owner's detslurm runs its trials")
    lock = driver_lock(exp_dir)
    try:
        # Fail at once rather than wait: two drivers would each start the same trials.
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise StateError(f"experiment {exp_id} is already being run by another detslurm process") from None
    try:
        if on_driving is not None:
            on_driving()
        return _loop(app, exp_id, follow, quiet)
    finally:
        lock.release()


class _Round:
    """One polling round of the driver: tick, report trial state changes, pump the follower."""

    def __init__(self, app: App, ctl: Controller, exp_id: int, follow: bool, quiet: bool, stops: _Stops) -> None:
        self.app, self.ctl, self.exp_id = app, ctl, exp_id
        self.follow, self.quiet = follow, quiet
        self.stops = stops
        # Last state printed per trial: a line is printed only on a change, not every poll.
        self.seen: dict[int, str] = {}
        self.follower: logs_mod.Follower | None = None

    def __call__(self) -> ExperimentState | None:
        if _silence_closed_outputs():
            self.stops.end("its output was closed")
        # First stop request (Ctrl-C, or the foreground's end): pause (trials checkpoint and
        # stop; polling goes on until they did). Second: kill the processes now, and poll on
        # until the kill is recorded.
        while (request := self.stops.take()) is not None:
            if request == 1:
                _pause(self.app, self.exp_id, self.stops.ended)
            else:
                _kill_all(self.app, self.ctl, self.exp_id)
        # Only this experiment: other local experiments belong to the `det` processes driving them.
        self.ctl.tick_experiment(self.exp_id)
        with self.app.store.read() as s:
            state, trials, busy = views.drive_snapshot(s, self.exp_id, self.app.scope)
        if not self.quiet:
            _say(lambda: self._report(trials), self.stops)
        if self.follow and self.follower is None and trials:
            # The lowest id is the first trial created, the one Determined's --follow-first-trial shows.
            self.follower = logs_mod.Follower(self.app, min(trials))
            _say(lambda: click.echo(f"Following first trial with ID {min(trials)}"), self.stops)
        if self.follower is not None:
            _say(self.follower.pump, self.stops)
        # Paused counts as done only once its trials have checkpointed and exited.
        if not (state.is_terminal or (state == ExperimentState.PAUSED and not busy)):
            return None
        if self.follower is not None:
            follower = self.follower
            _say(follower.pump, self.stops)
            told = f"Trial log stream ended. To reopen log stream, run: det trial logs -f {follower.trial_id}"
            _say(lambda: click.echo(told), self.stops)
        return state

    def _report(self, trials: dict[int, str]) -> None:
        for tid, st in sorted(trials.items()):
            if self.seen.get(tid) != st:
                # A failure is told with why and the trial's last traceback lines.
                shown = [f"trial {tid}: {st}"]
                if st == TrialState.ERROR:
                    shown = outcome.trial_failure(self.app, self.app.reads.trial(tid, self.app.scope.owner))
                click.echo("\n".join(shown))
                self.seen[tid] = st


def _loop(app: App, exp_id: int, follow: bool, quiet: bool) -> ExperimentState:
    # The controller and its executor are imported here: reads that never drive skip them.
    from detslurm.controller.controller import Controller
    from detslurm.controller.local import LocalExecutor

    # max_local_trials caps concurrent trial processes: this machine has no scheduler to queue them.
    ctl = Controller(app.store, LocalExecutor(app.settings.max_local_trials))
    with _Stops() as stops:
        told = (
            f"Experiment {exp_id} runs in this process: Ctrl-C, closing the terminal or the SSH session, or "
            f"ending this process pauses it once its trials checkpoint (det e activate {exp_id} resumes it)."
        )
        _say(lambda: click.echo(told, err=True), stops)
        return app.poll_until(_Round(app, ctl, exp_id, follow, quiet, stops))


class _Stops:
    """Requests to stop, noted by signal handlers and acted on between rounds (_Round): a
    KeyboardInterrupt raised inside a store transaction could leave the store locked for the
    very pause or kill the request asks for.

    The first request pauses, the second kills, a third leaves at once. Ctrl-C is a request each
    time. The foreground's end (SIGHUP, SIGTERM, its output closed) is the first request when it
    comes first, and nothing more: a terminal that closes while the trials checkpoint must not
    turn the pause into a kill."""

    LEAVE = 3

    def __init__(self) -> None:
        self.count = 0
        self.handled = 0
        self.ended: str | None = None  # why the foreground ended, once it has
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Stops:
        # Only in the main thread (signal refuses others), and never over an ignored signal: a
        # background job of a script ignores SIGINT, and `nohup det ...` asks to outlive the terminal.
        if threading.current_thread() is threading.main_thread():
            handlers: dict[int, Callable[[int, object], None]] = {
                signal.SIGINT: self._press,
                signal.SIGHUP: self._signalled,
                signal.SIGTERM: self._signalled,
            }
            for signum, handler in handlers.items():
                if signal.getsignal(signum) != signal.SIG_IGN:
                    self.previous[signum] = signal.signal(signum, handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _press(self, signum: int, frame: object) -> None:
        self.count += 1
        if self.count >= self.LEAVE:
            raise KeyboardInterrupt

    def _signalled(self, signum: int, frame: object) -> None:
        self.end(f"it got {signal.Signals(signum).name}")

    def end(self, why: str) -> None:
        """The foreground ended (``why``): a first request, unless one came before."""
        if self.ended is None:
            self.ended = why
            self.count = max(self.count, 1)

    def take(self) -> int | None:
        """The number of the next request not acted on yet (1 for the first), or None."""
        if self.handled >= self.count:
            return None
        self.handled += 1
        return self.handled


def _say(write: Callable[[], None], stops: _Stops) -> None:
    """Run ``write`` (output to the user); an output that has gone (a closed pipe: EPIPE, a
    hung-up terminal: EIO) ends the foreground instead of the driver."""
    try:
        write()
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.EIO):
            raise
        _silence_closed_outputs(all_of_them=True)
        stops.end("its output was closed")


def _silence_closed_outputs(all_of_them: bool = False) -> bool:
    """Point stdout and stderr at /dev/null where their reader has gone (a pipe whose reader
    closed it, a hung-up terminal), so that what the driver still writes while the trials
    checkpoint, and at its end, cannot fail; whether one had gone. ``all_of_them``: both, for
    a write that failed where poll could not tell which."""
    closed = [1, 2] if all_of_them else _closed_fds((1, 2))
    if closed:
        # What is buffered goes first, so that it cannot fail again later (at exit, say).
        with contextlib.suppress(ValueError, OSError):
            sys.stdout.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in closed:
            os.dup2(null, fd)
        os.close(null)
    return bool(closed)


def _closed_fds(fds: tuple[int, ...]) -> list[int]:
    # Linux reports POLLERR on a pipe's write end once no reader is left, and POLLHUP on a
    # terminal that hung up: known without writing (the driver may write nothing for hours).
    if not hasattr(select, "poll"):
        return []
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLOUT)
    return [fd for fd, ev in poller.poll(0) if ev & (select.POLLERR | select.POLLHUP)]


def _pause(app: App, exp_id: int, ended: str | None) -> None:
    # Pausing goes through the store, like `det e pause`: the next tick asks the trials to
    # checkpoint (preemption), so the experiment can be activated later without lost work.
    why = f"This process is ending ({ended})" if ended is not None else "Ctrl-C"
    try:
        ops.pause(app.store, exp_id)
    except StateError:
        # Already stopping (a cancel, a failed search): there is nothing to pause, only to wait for.
        with app.store.read() as s:
            state = views.experiment_state(s, exp_id, app.scope)
        what = f"{why}: experiment {exp_id} is {state.value}, waiting for its trials to stop"
        _tell(f"\n{what} (Ctrl-C again to kill them).")
        return
    _tell(
        f"\n{why}: pausing experiment {exp_id}: trials checkpoint and stop (Ctrl-C again to kill them; "
        f"det e activate {exp_id} resumes it)."
    )


def _tell(text: str) -> None:
    # stderr may be as gone as stdout (`2>&1 | head`, a closed terminal): the pause goes on unsaid.
    with contextlib.suppress(OSError):
        click.echo(text, err=True)


def _kill_all(app: App, ctl: Controller, exp_id: int) -> None:
    """The second Ctrl-C: `det e kill`, carried out at once. Recorded before the processes die,
    so their ends read as this kill (the trials end CANCELED, no restart spent), never as
    crashes found by the next `det e activate`."""
    _tell(f"\nKilling experiment {exp_id} (Ctrl-C again to leave without waiting for it).")
    ops.kill(app.store, exp_id)
    with app.store.read() as s:
        jobs = views.active_job_ids(s, exp_id, app.scope)
    ctl.executor.kill_many(jobs)
