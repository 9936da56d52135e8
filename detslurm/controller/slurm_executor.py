"""Run trial runs as Slurm jobs: render + sbatch to submit, one squeue per tick to observe."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from detslurm.controller.executor import JobState, JobStatus, RunSpec, SchedulerUnavailable
from detslurm.protocol import ExitOutcome, RunPaths, exit_outcome, exit_record_of
from detslurm.slurm.client import SlurmClient
from detslurm.slurm.parse import AccountedJob, QueuedJob, experiment_tag
from detslurm.slurm.render import ArrayTask, Identity, SbatchRequest, plan_array, plan_trial_run
from detslurm.slurm.site import SiteConfig
from detslurm.slurm.states import SlurmState

# Bytes of per-task exports one array script may carry (Slurm refuses scripts over its
# max_script_size, 4 MB by default); a bigger group is split into more arrays.
ARRAY_SCRIPT_BUDGET = 1 << 20
RECOVER_CACHE_S = 5.0

# How a job that ended without writing its own exit record ended, as we show it.
_REASONS = {
    SlurmState.PREEMPTED: "preempted",
    SlurmState.TIMEOUT: "time limit",
    SlurmState.NODE_FAIL: "node failure",
    SlurmState.CANCELLED: "canceled",
    SlurmState.OUT_OF_MEMORY: "out of memory",
    SlurmState.BOOT_FAIL: "boot failure",
    SlurmState.DEADLINE: "deadline",
    SlurmState.FAILED: "failed",
}


class SlurmExecutor:
    kind = "slurm"

    def __init__(self, client: SlurmClient, site: SiteConfig) -> None:
        self.client = client
        self.site = site
        self.last_queue: dict[str, QueuedJob] = {}
        self._recover_queue: Optional[tuple[float, list[QueuedJob]]] = None

    def capacity(self) -> Optional[int]:
        return None  # Slurm queues; we never hold trials back

    def plan(self, spec: RunSpec) -> SbatchRequest:
        ident = Identity(*spec.identity, tag=experiment_tag(str(RunPaths.from_run_dir(spec.run_dir).exp_root)))
        python = self.site.python or sys.executable
        return plan_trial_run(
            config=spec.config,
            site=self.site,
            ident=ident,
            env=spec.env,
            run_dir=str(spec.run_dir),
            log_path=str(spec.log_path),
            python=python,
        )

    def submit(self, spec: RunSpec) -> str:
        req = self.plan(spec)
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        return self._sbatch(req)

    def _sbatch(self, req: SbatchRequest) -> str:
        from detslurm.slurm.client import SlurmCommandError

        try:
            return self.client.sbatch(req.args, req.script)
        except SlurmCommandError as e:
            if e.unreachable:
                raise SchedulerUnavailable(str(e)) from e
            raise

    def submit_many(self, specs: Sequence[RunSpec]) -> list[str | Exception]:
        """Submit many runs at once: runs of one experiment with the same run number share their
        resources, so each group goes as job arrays (one sbatch per array, not per trial).
        Returns each spec's job id (``ARRAY_TASK``), or the error that kept it from starting."""
        out: dict[int, str | Exception] = {}
        groups: dict[str, list[int]] = {}
        for i, spec in enumerate(specs):
            shared = [spec.identity[0], spec.identity[2], spec.config.get("resources"), spec.config.get("slurm")]
            key = json.dumps(shared, sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
        for idxs in groups.values():
            for chunk in self._chunks(sorted(idxs, key=lambda i: specs[i].identity[1]), specs):
                group = [specs[i] for i in chunk]
                try:
                    ids: list[str | Exception] = (
                        [*self.submit_array(group)] if len(group) > 1 else [self.submit(group[0])]
                    )
                except Exception as e:  # the whole sbatch failed: none of its runs started
                    ids = [e] * len(group)
                out.update(zip(chunk, ids, strict=True))
        return [out[i] for i in range(len(specs))]

    def _chunks(self, order: list[int], specs: Sequence[RunSpec]) -> list[list[int]]:
        """Split (spec indices sorted by trial) so that task ids stay below MaxArraySize and
        scripts stay small."""
        limit = max(1, self.client.capabilities().max_array_size - 1)
        chunks: list[list[int]] = []
        size = 0
        for i in order:
            cost = sum(len(k) + len(v) for k, v in specs[i].env.items()) // 4  # most of it is shared
            base = specs[chunks[-1][0]].identity[1] if chunks else 0
            if not chunks or specs[i].identity[1] - base >= limit or size + cost > ARRAY_SCRIPT_BUDGET:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += cost
        return chunks

    def plan_array(self, specs: Sequence[RunSpec]) -> SbatchRequest:
        first = specs[0]
        exp = RunPaths.from_run_dir(first.run_dir).exp
        ident = Identity(
            first.identity[0], first.identity[1], first.identity[2], tag=experiment_tag(str(exp.root)), array=True
        )
        links = exp.array_links(ident.trial_id, ident.run_id)
        tasks = [ArrayTask(s.identity[1], str(s.run_dir), s.env) for s in specs]
        return plan_array(
            config=first.config,
            site=self.site,
            ident=ident,
            tasks=tasks,
            links_dir=str(links),
            log_name=first.log_path.name,
            python=self.site.python or sys.executable,
        )

    def submit_array(self, specs: Sequence[RunSpec]) -> list[str]:
        req = self.plan_array(specs)
        links = Path(next(a for a in req.args if a.startswith("--chdir=")).removeprefix("--chdir="))
        if links.exists():  # left by a controller that died before this submission
            shutil.rmtree(links)
        links.mkdir(parents=True)
        base = specs[0].identity[1]
        for spec in specs:
            spec.run_dir.mkdir(parents=True, exist_ok=True)
            (links / str(spec.identity[1] - base)).symlink_to(spec.run_dir.resolve(), target_is_directory=True)
        array_id = self._sbatch(req)
        return [f"{array_id}_{spec.identity[1] - base}" for spec in specs]

    def recover(self, identity: tuple[int, int, int], exp_dir: str = "") -> Optional[str]:
        """Find a job submitted just before a crash, by its comment (contract 4)."""
        tag = experiment_tag(exp_dir) if exp_dir else ""
        # One squeue serves every run recovered in this tick (an array's worth of them).
        if self._recover_queue is None or time.monotonic() - self._recover_queue[0] > RECOVER_CACHE_S:
            self._recover_queue = (time.monotonic(), self.client.squeue())
        for job in self._recover_queue[1]:
            same_store = job.comment.endswith(f",tag={tag}") if tag else ",tag=" not in job.comment
            if job.identity == identity and same_store:
                return job.job_id
        return None

    def poll(self, jobs: Mapping[str, Path]) -> dict[str, JobStatus]:
        if not jobs:
            return {}
        self.last_queue = {j.job_id: j for j in self.client.squeue()}
        gone = [j for j, d in jobs.items() if j not in self.last_queue]
        accounted = self.client.sacct(gone) if gone and self.client.capabilities().accounting else {}
        return {job_id: self._status(job_id, run_dir, accounted.get(job_id)) for job_id, run_dir in jobs.items()}

    def _status(self, job_id: str, run_dir: Path, acct: Optional[AccountedJob] = None) -> JobStatus:
        q = self.last_queue.get(job_id)
        record = _exit_record(run_dir)
        reason = _REASONS.get(q.state) if q is not None else None
        if q is None and acct is not None and acct.state.is_terminal:
            # Left the queue (MinJobAge) but slurmdbd knows how it ended.
            code = record.code if record.code is not None else acct.exit_code
            return JobStatus(JobState.EXITED, code, _REASONS.get(acct.state))
        if q is not None and q.state == SlurmState.COMPLETING:
            return JobStatus(JobState.RUNNING)  # the final state (PREEMPTED, TIMEOUT...) is next
        if record.present and (q is None or q.state.is_terminal):
            return JobStatus(JobState.EXITED, record.code, reason or _problem(record))
        if q is None:
            return JobStatus(JobState.UNKNOWN, None, "job left the queue without an exit record")
        if q.state.is_terminal:
            return JobStatus(JobState.EXITED, None, reason)
        if q.state == SlurmState.PENDING:
            return JobStatus(JobState.QUEUED, None, None if q.reason in ("None", "(null)") else q.reason)
        return JobStatus(JobState.RUNNING)

    def signal(self, job_id: str, signum: int) -> None:
        import signal as sigmod

        name = sigmod.Signals(signum).name.removeprefix("SIG")
        self.client.scancel(job_id, signal=name, batch_too=True)

    def kill(self, job_id: str) -> None:
        self.client.scancel(job_id)

    def kill_many(self, job_ids: Sequence[str]) -> None:
        from detslurm.slurm.client import SlurmCommandError

        for i in range(0, len(job_ids), 500):  # bounded command lines
            try:
                self.client.scancel(job_ids[i : i + 500])
            except SlurmCommandError as e:
                # scancel cancels the rest and complains about jobs that ended meanwhile: fine.
                ended = ("Invalid job id", "already completing or completed")
                if not all(any(m in line for m in ended) for line in e.stderr.splitlines() if line.strip()):
                    raise


def _exit_record(run_dir: Path) -> ExitOutcome:
    """The run's exit record as the trial side left it; never raises (review H1)."""
    return exit_outcome(exit_record_of(run_dir))


def _problem(record: ExitOutcome) -> str | None:
    return f"unreadable exit record: {record.problem}" if record.problem else None


def queued(executor: object) -> Sequence[QueuedJob]:
    return list(getattr(executor, "last_queue", {}).values())
