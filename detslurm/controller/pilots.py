"""Pilot workers (``slurm.pilots``, docs/user/allocation.md): the daemon keeps as many worker
jobs as an experiment's runs need, up to ``count``, and runs the trial runs in them as job steps
(the step executor's ``srun --jobid``), so a run waits in the queue once per worker, not once
per start, restart, promotion and resume.

Each tick, after the experiments' steps, the controller says what each experiment with pilots
needs (a Demand: its runs running or waiting for a place). The pool reads the tick's one
squeue (shared with the Slurm executor), submits the missing workers as one array, cancels the
surplus (waiting workers first, then idle ones, never one a run is in; each once it has been
surplus for ``idle_timeout``) and renews the lease that keeps the workers' own scripts waiting
(slurm/pilot_job.py). A paused or ended experiment needs no runs: its workers end once their
trials have checkpointed and stopped, with no grace.

A worker that ends while a run is in it (its time limit, preemption, a node failure, a
``scancel``) stops that run as a held job's end does: the run is a preemption, its trial
continues from its checkpoint in another worker, and no restart is spent. Trial runs never go
to ordinary jobs: workers that Slurm could never start are refused at create (the same check as
a trial's job); one that waits only delays the trials, as a queued job would.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from detslurm.controller.executor import Demand, ExpRef, HoldingEnded, JobState, SchedulerUnavailable
from detslurm.controller.slurm_status import JOB_STATE
from detslurm.controller.step_executor import StepExecutor
from detslurm.expconf import ExperimentConfig
from detslurm.slurm.client import SlurmClient, SlurmCommandError, SlurmUnavailable
from detslurm.slurm.parse import QueuedJob, experiment_tag
from detslurm.slurm.pilot_job import lease_path, plan_workers, trials_per_worker, worker_config, worker_of
from detslurm.slurm.render import resource_plan
from detslurm.slurm.states import SlurmState

log = logging.getLogger("detslurm.controller.pilots")


@dataclass(frozen=True)
class Worker:
    """One worker job of the tick's queue: its array task id, its own job id (what ``srun
    --jobid`` takes) and whether it runs yet."""

    task_id: str
    job: str
    running: bool


class PilotPool:
    """The experiments' worker jobs, as the tick's squeue shows them."""

    def __init__(
        self,
        client: SlurmClient,
        steps: StepExecutor,
        queue: Callable[[], Mapping[str, QueuedJob]],
        may_raise_priority: Callable[[ExperimentConfig], bool],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.steps = steps
        self._queue = queue  # the tick's squeue answer (read at most once a tick)
        self._may_raise = may_raise_priority
        self._clock = clock
        self._renewed: dict[Path, float] = {}  # lease -> when this process last renewed it
        self._idle_since: dict[int, dict[str, float]] = {}  # experiment -> surplus task -> since
        self.calls_sbatch = 0  # worker arrays submitted (benchmarks and tests count them)

    # -- the workers of one experiment ----------------------------------------------------------
    def workers(self, exp: ExpRef) -> list[Worker]:
        """The experiment's workers that wait or run (ended ones are not listed). Raises
        SchedulerUnavailable when the queue cannot be read."""
        tag = experiment_tag(str(exp.dir))
        out: list[Worker] = []
        for q in self._queue().values():
            if worker_of(q.comment) != (exp.id, tag) or JOB_STATE[q.state] == JobState.EXITED:
                continue
            running = q.state == SlurmState.RUNNING
            job = str(q.raw_id)
            if running:
                self.steps.observe(job, "RUNNING")
            out.append(Worker(q.job_id, job, running))
        return out

    def running(self, exp: ExpRef) -> list[str]:
        """Job ids of the experiment's running workers, where its runs start as job steps."""
        return [w.job for w in self.workers(exp) if w.running]

    # -- keep as many as needed ---------------------------------------------------------------
    def settle(self, demands: Sequence[Demand]) -> list[tuple[int, str | HoldingEnded]]:
        """Submit and cancel workers for ``demands`` (one sbatch per experiment short of
        workers, one scancel for all surplus); (experiment, problem) for what failed, a
        HoldingEnded where the workers can never run the experiment's trials."""
        problems: list[tuple[int, str | HoldingEnded]] = []
        doomed: list[str] = []
        for demand in demands:
            try:
                doomed += self._settle_one(demand)
            except SchedulerUnavailable as e:
                log.warning("pilot workers of experiment %d: Slurm unreachable: %s", demand.exp.id, e)
                return problems
            except HoldingEnded as e:
                problems.append((demand.exp.id, e))
            except (SlurmCommandError, SlurmUnavailable, OSError) as e:
                problems.append((demand.exp.id, f"pilot workers could not be submitted: {e}"))
        if doomed:
            try:
                self.client.scancel(doomed)
            except (SlurmCommandError, SlurmUnavailable) as e:
                log.warning("could not cancel idle pilot workers %s: %s", doomed, e)
        return problems

    def _settle_one(self, demand: Demand) -> list[str]:
        pilots = demand.config.slurm.pilots
        assert pilots is not None
        workers = self.workers(demand.exp)
        # A worker past its last start (its end within the signal lead) counts no more: its
        # successor is queued while its runs checkpoint, and it goes once none runs in it
        # (else it would hold its nodes idle until its time limit).
        closed = [w for w in workers if w.running and not self._open(w.job)]
        spent = [w.task_id for w in closed if not self.steps.busy(w.job)]
        live = [w for w in workers if w not in closed]
        if demand.runs:
            self._check_fit(demand, live)
        wanted = min(pilots.count, math.ceil(demand.runs / trials_per_worker(demand.config)))
        if workers or demand.runs:
            self._renew(demand.exp.dir, pilots.idle_timeout)
        if len(live) < wanted:
            self._idle_since.pop(demand.exp.id, None)  # none is surplus now
            self._submit(demand, wanted - len(live))
            return spent
        # The surplus goes: waiting workers first, then running ones with no run in them.
        idle = [w for w in live if not w.running] + [w for w in live if w.running and not self.steps.busy(w.job)]
        return spent + self._past_grace(demand, [w.task_id for w in idle[: len(live) - wanted]])

    def _past_grace(self, demand: Demand, surplus: list[str]) -> list[str]:
        """Those of ``surplus`` (task ids) to cancel now. While the experiment has runs, a
        worker none of them needs is kept for ``idle_timeout``: an adaptive search's next trial
        or promotion often comes a tick or two after a run ends, and a worker canceled then is
        one queued again (the wait this mode exists to avoid). A paused or ended experiment
        keeps none."""
        pilots = demand.config.slurm.pilots
        assert pilots is not None
        now = self._clock()
        # Only this tick's surplus keeps its clock: a worker needed again, or gone, starts afresh.
        before = self._idle_since.pop(demand.exp.id, {})
        since = {task: before.get(task, now) for task in surplus}
        if demand.runs == 0:
            return surplus
        doomed = [task for task, t in since.items() if now - t >= pilots.idle_timeout]
        self._idle_since[demand.exp.id] = {task: t for task, t in since.items() if task not in doomed}
        return doomed

    def _check_fit(self, demand: Demand, live: list[Worker]) -> None:
        """Raise HoldingEnded when a running worker could never hold one of the experiment's
        trials: every worker has its shape, so its runs would wait forever. That happens when
        ``slurm.sbatch_args`` (or the site's defaults) give the workers less than the pilots
        section asks for; the create's check sees only what is asked."""
        for w in live:
            alloc = self.steps.allocation(w.job) if w.running else None
            why = self.steps.too_small(demand.config, alloc) if alloc is not None and alloc.running else None
            if why is not None:
                raise HoldingEnded(
                    f"pilot worker {w.task_id} is too small: {why} (slurm.sbatch_args or the site's"
                    " defaults give the workers less than slurm.pilots asks for)"
                )

    def _open(self, job: str) -> bool:
        try:
            return bool(self.steps.open_jobs([job]))
        except SchedulerUnavailable:
            return True  # unknown: counted as it was, rather than queue a successor early

    def _submit(self, demand: Demand, count: int) -> None:
        config, exp = demand.config, demand.exp
        request = plan_workers(
            config=config,
            res=resource_plan(worker_config(config), self.steps.site),
            exp_id=exp.id,
            exp_dir=exp.dir,
            tag=experiment_tag(str(exp.dir)),
            count=count,
            may_raise_priority=self._may_raise(config),
        )
        array = self.client.sbatch(request.args, request.script)
        self.calls_sbatch += 1
        log.info("experiment %d: %d pilot worker(s) submitted as array %s", exp.id, count, array)

    def _renew(self, exp_dir: Path, idle_timeout: int) -> None:
        """Renew the lease the workers wait on (at most four times per idle timeout: it is a
        write to a shared filesystem). Made before the first worker is submitted."""
        lease = lease_path(exp_dir)
        now = self._clock()
        last: Optional[float] = self._renewed.get(lease)
        if last is not None and now - last < idle_timeout / 4:
            return
        lease.parent.mkdir(mode=0o700, exist_ok=True)
        lease.touch(mode=0o600)
        os.utime(lease)
        self._renewed[lease] = now
