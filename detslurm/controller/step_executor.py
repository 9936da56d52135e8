"""Run trial runs as job steps of a job the user holds (``slurm.in_allocation``,
docs/user/allocation.md): ``srun --jobid=<held job>`` placed on its nodes and packed by slots.

The daemon starts each run as the batch script's shell (slurm/render.plan_step), run where the
daemon runs, outside the job: its srun line creates the step, and Slurm itself checks that the
job is ours. The shell writes the run's exit record when srun ends, as the batch shell does.

Observing costs no Slurm query per step: a run is alive while its shell's process is (pid and
start time, as for local runs) and has ended once its exit record is there. The held job itself
is read with one ``scontrol -d show job`` at most every ``ALLOCATION_TTL_S`` seconds, and again
when one of its runs ends (to tell a preemption from a failure). Its end is a preemption: from
``signal_lead_s`` before its time limit the running steps get the site's warning signal and
checkpoint, no new step starts, and the controller pauses the experiment (HoldingEnded).

The job id of such a run names the held job, where the run is placed (so that the packing
survives a daemon restart) and its shell: ``JOB/NODES/GPUS/CPUS/MEM/HOST/PID@START``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional

import hostlist
import psutil

from detslurm.controller.executor import (
    ExitCause,
    HoldingEnded,
    JobState,
    JobStatus,
    RunSpec,
    SchedulerUnavailable,
    SubmitLater,
    submit_each,
)
from detslurm.controller.files import write_marker
from detslurm.controller.local import _open_log
from detslurm.controller.slurm_status import ended, stop_signalled
from detslurm.expconf import ExperimentConfig
from detslurm.protocol import IMAGE_SOURCE, ExpPaths, RunPaths, exit_outcome, exit_record_of
from detslurm.slurm import container_lib
from detslurm.slurm.allocation import Allocation, Share, StepShape, fits_empty, place, room, step_shape, uses_gpus
from detslurm.slurm.client import SlurmClient, SlurmCommandError, SlurmUnavailable
from detslurm.slurm.containers import Runtime
from detslurm.slurm.parse import SlurmParseError, experiment_tag
from detslurm.slurm.refusals import CONFIG, Refusal, RefusalKind
from detslurm.slurm.render import ContainerPaths, Identity, ResourcePlan, StepRequest, plan_step
from detslurm.slurm.site import SiteConfig
from detslurm.slurm.states import SLURM_STATES, SlurmState

# How long an answer about a held job stands: its time limit may be changed (scontrol update),
# and its end is noticed by its steps ending in between.
ALLOCATION_TTL_S = 30.0
# How long after its held job's end a run's shell may still write its exit record: srun returns
# once Slurm has killed the step (KillWait, 30 s by default), and the shell writes at once.
LATE_RECORD_S = 60.0


def is_step(job_id: str) -> bool:
    """Whether a run's job id is a job step of a held job (a Slurm job id never holds "/")."""
    return "/" in job_id


@dataclass(frozen=True)
class StepRun:
    """A run started as a job step: the held job, its share of the nodes, and its shell."""

    job: str
    share: Share
    host: str
    pid: int
    started: float

    @property
    def id(self) -> str:
        s = self.share
        nodes = hostlist.collect_hostlist(list(s.nodes))
        return f"{self.job}/{nodes}/{s.gpus}/{s.cpus}/{s.mem_mb}/{self.host}/{self.pid}@{self.started:.3f}"

    @classmethod
    def parse(cls, job_id: str) -> Optional[StepRun]:
        try:
            job, nodes, gpus, cpus, mem, host, proc = job_id.split("/")
            pid, started = proc.split("@")
            share = Share(tuple(hostlist.expand_hostlist(nodes)), int(gpus), int(cpus), int(mem))
            return cls(job, share, host, int(pid), float(started))
        except (ValueError, hostlist.BadHostlist):
            return None


def container_paths(config: ExperimentConfig, exp_dir: Path, site: SiteConfig) -> Optional[ContainerPaths]:
    """Host paths a container trial needs (None when it runs no container). The in-job
    library's path is content-addressed: computing it only stats files; a start makes it."""
    if not config.environment.image or site.container_runtime == Runtime.NONE:
        return None
    lib = container_lib.lib_dir(ExpPaths(exp_dir).container_lib)
    return ContainerPaths(exp_dir=str(exp_dir), lib_dir=str(lib))


class StepExecutor:
    """Trial runs as job steps of held jobs. The Slurm executor hands it the runs of
    in-allocation experiments (and their job ids); it never submits a job."""

    def __init__(
        self,
        client: SlurmClient,
        site: SiteConfig,
        offline: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.site = site
        self.offline = offline
        self._clock = clock  # a seam: tests move the held job's end without waiting for it
        self._allocations: dict[str, tuple[float, Optional[Allocation]]] = {}
        self._live: dict[str, StepRun] = {}  # runs placed and not seen ended, by job id
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # shells this process started, reaped by poll()
        self._warned: set[str] = set()  # runs sent the warning signal before their job's end
        self.host = socket.gethostname()

    # -- the held job ---------------------------------------------------------------------------
    def allocation(self, job_id: str, fresh: bool = False) -> Optional[Allocation]:
        """What Slurm says of held job ``job_id`` (None: it is gone), read again when older
        than ALLOCATION_TTL_S or ``fresh``. Raises SchedulerUnavailable when Slurm does not answer."""
        cached = self._allocations.get(job_id)
        if cached is not None and not fresh and self._clock() - cached[0] < ALLOCATION_TTL_S:
            return cached[1]
        try:
            alloc = self.client.allocation(job_id, self._gres_name())
        except (SlurmCommandError, SlurmUnavailable, SlurmParseError) as e:
            raise SchedulerUnavailable(f"cannot read allocation {job_id}: {e}") from e
        self._allocations[job_id] = (self._clock(), alloc)
        return alloc

    def _gres_name(self) -> str:
        pools = [p for p in self.site.pools.values() if p.slot_type == "gpu"]
        return pools[0].gres_name if pools else "gpu"

    def ending(self, job_id: str, alloc: Optional[Allocation]) -> Optional[str]:
        """Why no run may start in held job ``job_id`` any more (None: runs may start): it has
        ended, or it ends within the site's signal lead, the time a run needs to checkpoint."""
        if alloc is None:
            return f"allocation {job_id} has ended"
        if not alloc.running:
            return f"allocation {job_id} is {alloc.state}"
        if alloc.end_time is not None and self._clock() >= alloc.end_time - self.site.signal_lead_s:
            at = datetime.fromtimestamp(alloc.end_time).strftime("%H:%M:%S")
            return f"allocation {job_id} reaches its time limit at {at}"
        return None

    def _open(self, config: ExperimentConfig) -> tuple[str, Allocation]:
        """The experiment's held job, while runs may start in it; else HoldingEnded."""
        job = config.slurm.allocation_id
        assert job is not None, "an in-allocation config has its job (in_allocation.bind)"
        alloc = self.allocation(job)
        why = self.ending(job, alloc)
        if why is not None or alloc is None:
            raise HoldingEnded(why)
        return job, alloc

    def shape(self, config: ExperimentConfig, alloc: Allocation) -> StepShape:
        return step_shape(config.resources.slots_per_trial, config.slurm.slots_per_node, alloc)

    def _taken(self, job: str) -> list[Share]:
        return [r.share for r in self._live.values() if r.job == job]

    def busy(self, job: str) -> bool:
        """Whether a run placed in held job ``job`` has not been seen ended."""
        return any(r.job == job for r in self._live.values())

    def observe(self, job: str, state: str) -> None:
        """What the tick's squeue said of held job ``job`` (a pilot worker): its state
        replaces the cached answer's, so a worker is read once when it starts, not every
        ALLOCATION_TTL_S. A job not read yet, or read while it was not running, is left to
        :meth:`allocation`."""
        cached = self._allocations.get(job)
        if cached is None:
            return
        if cached[1] is None or not cached[1].nodes:
            del self._allocations[job]  # read before it ran: read again when next asked
            return
        alloc = dataclasses.replace(cached[1], state=state)
        self._allocations[job] = (self._clock(), alloc)

    def open_jobs(self, jobs: Sequence[str]) -> list[tuple[str, Allocation]]:
        """Those of held jobs ``jobs`` where runs may start now, with what Slurm says of them."""
        out: list[tuple[str, Allocation]] = []
        for job in jobs:
            alloc = self.allocation(job)
            if alloc is not None and self.ending(job, alloc) is None:
                out.append((job, alloc))
        return out

    def room_in(self, jobs: Sequence[str], config: ExperimentConfig) -> int:
        """How many more runs of ``config`` fit in held jobs ``jobs`` (pilot workers) now."""
        return sum(room(alloc, self.shape(config, alloc), self._taken(job)) for job, alloc in self.open_jobs(jobs))

    def start_in(self, jobs: Sequence[str], specs: Sequence[RunSpec]) -> list[str | Exception]:
        """Start ``specs`` as job steps of the first of held jobs ``jobs`` with room for each."""
        out: list[str | Exception] = []
        opened = self.open_jobs(jobs)
        for spec in specs:
            try:
                for job, alloc in opened:
                    share = place(alloc, self.shape(spec.config, alloc), self._taken(job))
                    if share is not None:
                        out.append(self._start_at(spec, job, alloc, share))
                        break
                else:
                    raise SubmitLater("no room in a running pilot worker now; waiting", warn=False)
            except Exception as e:  # this run did not start; the others may
                out.append(e)
        return out

    # -- how many more runs fit -----------------------------------------------------------------
    def capacity(self, config: ExperimentConfig) -> Optional[int]:
        """How many more runs of ``config`` fit in its held job beside those running there;
        the rest wait in the experiment. Raises HoldingEnded once nothing may start there."""
        if self.offline:
            return None  # a dry run plans every trial
        job, alloc = self._open(config)
        return room(alloc, self.shape(config, alloc), self._taken(job))

    def refusals(self, config: ExperimentConfig) -> list[Refusal]:
        """Why the create's trials could never run in its held job ([] when they can)."""
        job = config.slurm.allocation_id
        assert job is not None
        where = f"{CONFIG}.slurm.allocation_id"
        alloc = self.allocation(job, fresh=True)
        if alloc is None:
            return [Refusal(RefusalKind.SITE_LIMIT, where, f"Slurm does not know job {job} (it has ended)")]
        if not alloc.running or not alloc.nodes:
            return [Refusal(RefusalKind.SITE_LIMIT, where, f"allocation {job} is {alloc.state}, not running")]
        message = self.too_small(config, alloc)
        if message is None:
            return []
        shape = self.shape(config, alloc)
        kind = RefusalKind.TOO_MANY_NODES if shape.nodes > len(alloc.nodes) else RefusalKind.NODE_TOO_SMALL
        return [Refusal(kind, f"{CONFIG}.resources.slots_per_trial", message)]

    def too_small(self, config: ExperimentConfig, alloc: Allocation) -> Optional[str]:
        """Why no run of ``config`` could ever fit running job ``alloc``, even empty (None: one
        fits), with the numbers."""
        shape = self.shape(config, alloc)
        if not alloc.nodes or fits_empty(alloc, shape):
            return None
        unit = "GPU" if uses_gpus(alloc) else "CPU"
        need = (
            f"{shape.nodes} nodes with {shape.per_node} {unit}{'s' * (shape.per_node != 1)} each"
            if shape.nodes > 1
            else f"{shape.slots} {unit}{'s' * (shape.slots != 1)} on one node"
        )
        return f"a trial needs {need}, but allocation {alloc.job_id} holds {alloc.describe()}"

    # -- plan and start -------------------------------------------------------------------------
    def plan(self, spec: RunSpec, job: str, alloc: Allocation, share: Share) -> StepRequest:
        """The step's srun options and the shell that runs it (pure, given the placement)."""
        config = spec.config
        shape = self.shape(config, alloc)
        gpu = uses_gpus(alloc) and shape.slots > 0
        res = ResourcePlan((), shape.nodes, shape.slots, shape.per_node, gpu)
        placement = [f"--nodelist={','.join(share.nodes)}"]
        if uses_gpus(alloc):
            # "none": a CPU-only trial on GPU nodes gets no GPU rather than all of them.
            placement.append(f"--gres={self._gres_name()}:{share.gpus}" if share.gpus else "--gres=none")
        placement.append(f"--cpus-per-task={share.cpus}")
        if share.mem_mb:
            placement.append(f"--mem={share.mem_mb}M")
        return plan_step(
            config=config,
            site=self.site,
            res=res,
            ident=Identity(*spec.identity, tag=experiment_tag(str(spec.exp_dir))),
            env=spec.env,
            run_dir=str(spec.run_dir),
            python=self.site.python or sys.executable,
            job_id=job,
            placement=placement,
            container=container_paths(config, spec.exp_dir, self.site),
        )

    def show(self, specs: Sequence[RunSpec]) -> str:
        """What a submission of ``specs`` would start, placed as they would be now (the dry run)."""
        out: list[str] = []
        taken: dict[str, list[Share]] = {}
        for spec in specs:
            job = spec.config.slurm.allocation_id or ""
            try:
                alloc = self.allocation(job)
            except SchedulerUnavailable as e:
                out.append(f"# trial run {spec.name}: not placed ({e})\n")
                continue
            shares = taken.setdefault(job, self._taken(job))
            share = place(alloc, self.shape(spec.config, alloc), shares) if alloc is not None else None
            if alloc is None or share is None:
                out.append(f"# trial run {spec.name}: waits for room in allocation {job}\n")
                continue
            shares.append(share)
            out.append(self.plan(spec, job, alloc, share).render())
        return "".join(out)

    def submit_many(self, specs: Sequence[RunSpec]) -> list[str | Exception]:
        return submit_each(specs, self._start)

    def _start(self, spec: RunSpec) -> str:
        job, alloc = self._open(spec.config)
        share = place(alloc, self.shape(spec.config, alloc), self._taken(job))
        if share is None:  # a run of several slots that the free ones, scattered, do not fit
            raise SubmitLater(f"no room in allocation {job} now; waiting", warn=False)
        return self._start_at(spec, job, alloc, share)

    def _start_at(self, spec: RunSpec, job: str, alloc: Allocation, share: Share) -> str:
        request = self.plan(spec, job, alloc, share)
        paths = container_paths(spec.config, spec.exp_dir, self.site)
        if paths is not None:
            container_lib.ensure_lib(Path(paths.lib_dir))
            Path(spec.config.storage_base).mkdir(mode=0o700, parents=True, exist_ok=True)
        with _open_log(spec.log_path) as log:
            proc = self.client.start_step(request.script, log, str(spec.run_dir))
        run = StepRun(job, share, self.host, proc.pid, psutil.Process(proc.pid).create_time())
        self._procs[proc.pid] = proc
        self._live[run.id] = run
        # First in the run dir: a controller that dies before recording the run finds it there.
        write_marker(RunPaths.from_run_dir(spec.run_dir).job_id_marker, run.id)
        return run.id

    # -- observe ----------------------------------------------------------------------------------
    def poll(self, jobs: Mapping[str, Path]) -> dict[str, JobStatus]:
        """Each run's state from its shell's process and its exit record; no Slurm query but
        the held jobs' (cached), read again for a job one of whose runs has ended."""
        self._reap()
        out: dict[str, JobStatus] = {}
        for job_id, run_dir in jobs.items():
            run = StepRun.parse(job_id)
            if run is None:
                out[job_id] = JobStatus(JobState.UNKNOWN, None, ExitCause.LOST, "not a job step's id")
                continue
            record = exit_outcome(exit_record_of(run_dir))
            alive = self._alive(run)
            if alive is None and not record.present and self._held_job_over(run):
                # Its shell, on another host, can write nothing more: the daemon that started it
                # ran inside the held job (an sbatch script's `det e create --in-allocation`)
                # and ended with it, shell and all.
                alive = False
            if alive or (alive is None and not record.present):
                self._live[job_id] = run
                out[job_id] = JobStatus(JobState.RUNNING)
                self._warn_before_end(run, run_dir)
                continue
            self._live.pop(job_id, None)
            self._warned.discard(job_id)
            out[job_id] = self._ended(run, run_dir, record.code, record.problem, record.source)
        return out

    def _ended(
        self, run: StepRun, run_dir: Path, code: Optional[int], problem: Optional[str], source: Optional[str]
    ) -> JobStatus:
        # Its held job's end stops a run as a preemption does (never its failure).
        try:
            alloc = self.allocation(run.job, fresh=True)
            job_ended = self.ending(run.job, alloc) is not None
        except SchedulerUnavailable:
            job_ended = False
        if problem is not None:
            return JobStatus(JobState.EXITED, None, ExitCause.FAILED, f"unreadable exit record: {problem}")
        if code is None and job_ended:
            # Slurm ended the held job and its shell with it (the shell ran inside the job):
            # the held job's end, a preemption as for a run whose shell lived to record it.
            return JobStatus(JobState.EXITED, None, ExitCause.PREEMPTED, "its allocation ended")
        if code is None:
            return JobStatus(JobState.UNKNOWN, None, ExitCause.LOST, "its shell is gone without an exit record")
        state = SlurmState.PREEMPTED if job_ended else None
        return ended(state, code, source == IMAGE_SOURCE, stop_signalled(run_dir))

    def _held_job_over(self, run: StepRun) -> bool:
        """Whether the run's held job ended for good more than LATE_RECORD_S ago (or Slurm no
        longer knows it)."""
        try:
            alloc = self.allocation(run.job)
        except SchedulerUnavailable:
            return False
        if alloc is None:
            return True
        if not SLURM_STATES.get(alloc.state, SlurmState.UNKNOWN).is_terminal:
            return False
        return alloc.end_time is None or self._clock() - alloc.end_time > LATE_RECORD_S

    def _alive(self, run: StepRun) -> Optional[bool]:
        """Whether the run's shell still runs; None when it runs on another host (a daemon
        moved): its exit record then says when it has ended."""
        if run.host != self.host:
            return None
        try:
            p = psutil.Process(run.pid)
            return abs(p.create_time() - run.started) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def _reap(self) -> None:
        for pid, proc in list(self._procs.items()):
            if proc.poll() is not None:
                del self._procs[pid]

    def _warn_before_end(self, run: StepRun, run_dir: Path) -> None:
        """The site's warning signal, once, to a run whose held job ends within the signal lead:
        the shell passes it to srun, which passes it to the step, and the trial checkpoints."""
        if run.id in self._warned:
            return
        try:
            alloc = self.allocation(run.job)
        except SchedulerUnavailable:
            return
        if self.ending(run.job, alloc) is None or stop_signalled(run_dir):
            return
        self._warned.add(run.id)
        self.signal(run.id, signal.Signals[f"SIG{self.site.signal.upper().removeprefix('SIG')}"])

    # -- control ----------------------------------------------------------------------------------
    def signal(self, job_id: str, signum: int) -> None:
        """Signal the run's shell, which records it and passes it to srun (and so to the step)."""
        run = StepRun.parse(job_id)
        if run is None or not self._alive(run):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(run.pid, signum)

    def kill_many(self, job_ids: Sequence[str]) -> None:
        """SIGTERM to each shell: it passes it to srun, which kills its step at once."""
        for job_id in job_ids:
            self.signal(job_id, signal.SIGTERM)
