"""CLI glue for Slurm experiments: one-step reconciles for reads, submitting now, waiting."""

from __future__ import annotations

from typing import TYPE_CHECKING

from detslurm import daemon as daemon_mod
from detslurm.cli import undriven
from detslurm.cli.app import App
from detslurm.cli.lazy import lazy_module
from detslurm.identity import os_user
from detslurm.util import detached_root

# Loaded on first use (cli/lazy.py): `det e list` and the other reads must not pay for the
# ORM, the controller or pydantic (the read layer, store.reads, needs none of them).
if TYPE_CHECKING:
    from detslurm import views
    from detslurm.controller.slurm_executor import SlurmExecutor
    from detslurm.store.models import ExperimentState
else:
    views = lazy_module("detslurm.views")

# The executor name `det e create` stores for Slurm experiments.
EXECUTOR = "slurm"


def reconcile(app: App) -> None:
    """Reads with no daemon running do one reconcile step themselves (so state is current),
    on the store, client and site this command has open already."""
    # Local experiments whatever runs: no daemon drives them, and one whose driver died is paused
    # here rather than listed ACTIVE with nothing behind it.
    undriven.settle_undriven(app)
    # A running daemon keeps the store current; a second reconcile would only compete for
    # the controller lock and add Slurm calls.
    if daemon_mod.running_pid(app.settings) is not None:
        return
    # Only the caller's own unfinished experiments: with nothing to reconcile, a read command
    # makes no Slurm call at all (and works while slurmctld is down).
    unfinished = app.reads.has_unfinished(EXECUTOR, os_user())
    # Detached runs (the user's own sbatch scripts) register on the shared filesystem at any
    # time: once the dir exists, a read looks there too (one directory scan).
    if not (unfinished or detached_root(app.settings.experiments_dir).is_dir()):
        return
    site = app.site()
    # The same floor as the daemon's: many users' read commands in a loop (`watch det e list`)
    # must not poll slurmctld faster than the site allows; a read within it shows the last poll.
    floor = max(site.poll_interval_s, app.settings.poll_interval_s)
    if daemon_mod.claim_poll(app.store, os_user(), floor):
        daemon_mod.reconcile_once(app.settings, store=app.store, client=app.client, site=site)


def submit_now(app: App, executor: SlurmExecutor | None = None) -> None:
    """One tick right away, so a new or re-activated experiment's jobs are queued before we
    return; with ``executor``, the one a create planned its first submission with."""
    daemon_mod.reconcile_once(app.settings, store=app.store, client=app.client, site=app.site(), executor=executor)


def wait(app: App, exp_id: int) -> ExperimentState:
    """Poll (reconciling when no daemon does) until the experiment ends."""

    def step() -> ExperimentState | None:
        # If the daemon stopped (or was never started) the waiter itself keeps the state moving.
        reconcile(app)
        with app.store.read() as s:
            state = views.experiment_state(s, exp_id, app.scope)
        return state if state.is_terminal else None

    return app.poll_until(step)
