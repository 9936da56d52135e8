"""Determined's job queue on Slurm: list the queue, and turn queue edits into scontrol calls.

Plan, then execute: :func:`plan_update` is pure (it reads a squeue snapshot and the caller's
rights) and returns the scontrol operations, which ``--dry-run`` prints and
:func:`execute` runs through the one Slurm client.

Priority direction. Determined: 1..99, smaller is higher, 42 by default. Slurm: larger is higher.
detslurm maps Determined's priority onto the job's *nice* value, which every Slurm allows a user
to raise on their own jobs (lowering their priority), and only admins to lower:
``nice = (priority - 42) * NICE_STEP``. So priority 50 lowers a job (nice 800), and priority 10
raises it (nice -3200: admins only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from detslurm.errors import DetSlurmError
from detslurm.slurm.client import SlurmClient
from detslurm.slurm.parse import Capabilities, QueuedJob, comment_tag, experiment_tag
from detslurm.slurm.states import SlurmState

if TYPE_CHECKING:  # pydantic is not needed to list the queue
    from detslurm.slurm.site import SiteConfig

DEFAULT_PRIORITY = 42
NICE_STEP = 100


class QueueError(DetSlurmError):
    """A queue edit that cannot be done; the message says why and what to do instead."""

    pass


def nice_for(priority: int) -> int:
    """The Slurm nice value for a Determined priority (1..99, smaller is higher; see the module doc)."""
    if not 1 <= priority <= 99:
        # Determined's own range and message.
        raise QueueError("priority must be between 1 and 99")
    return (priority - DEFAULT_PRIORITY) * NICE_STEP


def priority_for(nice: int) -> int:
    """The Determined priority shown for a job's nice value, clamped to 1..99 (nice set by hand may be off-scale)."""
    return max(1, min(99, DEFAULT_PRIORITY + round(nice / NICE_STEP)))


@dataclass(frozen=True)
class Caller:
    user: str
    admin: bool  # root or SlurmUser: may raise priorities and touch any job


@dataclass(frozen=True)
class Op:
    """One scontrol call; ``describe()`` is what --dry-run shows."""

    verb: str  # update | top | hold | release
    job_id: str
    fields: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.fields)
        if self.verb == "update":
            return f"scontrol update JobId={self.job_id} {extra}"
        return f"scontrol {self.verb} {self.job_id}"


@dataclass(frozen=True)
class PoolMove:
    """A running detslurm trial moves pool by checkpointing and being resubmitted there."""

    experiment_id: int
    pool: str
    # The job comment's experiment-dir tag: the id alone may be another store's experiment
    # so ops.move_to_pool moves only the experiment whose dir has this tag.
    tag: str = ""

    def describe(self) -> str:
        return f"move experiment {self.experiment_id} to pool {self.pool} (running trials checkpoint and resubmit)"


@dataclass(frozen=True)
class SavePriority:
    """A detslurm trial's new priority is also kept in its experiment's config, so the trial's
    next Slurm job (a restart, a resume) is submitted with the same nice."""

    experiment_id: int
    priority: int
    tag: str = ""  # the job comment's experiment-dir tag, checked as for PoolMove

    def describe(self) -> str:
        return f"keep priority {self.priority} for experiment {self.experiment_id}'s later submissions"


def _find(queue: Sequence[QueuedJob], job_id: str) -> QueuedJob:
    # Accept both forms users see: ``123_4`` (squeue's array task) and the raw job id.
    for j in queue:
        if j.job_id == job_id or str(j.raw_id) == job_id:
            if j.state.is_terminal:
                raise QueueError(f"job {job_id} has already ended ({j.state.value})")
            return j
    raise QueueError(f"job {job_id} not found")


def _own(job: QueuedJob, caller: Caller) -> None:
    if job.user != caller.user and not caller.admin:
        raise QueueError(f"job {job.job_id} belongs to {job.user}; you can only change your own jobs")


def plan_priority(job: QueuedJob, priority: int, caller: Caller) -> list[Op | SavePriority]:
    nice = nice_for(priority)
    # Check before calling scontrol: Slurm's own refusal ("Access/permission denied") would not say
    # that only the direction is the problem.
    if nice < job.nice and not caller.admin:
        raise QueueError(
            f"cannot raise job {job.job_id} to priority {priority}: Slurm lets ordinary users only lower the "
            f"priority of their own jobs (Determined's scale: a larger number is lower; this job is at "
            f"{priority_for(job.nice)}). Ask a Slurm operator or admin to raise it."
        )
    ops: list[Op | SavePriority] = [Op("update", job.job_id, (("Nice", str(nice)),))]
    if job.identity is not None:
        ops.append(SavePriority(job.identity[0], priority, comment_tag(job.comment)))
    return ops


def plan_ahead_of(job: QueuedJob, other: QueuedJob, caller: Caller, caps: Capabilities) -> list[Op]:
    if job.priority > other.priority:
        return []
    if caller.admin:
        # An explicit Priority pins the job's priority (Slurm stops recomputing it), which only admins may
        # set; one above the other job is enough.
        return [Op("update", job.job_id, (("Priority", str(other.priority + 1)),))]
    if caps.enable_user_top and other.user == caller.user and other.partition == job.partition:
        # scontrol top lets a user reorder their own pending jobs, but only where the site enabled it,
        # and only within one partition.
        return [Op("top", job.job_id)]
    if other.user == caller.user:
        # Lowering the other job is always allowed for its owner.
        return plan_behind_of(other, job, caller)
    why = (
        "this site does not set SchedulerParameters=enable_user_top"
        if not caps.enable_user_top
        else "scontrol top only reorders your own jobs in one partition"
    )
    raise QueueError(
        f"cannot move job {job.job_id} ahead of job {other.job_id}: {why}, and only admins may raise a priority"
    )


def plan_behind_of(job: QueuedJob, other: QueuedJob, caller: Caller) -> list[Op]:
    if job.priority < other.priority:
        return []
    # Slurm subtracts nice from the computed priority, so raising nice by the gap (+1) puts the job
    # just behind; users may always raise the nice of their own jobs.
    delta = job.priority - other.priority + 1
    return [Op("update", job.job_id, (("Nice", str(job.nice + delta)),))]


def plan_pool(job: QueuedJob, pool: str, site: SiteConfig) -> list[Op | PoolMove]:
    _name, p = site.pool(pool)
    ids = job.identity
    # A pending job can switch partition in place; the store must follow (PoolMove), or the next
    # resubmission would go back to the old pool.
    if job.state == SlurmState.PENDING:
        ops: list[Op | PoolMove] = [Op("update", job.job_id, (("Partition", p.partition),))]
        if ids is not None:
            ops.append(PoolMove(ids[0], pool, comment_tag(job.comment)))
        return ops
    if ids is None:
        raise QueueError(
            f"job {job.job_id} is running: Slurm cannot move a running job to another partition; cancel and resubmit it"
        )
    # Running: Slurm cannot move it, but a detslurm trial can checkpoint and be resubmitted in the new
    # pool, as Determined does (its master restarts the trials in the new pool).
    return [PoolMove(ids[0], pool, comment_tag(job.comment))]


def plan_update(
    queue: Sequence[QueuedJob],
    job_id: str,
    caller: Caller,
    caps: Capabilities,
    site: SiteConfig,
    *,
    priority: Optional[int] = None,
    ahead_of: Optional[str] = None,
    behind_of: Optional[str] = None,
    resource_pool: Optional[str] = None,
    hold: bool = False,
    release: bool = False,
) -> list[Op | PoolMove | SavePriority]:
    job = _find(queue, job_id)
    _own(job, caller)
    # One change per call, as Determined's ``det job update`` takes one of its options.
    chosen = [x for x in (priority, ahead_of, behind_of, resource_pool) if x is not None] + [1] * (hold + release)
    if len(chosen) != 1:
        raise QueueError("give exactly one of --priority, --ahead-of, --behind-of, --resource-pool, --hold, --release")
    if priority is not None:
        return list(plan_priority(job, priority, caller))
    if ahead_of is not None:
        return list(plan_ahead_of(job, _find(queue, ahead_of), caller, caps))
    if behind_of is not None:
        return list(plan_behind_of(job, _find(queue, behind_of), caller))
    if resource_pool is not None:
        return list(plan_pool(job, resource_pool, site))
    if job.state != SlurmState.PENDING:
        raise QueueError(f"job {job.job_id} is {job.state.value.lower()}: only pending jobs can be held or released")
    return [Op("hold" if hold else "release", job.job_id)]


def execute(client: SlurmClient, ops: Sequence[Op]) -> None:
    """Run planned scontrol operations in order through the one Slurm client (contract 6)."""
    for op in ops:
        if op.verb == "update":
            client.update(op.job_id, **dict(op.fields))
        elif op.verb == "top":
            client.top(op.job_id)
        elif op.verb == "hold":
            client.hold(op.job_id)
        elif op.verb == "release":
            client.release(op.job_id)


def parse_batch(items: Sequence[str]) -> list[tuple[str, str, str]]:
    """``ID.priority=N ID.resource-pool=P ...`` (Determined's update-batch format)."""
    out = []
    for item in items:
        head, sep, value = item.partition("=")
        job, dot, op = head.partition(".")
        # Determined accepts both ``resource_pool`` and ``resource-pool``.
        op = op.replace("_", "-")
        if not sep or not dot or not job or op not in ("priority", "resource-pool", "ahead-of", "behind-of"):
            raise QueueError(
                f"{item!r}: please ensure the update is formatted as <jobID>.<operation>=<value>, "
                "with operation priority, resource-pool, ahead-of or behind-of"
            )
        out.append((job, op, value))
    return out


def trial_job_names(jobs: Sequence[QueuedJob], experiments: dict[int, tuple[str, str]]) -> dict[str, str]:
    """Job id -> "<experiment name> (<id>) trial <t>" for the jobs that are trials of
    ``experiments`` (id -> (name, experiment dir), the store's rows the caller may see)."""
    names = {i: (name, experiment_tag(d)) for i, (name, d) in experiments.items()}
    out: dict[str, str] = {}
    for j in jobs:
        i = j.identity  # (experiment, trial, run) from the job comment; foreign jobs have None
        # The tag tells our experiment 1 from another store's (or another user's) experiment 1.
        if i and i[0] in names and comment_tag(j.comment) == names[i[0]][1]:
            out[j.job_id] = f"{names[i[0]][0]} ({i[0]}) trial {i[1]}"
    return out


def detached_job_names(rows: Sequence[tuple[str | None, int, int, str]]) -> dict[str, str]:
    """Job id -> "<experiment name> (<id>) trial <t> (detached)" from (job id, trial id,
    experiment id, experiment name) rows, oldest run first (a requeued job's latest run names it)."""
    return {job: f"{name} ({exp_id}) trial {trial_id} (detached)" for job, trial_id, exp_id, name in rows if job}
