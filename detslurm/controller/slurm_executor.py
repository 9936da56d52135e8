"""Run trial runs as Slurm jobs: render + sbatch to submit, one squeue per tick to observe."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from detslurm.controller.executor import JobState, JobStatus, RunSpec
from detslurm.controller.layout import exit_file
from detslurm.slurm.client import SlurmClient
from detslurm.slurm.parse import AccountedJob, QueuedJob, experiment_tag, trial_comment
from detslurm.slurm.render import Identity, SbatchRequest, plan_trial_run
from detslurm.slurm.site import SiteConfig
from detslurm.slurm.states import SlurmState
from detslurm.util import read_json

# How a job that ended without writing its own exit record ended, as we show it.
_REASONS = {
    SlurmState.PREEMPTED: "preempted", SlurmState.TIMEOUT: "time limit", SlurmState.NODE_FAIL: "node failure",
    SlurmState.CANCELLED: "canceled", SlurmState.OUT_OF_MEMORY: "out of memory", SlurmState.BOOT_FAIL: "boot failure",
    SlurmState.DEADLINE: "deadline", SlurmState.FAILED: "failed",
}


class SlurmExecutor:
    kind = "slurm"

    def __init__(self, client: SlurmClient, site: SiteConfig) -> None:
        self.client = client
        self.site = site
        self.last_queue: dict[str, QueuedJob] = {}

    def capacity(self) -> Optional[int]:
        return None  # Slurm queues; we never hold trials back

    def plan(self, spec: RunSpec) -> SbatchRequest:
        ident = Identity(*spec.identity, tag=experiment_tag(str(spec.run_dir.parent.parent.parent.parent)))
        python = self.site.python or sys.executable
        return plan_trial_run(config=spec.config, site=self.site, ident=ident, env=spec.env,
                              run_dir=str(spec.run_dir), log_path=str(spec.log_path), python=python)

    def submit(self, spec: RunSpec) -> str:
        req = self.plan(spec)
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        return self.client.sbatch(req.args, req.script)

    def recover(self, identity: tuple[int, int, int], exp_dir: str = "") -> Optional[str]:
        """Find a job submitted just before a crash, by its comment (contract 4)."""
        wanted = trial_comment(*identity, experiment_tag(exp_dir) if exp_dir else "")
        for job in self.client.squeue():
            if job.comment == wanted:
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
        record = read_json(exit_file(run_dir), None)
        reason = _REASONS.get(q.state) if q is not None else None
        if q is None and acct is not None and acct.state.is_terminal:
            # Left the queue (MinJobAge) but slurmdbd knows how it ended.
            code = int(record["code"]) if record is not None else acct.exit_code
            return JobStatus(JobState.EXITED, code, _REASONS.get(acct.state))
        if q is not None and q.state == SlurmState.COMPLETING:
            return JobStatus(JobState.RUNNING)  # the final state (PREEMPTED, TIMEOUT...) is next
        if record is not None and (q is None or q.state.is_terminal):
            return JobStatus(JobState.EXITED, int(record["code"]), reason)
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


def queued(executor: object) -> Sequence[QueuedJob]:
    return list(getattr(executor, "last_queue", {}).values())
