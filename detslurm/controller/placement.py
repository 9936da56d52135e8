"""Where a new experiment's trials run, as its create (controller/create.py) needs to know it:
on Slurm, or as processes of this machine. The CLI picks one (cli/backend.py); the create asks
it the same questions either way and never compares executor names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from detslurm.controller.create import CreatePlan, Placement, dry_run
from detslurm.controller.executor import RunSpec, SchedulerUnavailable
from detslurm.controller.local import LocalExecutor
from detslurm.controller.slurm_executor import SlurmExecutor
from detslurm.controller.slurm_plan import Submission
from detslurm.errors import ConfigError
from detslurm.settings import Settings
from detslurm.slurm import pilot_job
from detslurm.slurm.containers import Gpu, Runtime
from detslurm.slurm.parse import experiment_tag
from detslurm.slurm.refusals import RequestRefused, site_limit_refusals
from detslurm.slurm.render import container_warnings, image_for, resource_plan
from detslurm.store import Store

if TYPE_CHECKING:
    from detslurm.slurm.client import SlurmClient
    from detslurm.slurm.site import SiteConfig


class Place(Protocol):
    """What differs between Slurm and local trials for a create, asked in this order."""

    @property
    def kind(self) -> str:
        """The executor name stored with the experiment (Experiment.executor)."""
        ...

    def check(self, plan: CreatePlan) -> Placement:
        """``plan`` placed here: raise ConfigError for what this place can never run (an unknown
        pool); what the rest of the create needs (the resource plan), and a warning for each
        setting of the config this place does not apply."""
        ...

    def refuse_impossible(self, store: Store, settings: Settings, placed: Placement, *, offline: bool) -> list[str]:
        """Raise RequestRefused when the first jobs could never run; notes on what may delay them."""
        ...

    def show(self, store: Store, settings: Settings, placed: Placement) -> str:
        """What the first submission would run, built by the code that submits (the dry run)."""
        ...

    def require_reachable(self) -> None:
        """Fail before anything exists when the scheduler cannot be reached."""
        ...

    def submit(self, placed: Placement) -> None:
        """The first submission of what was just stored."""
        ...


class SlurmPlace:
    """Trials are Slurm jobs. The check computes the config's resource plan, once: the refusal
    check, the dry run and the first submission plan with executors given it. ``submit`` is one
    tick of the user's controller with such an executor (taken under the controller lock by the
    caller, which owns the daemon): it queues the new experiment's jobs."""

    kind = SlurmExecutor.kind

    def __init__(self, client: SlurmClient, site: SiteConfig, submit: Callable[[SlurmExecutor], None]) -> None:
        self.client = client
        self.site = site
        self._submit = submit

    def check(self, plan: CreatePlan) -> Placement:
        site, config = self.site, plan.config
        if config.slurm.in_allocation:
            # Job steps of a held job: its nodes, not a pool's, are where the trials run.
            return Placement(plan, tuple(_ignored_in_allocation(plan)))
        if config.slurm.pilots is not None:
            errors = pilot_job.shape_errors(config, site)
            if errors:
                raise ConfigError(errors)
            # The workers' jobs are what Slurm is asked for: their shape is checked.
            config = pilot_job.worker_config(config)
        res = resource_plan(config, site)  # an unknown pool fails here, before anything exists
        if site.container_runtime != Runtime.NONE:
            # An image map without this pool's device kind fails here too, not in the daemon.
            image_for(config, (Gpu.AMD if site.container.gpu_vendor == "amd" else Gpu.NVIDIA) if res.gpu else Gpu.NONE)
        if config.environment.image and not site.runs_containers:
            # Said rather than running the trial outside the image silently.
            warnings = [
                "environment.image is ignored: this site has no container_runtime; "
                "trials run with this machine's own Python"
            ]
        else:
            warnings = container_warnings(config, site)
        return Placement(plan, tuple(warnings), res)

    def _executor(self, placed: Placement, *, offline: bool = False) -> SlurmExecutor:
        """An executor that plans the create's config with the resource plan its check made."""
        res = placed.resources
        planned = (placed.plan.config, res) if res is not None else None
        return SlurmExecutor(self.client, self.site, offline=offline, planned=planned)

    def refuse_impossible(self, store: Store, settings: Settings, placed: Placement, *, offline: bool) -> list[str]:
        # The jobs the create would submit, planned by the code that submits them; for a paused
        # experiment, the ones `det e activate` will queue. A dry run may be offline: with no
        # Slurm in reach it checks nothing rather than fail.
        if placed.plan.config.slurm.in_allocation:
            return self._refuse_in_allocation(placed, offline=offline)
        # The site's locks first: they need no Slurm, so an offline dry run refuses them too.
        locked = site_limit_refusals(placed.plan.config, self.site)
        if locked:
            raise RequestRefused(locked)
        executor = self._executor(placed, offline=offline)
        active = dataclasses.replace(placed.plan, paused=False)
        # One shape, sampled: the create's first runs all share it (see create.dry_run).
        specs = dry_run(store, settings, active, executor, sample=True)
        subs = _workers(executor, specs) if active.config.slurm.pilots else executor.plan_many(specs)
        refusals = executor.refusals(subs)
        if refusals:
            raise RequestRefused(refusals)
        notes: list[str] = []
        if executor.nodes_away:
            names = ", ".join(executor.nodes_away)
            notes.append(f"Note: nodes {names} take no jobs now (down or drained); the jobs may wait for them")
        if executor.unchecked:
            notes.append(f"Warning: not checked against the cluster's limits ({executor.unchecked})")
        return notes

    def _refuse_in_allocation(self, placed: Placement, *, offline: bool) -> list[str]:
        """Trials that could never fit the held job are refused with its numbers."""
        try:
            refusals = self._executor(placed).steps.refusals(placed.plan.config)
        except SchedulerUnavailable as e:
            if not offline:
                raise
            return [f"Warning: not checked against the allocation ({e})"]
        if refusals:
            raise RequestRefused(refusals)
        return []

    def show(self, store: Store, settings: Settings, placed: Placement) -> str:
        """The sbatch command lines and scripts, as a runnable shell script (heredocs); for an
        in-allocation experiment, the shells that start its job steps, placed as they would be now."""
        # offline: render what would be submitted without calling sbatch, through the same plan
        # code as the real submission.
        executor = self._executor(placed, offline=True)
        specs = dry_run(store, settings, placed.plan, executor)
        if placed.plan.config.slurm.in_allocation:
            return executor.steps.show(specs)
        if placed.plan.config.slurm.pilots:
            steps = "".join(f"# trial run {s.name}: a job step (srun --jobid) of a running worker\n" for s in specs)
            return "".join(sub.request.render() for sub in _workers(executor, specs)) + steps
        return "".join(sub.request.render() for sub in executor.plan_many(specs))

    def require_reachable(self) -> None:
        # Any Slurm call proves slurmctld answers; capabilities() is cached for the process, so the
        # submission that follows does not pay for it again.
        self.client.capabilities()

    def submit(self, placed: Placement) -> None:
        self._submit(self._executor(placed))


def _workers(executor: SlurmExecutor, specs: list[RunSpec]) -> list[Submission]:
    """The pilot workers' array that the first runs of ``specs`` (one experiment) wait for, as
    one submission: what the create's refusal check and its dry run look at."""
    if not specs:
        return []
    first = specs[0]
    config = pilot_job.worker_config(first.config)
    assert first.config.slurm.pilots is not None
    res = executor.resources(config)
    exp_dir = first.exp_dir
    request = pilot_job.plan_workers(
        config=first.config,
        res=res,
        exp_id=first.identity[0],
        exp_dir=exp_dir,
        tag=experiment_tag(str(exp_dir)),
        count=first.config.slurm.pilots.count,
    )
    return [Submission(request, (dataclasses.replace(first, config=config),), res)]


def _ignored_in_allocation(plan: CreatePlan) -> list[str]:
    """Settings of a pool's jobs that job steps of a held job do not apply, one line each."""
    config = plan.config
    ignored = [
        name
        for name, value in (
            ("resources.resource_pool", config.resources.resource_pool),
            ("resources.priority", config.resources.priority),
            ("resources.max_slots", config.resources.max_slots),
            ("slurm.sbatch_args", config.slurm.sbatch_args),
        )
        if value
    ]
    if not ignored:
        return []
    return [f"{', '.join(ignored)}: not applied to job steps of allocation {config.slurm.allocation_id}"]


class LocalPlace:
    """Trials are processes of this machine, started by the `det` that drives the experiment."""

    kind = LocalExecutor.kind

    def __init__(self, max_local_trials: int) -> None:
        self.max_local_trials = max_local_trials

    def check(self, plan: CreatePlan) -> Placement:
        if plan.config.environment.image:
            return Placement(
                plan, ("environment.image is ignored: --local runs trials with this machine's own Python",)
            )
        return Placement(plan)  # no pools, no partitions

    def refuse_impossible(self, store: Store, settings: Settings, placed: Placement, *, offline: bool) -> list[str]:
        return []  # max_local_trials queues them: nothing is ever impossible

    def show(self, store: Store, settings: Settings, placed: Placement) -> str:
        specs = dry_run(store, settings, placed.plan, LocalExecutor(self.max_local_trials))
        return "".join(f"# local trial run {s.name}: {' '.join(s.argv)} (in {s.run_dir})\n" for s in specs)

    def require_reachable(self) -> None:
        pass

    def submit(self, placed: Placement) -> None:
        pass  # local trials are children of their driver: it starts them as it runs the experiment
