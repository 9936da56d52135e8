"""How many more jobs this user may put in Slurm's queue: the limits a submission would be
refused for (slurm.conf ``MaxJobCount``, the associations' ``MaxSubmitJobs``) minus what the
tick's one squeue answer shows, and how to tell such a refusal from an error of the job.

Pure functions: ``SlurmExecutor.capacity()`` feeds them the cached limits and the queue."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from detslurm.slurm.parse import Capabilities, QueuedJob
from detslurm.slurm.partitions import AssocLimit
from detslurm.slurm.states import SlurmState

# What sbatch prints when slurmctld refused a job for a limit that frees up as jobs end. The
# reason codes come on their own line before "Batch job submission failed: Job violates
# accounting/QOS policy (job submit limit, user's size and/or time limits)"; that last line
# alone is also printed for size and time limits, which waiting never clears, so it is not here.
LIMIT_REFUSALS = (
    "MaxSubmitJob",  # AssocMaxSubmitJobLimit, QOSMaxSubmitJobPerUserLimit, ...PerAccountLimit
    "GrpSubmitJob",  # AssocGrpSubmitJobsLimit, QOSGrpSubmitJobsLimit
    # MaxJobCount reached (ESLURM_ERROR_ON_DESC_TO_RECORD_COPY): sbatch itself first sleeps and
    # resends for about two minutes, then prints this.
    "Unable to create job record",
    "Slurm job queue full",
)

# Records squeue shows that no longer count against MaxSubmitJobs (they still hold a job record
# until MinJobAge passes, so they count against MaxJobCount).
_ENDED = frozenset(
    {
        SlurmState.COMPLETED,
        SlurmState.FAILED,
        SlurmState.CANCELLED,
        SlurmState.TIMEOUT,
        SlurmState.PREEMPTED,
        SlurmState.NODE_FAIL,
        SlurmState.OUT_OF_MEMORY,
        SlurmState.BOOT_FAIL,
        SlurmState.DEADLINE,
    }
)


@dataclass(frozen=True)
class SubmitLimits:
    """The limits that refuse a submission. ``None``: no such limit here."""

    # slurm.conf MaxJobCount: job records slurmctld holds for every user together, ended jobs
    # included until MinJobAge; other users' records are invisible to us, hence the margin.
    max_job_count: Optional[int]
    # The lowest MaxSubmitJobs of the user's associations (the job may go to any of them:
    # the lowest is the conservative one). Pending array tasks count one each.
    max_submit_jobs: Optional[int]


@dataclass(frozen=True)
class QueueCount:
    """This user's jobs in one squeue answer (``-r``: an array's tasks one line each)."""

    live: int  # pending, running, suspended, completing: what MaxSubmitJobs counts
    records: int  # every line, ended ones too: what MaxJobCount counts


def submit_limits(caps: Capabilities, assocs: Sequence[AssocLimit]) -> SubmitLimits:
    """The limits from ``scontrol show config`` and the user's associations (none where the
    site has no accounting)."""
    submit = [a.max_submit_jobs for a in assocs if a.max_submit_jobs is not None]
    return SubmitLimits(
        max_job_count=caps.max_job_count if caps.max_job_count > 0 else None,  # 0: no limit
        max_submit_jobs=min(submit) if submit else None,
    )


def count_queue(jobs: Iterable[QueuedJob]) -> QueueCount:
    live = records = 0
    for job in jobs:
        records += 1
        live += job.state not in _ENDED
    return QueueCount(live=live, records=records)


def margin(limit: int, share: int) -> int:
    """Slots kept free below ``limit``: 1/``share`` of it, at least one where the limit is big
    enough to spare one (jobs submitted outside detslurm between two ticks, other users)."""
    return max(1, limit // share) if limit > share else 0


# Shares kept free: MaxSubmitJobs is this user's alone (only their other submissions between
# ticks race us); MaxJobCount is shared with every user, whose jobs squeue -u does not show.
SUBMIT_MARGIN_SHARE = 20
JOB_COUNT_MARGIN_SHARE = 10


def headroom(limits: SubmitLimits, queue: QueueCount, submitted: int) -> Optional[int]:
    """How many more jobs (array tasks one each) may be submitted now; None where no limit
    applies. ``submitted``: jobs submitted since the queue was read (not in it yet)."""
    room: Optional[int] = None
    if limits.max_submit_jobs is not None:
        lim = limits.max_submit_jobs
        room = lim - margin(lim, SUBMIT_MARGIN_SHARE) - queue.live - submitted
    if limits.max_job_count is not None:
        lim = limits.max_job_count
        by_count = lim - margin(lim, JOB_COUNT_MARGIN_SHARE) - queue.records - submitted
        room = by_count if room is None else min(room, by_count)
    return None if room is None else max(0, room)


def is_limit_refusal(message: str) -> bool:
    """Whether sbatch's message says a limit that frees up as jobs end refused the job."""
    return any(m in message for m in LIMIT_REFUSALS)


@dataclass
class Throttle:
    """What ``SlurmExecutor.capacity()`` keeps between ticks."""

    limits: Optional[SubmitLimits] = None
    limits_at: float = 0.0
    queue_at: float = float("-inf")  # when last_queue was read (never: stale)
    submitted: int = 0  # jobs (array tasks one each) submitted since last_queue was read
    refused_at: Optional[int] = None  # live jobs when Slurm last refused one for a limit
    warned: bool = False  # a refusal was reported since submissions last went through
