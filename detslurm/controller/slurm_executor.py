"""Run trial runs as Slurm jobs: sbatch the plan (controller/slurm_plan.py) within the
user's submit limits, one squeue per tick to observe, scancel to stop.

``submit_many`` executes exactly the plan ``plan_many`` returns, which ``det e create
--dry-run`` prints.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Optional

from detslurm.controller.executor import (
    Demand,
    ExitCause,
    ExpRef,
    HoldingEnded,
    JobState,
    JobStatus,
    RunSpec,
    SchedulerUnavailable,
    SubmitLater,
    SubmitUnknown,
)
from detslurm.controller.pilots import PilotPool
from detslurm.controller.slurm_plan import SlurmPlanner, Submission
from detslurm.controller.slurm_status import JOB_STATE, ended, in_queue, requeued_status, stop_signalled
from detslurm.controller.step_executor import StepExecutor, is_step
from detslurm.expconf import ExperimentConfig
from detslurm.protocol import IMAGE_SOURCE, exit_outcome, exit_record_of
from detslurm.slurm import container_lib
from detslurm.slurm.client import SlurmClient, SlurmCommandError, SlurmUnavailable
from detslurm.slurm.limits import SubmitLimits, Throttle, count_queue, headroom, is_limit_refusal, submit_limits
from detslurm.slurm.parse import AccountedJob, QueuedJob, SlurmParseError, experiment_tag
from detslurm.slurm.reasons import pending_reason
from detslurm.slurm.render import ResourcePlan
from detslurm.slurm.site import SiteConfig
from detslurm.slurm.states import SlurmState

RECOVER_CACHE_S = 5.0
SLURM_DEFAULT_MAX_JOB_COUNT = 10000  # slurm.conf's default MaxJobCount
# Submit limits change when an admin edits slurm.conf or the accounting database: read them
# again this often (two commands), not every tick.
LIMITS_TTL_S = 600.0
# A throttled executor whose queue answer is older than this reads it again before saying
# "no room": with no job of ours left to poll, no tick reads the queue, and trials would wait
# on jobs that have ended.
QUEUE_STALE_S = 10.0

# Pending reasons that mean "no reason" in squeue's output.
_NO_REASON = ("None", "(null)", "")


class SlurmExecutor(SlurmPlanner):
    """Submits what SlurmPlanner plans, observes the jobs and stops them; the runs of
    in-allocation experiments and of pilot workers go to job steps (StepExecutor, PilotPool)."""

    kind = "slurm"

    def __init__(
        self,
        client: SlurmClient,
        site: SiteConfig,
        offline: bool = False,
        clock: Callable[[], float] = time.monotonic,
        planned: Optional[tuple[ExperimentConfig, ResourcePlan]] = None,
    ) -> None:
        super().__init__(client, site, offline=offline, planned=planned)
        self.last_queue: dict[str, QueuedJob] = {}
        self._recover_queue: Optional[tuple[float, list[QueuedJob]]] = None
        self._clock = clock  # a seam: tests age the cached limits and queue without sleeping
        self._throttle = Throttle()
        self.unreachable: Optional[str] = None
        # The runs of in-allocation experiments: job steps of a job the user holds.
        self.steps = StepExecutor(client, site, offline=offline)
        # Experiments with pilot workers: their runs are job steps of workers kept here.
        self.pilots = PilotPool(client, self.steps, self._tick_queue, self._may_raise_priority)
        self._queue_read = False  # whether this tick has read the queue (settle() ends a tick)

    # -- how many more jobs Slurm takes -----------------------------------------------------
    def capacity(self, config: Optional[ExperimentConfig] = None, exp: Optional[ExpRef] = None) -> Optional[int]:
        """How many more jobs (an array's tasks one each) this user may queue now: Slurm's
        submit limits (read rarely) minus this user's jobs in the tick's squeue answer and what
        was submitted since, with a margin. Trials past it wait for a later tick with no run yet
        (``plan_runs`` stops at it, in trial order), as trials past max_local_trials do. Runs
        of an in-allocation ``config`` are job steps, which no submit limit counts: the room
        in its held job decides (StepExecutor.capacity); those of an experiment with pilot
        workers, the room in its running workers."""
        if config is not None and config.slurm.in_allocation:
            return self.steps.capacity(config)
        if config is not None and config.slurm.pilots is not None:
            if self.offline or exp is None:
                return None  # a dry run plans every trial
            try:
                return self.steps.room_in(self.pilots.running(exp), config)
            except SchedulerUnavailable as e:
                self.unreachable = str(e)
                return 0
        if self.offline:
            return None  # a dry run plans every trial, as Slurm would be asked to take them
        t = self._throttle
        room = self._room()
        # A stale answer (no job of ours was polled lately: the first submission, or one after
        # an idle stretch) does not show the user's other jobs: read the queue once more.
        if room is not None and self._clock() - t.queue_at > QUEUE_STALE_S:
            try:
                self._read_queue()
            except SchedulerUnavailable as e:
                self.unreachable = str(e)
                return 0  # no answer: submitting would fail the same way
            room = self._room()
        return room

    def _room(self) -> Optional[int]:
        t = self._throttle
        queue = count_queue(self.last_queue.values())
        room = headroom(self._submit_limits(), queue, t.submitted)
        if t.refused_at is not None:
            # Slurm refused a job at this many: a limit we could not read (a QOS's) holds there.
            learned = max(0, t.refused_at - queue.live - t.submitted)
            room = learned if room is None else min(room, learned)
        return room

    def _submit_limits(self) -> SubmitLimits:
        """The cached limits, read again every LIMITS_TTL_S. What cannot be read keeps the last
        answer (or Slurm's default MaxJobCount): a failing sacctmgr must not stop submissions."""
        t = self._throttle
        if t.limits is not None and self._clock() - t.limits_at < LIMITS_TTL_S:
            return t.limits
        if t.limits is not None:
            t.refused_at = None  # limits read again: what a refusal taught may have changed too
        try:
            caps = self.client.capabilities(fresh=t.limits is not None)
            assocs = self.client.assoc_limits() if caps.accounting else []
            t.limits = submit_limits(caps, assocs)
        except (SlurmCommandError, SlurmUnavailable, SlurmParseError):
            t.limits = t.limits or SubmitLimits(SLURM_DEFAULT_MAX_JOB_COUNT, None)
        t.limits_at = self._clock()
        return t.limits

    def _later(self, e: SlurmCommandError, tried: int) -> SubmitLater:
        """A submission Slurm refused for a limit: remember where it holds (at most our live jobs
        and half the array just tried) and warn once per throttled stretch."""
        t = self._throttle
        live = count_queue(self.last_queue.values()).live + t.submitted
        # The limit lies below live + tried: halve what is tried until Slurm takes it (a lone
        # job refused says the limit is where we are). Learning only `live` would pin a search
        # refused early, with few jobs live, to those few for good.
        t.refused_at = live + tried // 2
        warn, t.warned = not t.warned, True
        reason = next((line for line in e.stderr.splitlines() if is_limit_refusal(line)), e.stderr)
        return SubmitLater(f"Slurm refused the job for a submit limit ({reason.strip()}); submitting later", warn)

    def resources_type(self) -> str:
        return "slurm-job"

    # -- execute ----------------------------------------------------------------------------
    def submit_many(self, specs: Sequence[RunSpec]) -> list[str | Exception]:
        """Execute the plan. Returns each spec's job id (``ARRAY_TASK`` for array tasks), or
        the error that kept it from starting, in the order of ``specs``. Runs of in-allocation
        experiments start as job steps (StepExecutor)."""
        stepped = [s for s in specs if s.config.slurm.in_allocation]
        piloted = [s for s in specs if s.config.slurm.pilots is not None]
        if stepped or piloted:
            results = dict(zip((s.identity for s in stepped), self.steps.submit_many(stepped), strict=True))
            results.update(self._start_in_workers(piloted))
            rest = [s for s in specs if not (s.config.slurm.in_allocation or s.config.slurm.pilots is not None)]
            results.update(zip((s.identity for s in rest), self.submit_many(rest) if rest else [], strict=True))
            return [results[s.identity] for s in specs]
        try:
            subs = self.plan_many(specs)
        except Exception as e:  # planning needs the site's limits: nothing was submitted
            return [_classify(e)] * len(specs)
        out: dict[tuple[int, int, int], str | Exception] = {}
        refused = False
        for sub in subs:
            ids: list[str | Exception]
            if refused:  # a limit refused the previous sbatch: this one would be refused too
                ids = [SubmitLater("waiting for a submit limit", warn=False)] * len(sub.specs)
            else:
                try:
                    ids = list(sub.job_ids(self.execute(sub)))
                    self._throttle.submitted += len(sub.specs)
                    self._throttle.warned = False
                except SubmitLater as e:
                    refused = True
                    # One warning event (the first trial's), not one per trial of the array.
                    quiet: list[str | Exception] = [SubmitLater(str(e), warn=False)] * (len(sub.specs) - 1)
                    ids = [e, *quiet]
                except Exception as e:  # the whole sbatch failed: none of its runs started
                    ids = [e] * len(sub.specs)
            out.update(zip((s.identity for s in sub.specs), ids, strict=True))
        return [out[s.identity] for s in specs]

    def _start_in_workers(self, specs: Sequence[RunSpec]) -> dict[tuple[int, int, int], str | Exception]:
        """Runs of experiments with pilot workers, as job steps of their running workers."""
        by_exp: dict[ExpRef, list[RunSpec]] = {}
        for spec in specs:
            by_exp.setdefault(ExpRef(spec.identity[0], spec.exp_dir), []).append(spec)
        out: dict[tuple[int, int, int], str | Exception] = {}
        for exp, group in by_exp.items():
            try:
                started = self.steps.start_in(self.pilots.running(exp), group)
            except SchedulerUnavailable as e:
                started = [e] * len(group)
            out.update(zip((s.identity for s in group), started, strict=True))
        return out

    def settle(self, demands: Sequence[Demand]) -> list[tuple[int, str | HoldingEnded]]:
        """Keep the pilot workers the experiments need (PilotPool.settle); the tick ends here,
        so the next one reads the queue afresh."""
        try:
            return self.pilots.settle(demands) if demands and not self.offline else []
        finally:
            self._queue_read = False

    def _tick_queue(self) -> Mapping[str, QueuedJob]:
        """This tick's squeue answer: the one poll() read, else read now (once per tick)."""
        if not self._queue_read:
            self._read_queue()
        return self.last_queue

    def execute(self, sub: Submission) -> str:
        """Make the dirs the job writes to, then one sbatch; returns Slurm's job id."""
        for spec in sub.specs:
            # Made by the controller's prepare_runs already: a stat, not an mkdir that fails
            # (each a round trip to the server on NFS).
            if not spec.run_dir.is_dir():
                spec.run_dir.mkdir(parents=True, exist_ok=True)
        paths = self._container_paths(sub.specs[0])
        if paths is not None:
            container_lib.ensure_lib(Path(paths.lib_dir))
            # A runtime refuses to bind a host path that does not exist yet; a base detslurm
            # creates is private, as the Core API would have made it.
            Path(sub.specs[0].config.storage_base).mkdir(mode=0o700, parents=True, exist_ok=True)
        if sub.links_dir is not None:
            # Left by a controller that died before this submission; or anything else at the
            # name (the experiment dir is the trials' to write): a link is removed, not followed.
            if sub.links_dir.is_symlink() or sub.links_dir.is_file():
                sub.links_dir.unlink()
            elif sub.links_dir.exists():
                shutil.rmtree(sub.links_dir)
            sub.links_dir.mkdir(parents=True)
            base = sub.specs[0].identity[1]
            for spec in sub.specs:
                link = sub.links_dir / str(spec.identity[1] - base)
                link.symlink_to(spec.run_dir.resolve(), target_is_directory=True)
        # A queue read before this sbatch cannot show its job: recover() must not answer from it
        # (a run whose job id was lost would be judged never started and submitted again).
        self._recover_queue = None
        try:
            return self.client.sbatch(sub.request.args, sub.request.script)
        except SlurmCommandError as e:
            # The order matters: a lost reply is also "unreachable", but the job may exist.
            if e.reply_lost:
                if is_limit_refusal(e.stderr):
                    # sbatch was still resending into a full job table when our timeout cut it
                    # short: learn the limit, but a resend may have got in, so look for the job.
                    self._later(e, len(sub.specs))
                raise SubmitUnknown(str(e)) from e
            if is_limit_refusal(e.stderr):
                raise self._later(e, len(sub.specs)) from e
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

    def _read_queue(self) -> None:
        """The tick's one squeue: every job of this user, kept for capacity() and recover()."""
        self.last_queue = {j.job_id: j for j in self._squeue()}
        self._queue_read = True
        self.unreachable = None
        self._recover_queue = (time.monotonic(), list(self.last_queue.values()))
        # What was submitted before this answer is in it now.
        self._throttle.queue_at, self._throttle.submitted = self._clock(), 0

    def _squeue(self) -> list[QueuedJob]:
        try:
            return self.client.squeue()
        except SlurmCommandError as e:
            raise _classify(e) from e

    def poll(self, jobs: Mapping[str, Path]) -> dict[str, JobStatus]:
        steps = {j: d for j, d in jobs.items() if is_step(j)}
        if steps:
            rest = {j: d for j, d in jobs.items() if not is_step(j)}
            return {**self.steps.poll(steps), **self.poll(rest)}
        if not jobs:
            return {}
        self._read_queue()
        gone = [j for j in jobs if j not in self.last_queue]
        accounted = self._sacct(gone)
        out = {job_id: self._status(job_id, run_dir, accounted.get(job_id)) for job_id, run_dir in jobs.items()}
        return self._cancel_unschedulable(out)

    def _cancel_unschedulable(self, statuses: dict[str, JobStatus]) -> dict[str, JobStatus]:
        """Jobs that wait for a reason that never clears are cancelled (one scancel for all of
        them), and only then reported ended: a trial ended while its job stayed queued could
        start later, unwatched. If the scancel fails they stay QUEUED (with their reason) and
        the next tick tries again. (A requeued job is cancelled by the controller after it has
        recorded the run's end: a start of it runs nothing, see _requeued_status.)"""
        doomed = [j for j, st in statuses.items() if st.cause == ExitCause.UNSCHEDULABLE]
        if not doomed:
            return statuses
        try:
            self.kill_many(doomed)
        except (SlurmCommandError, SlurmUnavailable):
            # Queued as before, with Slurm's code as the detail (the queue's own record of it).
            waiting = {j: JobStatus(JobState.QUEUED, detail=self.last_queue[j].reason) for j in doomed}
            return {**statuses, **waiting}
        return statuses

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
        requeued = q is not None and _requeued_trial(q)
        if q is not None and (
            q.state == SlurmState.COMPLETING or (JOB_STATE[q.state] != JobState.EXITED and not requeued)
        ):
            # The exit record is read only once the job has ended; a requeued job is COMPLETING
            # while the stopped start may still be writing its checkpoint and exit record.
            return self._live(q)
        record = exit_outcome(exit_record_of(run_dir))
        # The code the batch shell recorded, or None (no record, or one we cannot read: what a
        # trial leaves in its run dir is never trusted to parse).
        code = record.code
        image = code is not None and record.source == IMAGE_SOURCE
        stopped = stop_signalled(run_dir)
        if requeued:
            return requeued_status(code, image, stopped, still_queued=in_queue(q))
        if q is None and acct is not None and acct.state.is_terminal:
            # Left the queue (MinJobAge) but slurmdbd knows how it ended.
            return ended(acct.state, code if code is not None else acct.exit_code, image, stopped)
        if q is None:
            if code is not None:
                return ended(None, code, image, stopped)
            return JobStatus(JobState.UNKNOWN, None, ExitCause.LOST)
        return ended(q.state, code, image, stopped)

    @staticmethod
    def _live(q: QueuedJob) -> JobStatus:
        """A job still queued or running, as the controller sees it."""
        if JOB_STATE[q.state] == JobState.QUEUED:
            reason = None if q.reason in _NO_REASON else q.reason
            why = pending_reason(reason)
            if reason is not None and why.permanent:
                # Waiting cannot help (PartitionNodeLimit, InvalidAccount, ...): the run ends now,
                # with Slurm's reason in words as its detail, and poll() cancels the job.
                return JobStatus(JobState.EXITED, None, ExitCause.UNSCHEDULABLE, f"{why.words} ({why.code})")
            return JobStatus(JobState.QUEUED, detail=reason)
        return JobStatus(JobState.RUNNING)

    # -- control ----------------------------------------------------------------------------
    def signal(self, job_id: str, signum: int) -> None:
        import signal as sigmod

        if is_step(job_id):
            self.steps.signal(job_id, signum)
            return

        name = sigmod.Signals(signum).name.removeprefix("SIG")
        self.client.scancel(job_id, signal=name, batch_too=True)

    def cancel_pending(self, job_ids: Sequence[str]) -> None:
        """Cancel those of these jobs that are still waiting in the queue (`det e pause`)."""
        self.kill_many(job_ids, pending_only=True)

    def kill_many(self, job_ids: Sequence[str], pending_only: bool = False) -> None:
        steps = [j for j in job_ids if is_step(j)]
        if steps:
            if not pending_only:  # a job step starts at once: none waits to be canceled
                self.steps.kill_many(steps)
            job_ids = [j for j in job_ids if not is_step(j)]
        for i in range(0, len(job_ids), 500):  # bounded command lines
            try:
                self.client.scancel(job_ids[i : i + 500], pending_only=pending_only)
            except SlurmCommandError as e:
                # scancel cancels the rest and complains about jobs that ended meanwhile: fine.
                gone = ("Invalid job id", "already completing or completed")
                if not all(any(m in line for m in gone) for line in e.stderr.splitlines() if line.strip()):
                    raise


def _classify(e: Exception) -> Exception:
    """slurmctld not answering is the scheduler's state, not an error of the run: the caller
    retries later without spending anything."""
    if isinstance(e, SlurmCommandError) and e.unreachable:
        return SchedulerUnavailable(str(e))
    return e


def _requeued_trial(q: QueuedJob) -> bool:
    """A trial run's job that Slurm requeued after it had started. Detached runs (users' own
    scripts, no trial identity in the comment) are left to Slurm: a requeue is how they resume."""
    return q.requeued and q.identity is not None
