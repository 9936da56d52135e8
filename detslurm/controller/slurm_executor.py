"""Run trial runs as Slurm jobs: plan (pure) then sbatch to submit, one squeue per tick to observe.

``plan_many`` is the whole plan of a submission: ``det e create --dry-run`` prints exactly
what it returns, and ``submit_many`` executes exactly that.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from detslurm.controller.executor import (
    ExitCause,
    JobState,
    JobStatus,
    RunSpec,
    SchedulerUnavailable,
    SubmitUnknown,
)
from detslurm.expconf import ExperimentConfig
from detslurm.protocol import ExpPaths, exit_outcome, exit_record_of
from detslurm.queue import DEFAULT_PRIORITY
from detslurm.slurm.client import SlurmClient, SlurmCommandError, SlurmUnavailable
from detslurm.slurm.parse import AccountedJob, QueuedJob, experiment_tag
from detslurm.slurm.render import (
    ArrayTask,
    Identity,
    SbatchRequest,
    plan_array,
    plan_trial_run,
)
from detslurm.slurm.site import SiteConfig
from detslurm.slurm.states import SlurmState

# Bytes of per-task exports one array script may carry (Slurm refuses scripts over its
# max_script_size, 4 MB by default); a bigger group is split into more arrays.
ARRAY_SCRIPT_BUDGET = 1 << 20
RECOVER_CACHE_S = 5.0
SLURM_DEFAULT_MAX_ARRAY_SIZE = 1001  # slurm.conf's default MaxArraySize

# What a job in the queue is, for the controller. COMPLETING counts as running: the final
# state (PREEMPTED, TIMEOUT, ...) comes next, and deciding now would lose how the run ended.
JOB_STATE: dict[SlurmState, JobState] = {
    SlurmState.PENDING: JobState.QUEUED,
    SlurmState.REQUEUED: JobState.QUEUED,
    SlurmState.RUNNING: JobState.RUNNING,
    SlurmState.SUSPENDED: JobState.RUNNING,
    SlurmState.COMPLETING: JobState.RUNNING,
    # A state this Slurm does not know yet (a newer version): still in the queue, so active.
    SlurmState.UNKNOWN: JobState.RUNNING,
    SlurmState.COMPLETED: JobState.EXITED,
    SlurmState.FAILED: JobState.EXITED,
    SlurmState.CANCELLED: JobState.EXITED,
    SlurmState.TIMEOUT: JobState.EXITED,
    SlurmState.PREEMPTED: JobState.EXITED,
    SlurmState.NODE_FAIL: JobState.EXITED,
    SlurmState.OUT_OF_MEMORY: JobState.EXITED,
    SlurmState.BOOT_FAIL: JobState.EXITED,
    SlurmState.DEADLINE: JobState.EXITED,
}

# How a job ended, by Slurm's final state. A boot failure is the node's fault, not the
# trial's; a deadline is a time limit the user set.
EXIT_CAUSE: dict[SlurmState, ExitCause] = {
    SlurmState.COMPLETED: ExitCause.COMPLETED,
    SlurmState.FAILED: ExitCause.FAILED,
    SlurmState.OUT_OF_MEMORY: ExitCause.FAILED,
    SlurmState.CANCELLED: ExitCause.CANCELED_BY_USER,
    SlurmState.TIMEOUT: ExitCause.TIME_LIMIT,
    SlurmState.DEADLINE: ExitCause.TIME_LIMIT,
    SlurmState.PREEMPTED: ExitCause.PREEMPTED,
    SlurmState.NODE_FAIL: ExitCause.NODE_FAILURE,
    SlurmState.BOOT_FAIL: ExitCause.NODE_FAILURE,
}

# Pending reasons that mean "no reason" in squeue's output.
_NO_REASON = ("None", "(null)", "")


@dataclass(frozen=True)
class Submission:
    """One sbatch call of the plan: the request, and the runs it starts (one, or an array's
    tasks; task ``t`` runs ``specs[i]`` with ``t = trial_id - base``)."""

    request: SbatchRequest
    specs: tuple[RunSpec, ...]
    links_dir: Optional[Path] = None  # arrays: where each task's log link goes

    def job_ids(self, array_id: str) -> list[str]:
        if self.links_dir is None:
            return [array_id]
        base = self.specs[0].identity[1]
        return [f"{array_id}_{s.identity[1] - base}" for s in self.specs]


class SlurmExecutor:
    kind = "slurm"

    def __init__(self, client: SlurmClient, site: SiteConfig, offline: bool = False) -> None:
        self.client = client
        self.site = site
        # Planning only, maybe with no Slurm in reach (a dry run on a laptop): Slurm's own
        # default limits stand in for the site's.
        self.offline = offline
        self.last_queue: dict[str, QueuedJob] = {}
        self._recover_queue: Optional[tuple[float, list[QueuedJob]]] = None

    def capacity(self) -> Optional[int]:
        return None  # Slurm queues; we never hold trials back

    def resources_type(self) -> str:
        return "slurm-job"

    # -- plan (pure) ------------------------------------------------------------------------
    def plan_many(self, specs: Sequence[RunSpec]) -> list[Submission]:
        """Runs of one experiment with the same run number and resources share an sbatch as a
        job array; the rest go one job each."""
        groups: dict[str, list[RunSpec]] = {}
        for spec in specs:
            cfg = spec.config
            shared = [spec.identity[0], spec.identity[2], cfg.resources.model_dump(), cfg.slurm.model_dump()]
            groups.setdefault(json.dumps(shared, sort_keys=True, default=str), []).append(spec)
        subs: list[Submission] = []
        for group in groups.values():
            for chunk in self._chunks(sorted(group, key=lambda s: s.identity[1])):
                subs.append(self._plan_array(chunk) if len(chunk) > 1 else self._plan_one(chunk[0]))
        return subs

    def _plan_one(self, spec: RunSpec) -> Submission:
        ident = Identity(*spec.identity, tag=experiment_tag(str(spec.exp_dir)))
        req = plan_trial_run(
            config=spec.config,
            site=self.site,
            ident=ident,
            env=spec.env,
            run_dir=str(spec.run_dir),
            log_path=str(spec.log_path),
            python=self.site.python or sys.executable,
            may_raise_priority=self._may_raise_priority(spec.config),
        )
        return Submission(req, (spec,))

    def _plan_array(self, specs: Sequence[RunSpec]) -> Submission:
        first = specs[0]
        ident = Identity(*first.identity, tag=experiment_tag(str(first.exp_dir)), array=True)
        links = ExpPaths(first.exp_dir).array_links(ident.trial_id, ident.run_id)
        tasks = [ArrayTask(s.identity[1], str(s.run_dir), s.env) for s in specs]
        req = plan_array(
            config=first.config,
            site=self.site,
            ident=ident,
            tasks=tasks,
            links_dir=str(links),
            log_name=first.log_path.name,
            python=self.site.python or sys.executable,
            may_raise_priority=self._may_raise_priority(first.config),
        )
        return Submission(req, tuple(specs), links)

    def _may_raise_priority(self, config: ExperimentConfig) -> bool:
        # Asked only for a priority above the default (a negative nice), so an ordinary config
        # costs no Slurm call; offline (a dry run) there is no Slurm to ask, and the plan shows
        # what an ordinary user gets.
        priority = config.resources.priority
        if priority is None or priority >= DEFAULT_PRIORITY or self.offline:
            return False
        return self.client.may_raise_priority()

    def _chunks(self, order: list[RunSpec]) -> list[list[RunSpec]]:
        """Split specs (sorted by trial) so that task ids stay below MaxArraySize and scripts
        stay small."""
        limit = max(1, self._max_array_size() - 1)
        chunks: list[list[RunSpec]] = []
        size = 0
        for spec in order:
            cost = sum(len(k) + len(v) for k, v in spec.env.items()) // 4  # most of it is shared
            base = chunks[-1][0].identity[1] if chunks else 0
            if not chunks or spec.identity[1] - base >= limit or size + cost > ARRAY_SCRIPT_BUDGET:
                chunks.append([])
                size = 0
            chunks[-1].append(spec)
            size += cost
        return chunks

    def _max_array_size(self) -> int:
        try:
            return self.client.capabilities().max_array_size
        except (SlurmCommandError, SlurmUnavailable):
            if not self.offline:
                raise
            return SLURM_DEFAULT_MAX_ARRAY_SIZE

    # -- execute ----------------------------------------------------------------------------
    def submit_many(self, specs: Sequence[RunSpec]) -> list[str | Exception]:
        """Execute the plan. Returns each spec's job id (``ARRAY_TASK`` for array tasks), or
        the error that kept it from starting, in the order of ``specs``."""
        try:
            subs = self.plan_many(specs)
        except Exception as e:  # planning needs the site's limits: nothing was submitted
            return [_classify(e)] * len(specs)
        out: dict[tuple[int, int, int], str | Exception] = {}
        for sub in subs:
            try:
                ids: list[str | Exception] = list(sub.job_ids(self.execute(sub)))
            except Exception as e:  # the whole sbatch failed: none of its runs started
                ids = [e] * len(sub.specs)
            out.update(zip((s.identity for s in sub.specs), ids, strict=True))
        return [out[s.identity] for s in specs]

    def execute(self, sub: Submission) -> str:
        """Make the dirs the job writes to, then one sbatch; returns Slurm's job id."""
        for spec in sub.specs:
            spec.run_dir.mkdir(parents=True, exist_ok=True)
        if sub.links_dir is not None:
            if sub.links_dir.exists():  # left by a controller that died before this submission
                shutil.rmtree(sub.links_dir)
            sub.links_dir.mkdir(parents=True)
            base = sub.specs[0].identity[1]
            for spec in sub.specs:
                link = sub.links_dir / str(spec.identity[1] - base)
                link.symlink_to(spec.run_dir.resolve(), target_is_directory=True)
        try:
            return self.client.sbatch(sub.request.args, sub.request.script)
        except SlurmCommandError as e:
            # The order matters: a lost reply is also "unreachable", but the job may exist.
            if e.reply_lost:
                raise SubmitUnknown(str(e)) from e
            raise _classify(e) from e

    # -- observe ----------------------------------------------------------------------------
    def recover(self, identity: tuple[int, int, int], exp_dir: str) -> Optional[str]:
        """Find a job submitted just before a crash (or whose sbatch reply was lost) by its
        comment (contract 4). Raises SchedulerUnavailable when the queue cannot be read."""
        tag = experiment_tag(exp_dir)
        # One squeue serves every run recovered in this tick (an array's worth of them).
        if self._recover_queue is None or time.monotonic() - self._recover_queue[0] > RECOVER_CACHE_S:
            self._recover_queue = (time.monotonic(), self._squeue())
        for job in self._recover_queue[1]:
            if job.identity == identity and job.comment.endswith(f",tag={tag}"):
                return job.job_id
        return None

    def _squeue(self) -> list[QueuedJob]:
        try:
            return self.client.squeue()
        except SlurmCommandError as e:
            raise _classify(e) from e

    def poll(self, jobs: Mapping[str, Path]) -> dict[str, JobStatus]:
        if not jobs:
            return {}
        self.last_queue = {j.job_id: j for j in self._squeue()}
        self._recover_queue = (time.monotonic(), list(self.last_queue.values()))
        gone = [j for j in jobs if j not in self.last_queue]
        accounted = self._sacct(gone)
        return {job_id: self._status(job_id, run_dir, accounted.get(job_id)) for job_id, run_dir in jobs.items()}

    def _sacct(self, gone: list[str]) -> dict[str, AccountedJob]:
        """Final states of jobs that left the queue, where slurmdbd keeps them. A failing sacct
        (slurmdbd down) only loses that detail: it must not stop the tick."""
        if not gone:
            return {}
        try:
            if not self.client.capabilities().accounting:
                return {}
            return self.client.sacct(gone)
        except (SlurmCommandError, SlurmUnavailable):  # sacct down, missing, or timed out
            return {}

    def _status(self, job_id: str, run_dir: Path, acct: Optional[AccountedJob] = None) -> JobStatus:
        q = self.last_queue.get(job_id)
        code = _exit_code(run_dir)
        if q is None and acct is not None and acct.state.is_terminal:
            # Left the queue (MinJobAge) but slurmdbd knows how it ended.
            return _ended(acct.state, code if code is not None else acct.exit_code)
        if q is None:
            if code is not None:
                return _ended(None, code)
            return JobStatus(JobState.UNKNOWN, None, ExitCause.LOST)
        state = JOB_STATE[q.state]
        if state == JobState.EXITED:
            return _ended(q.state, code)
        if state == JobState.QUEUED:
            return JobStatus(JobState.QUEUED, detail=None if q.reason in _NO_REASON else q.reason)
        return JobStatus(JobState.RUNNING)

    # -- control ----------------------------------------------------------------------------
    def signal(self, job_id: str, signum: int) -> None:
        import signal as sigmod

        name = sigmod.Signals(signum).name.removeprefix("SIG")
        self.client.scancel(job_id, signal=name, batch_too=True)

    def cancel_pending(self, job_ids: Sequence[str]) -> None:
        """Cancel those of these jobs that are still waiting in the queue (`det e pause`)."""
        self.kill_many(job_ids, pending_only=True)

    def kill_many(self, job_ids: Sequence[str], pending_only: bool = False) -> None:
        for i in range(0, len(job_ids), 500):  # bounded command lines
            try:
                self.client.scancel(job_ids[i : i + 500], pending_only=pending_only)
            except SlurmCommandError as e:
                # scancel cancels the rest and complains about jobs that ended meanwhile: fine.
                ended = ("Invalid job id", "already completing or completed")
                if not all(any(m in line for m in ended) for line in e.stderr.splitlines() if line.strip()):
                    raise


def _classify(e: Exception) -> Exception:
    """slurmctld not answering is the scheduler's state, not an error of the run: the caller
    retries later without spending anything."""
    if isinstance(e, SlurmCommandError) and e.unreachable:
        return SchedulerUnavailable(str(e))
    return e


def _exit_code(run_dir: Path) -> Optional[int]:
    """The code the batch shell recorded, or None (no record, or one we cannot read: what a
    trial leaves in its run dir is never trusted to parse)."""
    return exit_outcome(exit_record_of(run_dir)).code


def _ended(state: Optional[SlurmState], code: Optional[int]) -> JobStatus:
    """A finished job: Slurm's final state says why, the run's own record gives the code."""
    cause = EXIT_CAUSE.get(state) if state is not None else None
    if cause is None or cause == ExitCause.COMPLETED:
        cause = ExitCause.COMPLETED if code == 0 else ExitCause.FAILED
    detail = state.value if state is not None and state != SlurmState.COMPLETED else None
    return JobStatus(JobState.EXITED, code, cause, detail)
