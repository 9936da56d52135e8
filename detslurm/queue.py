"""Determined's job queue on Slurm: list the queue, and turn queue edits into scontrol calls.

Plan, then execute: :func:`plan_update` is pure (it reads a squeue snapshot and the caller's
rights) and returns the scontrol operations, which ``--dry-run`` prints and
:func:`execute` runs through the one Slurm client.

Priority direction. Determined: 1..99, smaller is higher, 42 by default. Slurm: larger is higher.
detslurm maps Determined's priority onto the job's *nice* value, which every Slurm allows a user
to raise on their own jobs (lowering their priority), and only admins to lower:
``nice = (priority - 42) * NICE_STEP``. So priority 50 lowers a job (nice 800), and priority 10
raises it (nice -3200: admins only).

Pool moves. A pending trial's job takes the target pool's resources, as a fresh submission
there would get them (:class:`Shape`, from the same resource plan as sbatch's): one ``scontrol
update`` where Slurm can change every field in place, else (taking a GRES off, a different node
count, which its script fixes) the job is replaced: canceled while still queued and its trial
resubmitted in the new pool. A job that is no detslurm trial is only ever changed in place.
Either way the trial's experiment keeps the pool (and a priority) for its later submissions:
a change that cannot be kept there is refused, or (a priority) said to be for this job only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from detslurm.errors import DetSlurmError
from detslurm.slurm.client import SlurmClient
from detslurm.slurm.parse import Capabilities, QueuedJob, comment_tag, experiment_tag
from detslurm.slurm.states import SlurmState

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
class Keeper:
    """Where the experiment a trial's job belongs to keeps queue edits for its later submissions.

    ``where`` names the store in words; ``missing`` says why the experiment cannot be reached
    there ("" when it can). ``tag`` is the job comment's experiment-dir tag: the id alone may be
    another store's experiment, so only the experiment whose dir has this tag is changed."""

    experiment_id: int
    tag: str
    where: str
    missing: str = ""


@dataclass(frozen=True)
class PoolMove:
    """The experiment keeps the new pool; its running trials checkpoint and are resubmitted there."""

    experiment_id: int
    pool: str
    tag: str = ""
    where: str = "this store"

    def describe(self) -> str:
        return (
            f"move experiment {self.experiment_id} ({self.where}) to pool {self.pool}: its later submissions "
            "go there, its running trials checkpoint and resubmit there"
        )


@dataclass(frozen=True)
class Replace:
    """A queued trial job whose resources scontrol cannot change in place: canceled while still
    pending (``scancel --state=PENDING``), its trial resubmitted in the new pool by the owner's
    controller, with no restart spent. The experiment moves as for :class:`PoolMove`."""

    job_id: str
    experiment_id: int
    pool: str
    why: str
    tag: str = ""
    where: str = "this store"

    def describe(self) -> str:
        return (
            f"scancel --state=PENDING {self.job_id}, then resubmit its trial in pool {self.pool} "
            f"(in place, {self.why}); move experiment {self.experiment_id} ({self.where}) to pool {self.pool}"
        )


@dataclass(frozen=True)
class SavePriority:
    """A detslurm trial's new priority is also kept in its experiment's config, so the trial's
    next Slurm job (a restart, a resume) is submitted with the same nice."""

    experiment_id: int
    priority: int
    tag: str = ""
    where: str = "this store"

    def describe(self) -> str:
        return f"keep priority {self.priority} for experiment {self.experiment_id}'s later submissions ({self.where})"


@dataclass(frozen=True)
class NotKept:
    """A change made to this job only: its experiment could not be reached (said, never silent)."""

    text: str

    def describe(self) -> str:
        return f"not kept: {self.text}"


@dataclass(frozen=True)
class Shape:
    """What a job asks of Slurm in a pool, in the terms ``scontrol update`` changes.

    For a trial, what a fresh submission in the pool would ask (``nodes`` set): built from the
    same resource plan as its sbatch (controller/queue_store.py). For a job that is no detslurm
    trial only what the pool itself sets (``nodes`` None: its shape is its owner's)."""

    partition: str
    gpu_pool: bool = False
    nodes: Optional[int] = None
    gres: str = ""  # sbatch's --gres value ("gpu:2"), "" for none
    cpus_per_task: int = 1
    account: str = ""
    qos: str = ""
    time: str = ""  # sbatch's --time value, "" for the partition's default
    extra: tuple[str, ...] = ()  # the pool's extra_sbatch_args
    image: str = ""  # the container image the script names, "" for none


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


def plan_priority(
    job: QueuedJob, priority: int, caller: Caller, keeper: Optional[Keeper]
) -> list[Op | SavePriority | NotKept]:
    nice = nice_for(priority)
    # Check before calling scontrol: Slurm's own refusal ("Access/permission denied") would not say
    # that only the direction is the problem.
    if nice < job.nice and not caller.admin:
        raise QueueError(
            f"cannot raise job {job.job_id} to priority {priority}: Slurm lets ordinary users only lower the "
            f"priority of their own jobs (Determined's scale: a larger number is lower; this job is at "
            f"{priority_for(job.nice)}). Ask a Slurm operator or admin to raise it."
        )
    ops: list[Op | SavePriority | NotKept] = [Op("update", job.job_id, (("Nice", str(nice)),))]
    if keeper is None:
        return ops
    if keeper.missing:
        # The job's nice is worth changing alone (it is the job's place in the queue now), but
        # the message must not claim more.
        ops.append(
            NotKept(
                f"priority {priority} is for job {job.job_id} only: experiment {keeper.experiment_id}'s later "
                f"submissions keep their priority ({keeper.missing})"
            )
        )
    else:
        ops.append(SavePriority(keeper.experiment_id, priority, keeper.tag, keeper.where))
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


def _first_int(text: str, default: int) -> int:
    head = text.split("-")[0]
    return int(head) if head.isdigit() else default


def _gres(tres_per_node: str) -> str:
    """``gres:gpu:2`` (22.05) or ``gres/gpu:2`` (24.11) as sbatch's --gres spells it (``gpu:2``)."""
    text = tres_per_node.strip()
    if text in ("", "(null)"):
        return ""
    return text.removeprefix("gres:").removeprefix("gres/")


def _seconds(text: str) -> Optional[int]:
    from detslurm.slurm.partitions import parse_duration_s

    try:
        return parse_duration_s(text)
    except ValueError:
        return -1  # unreadable: differs from anything, so it is set and Slurm judges it


def _shape_fields(shown: Mapping[str, str], dst: Shape) -> tuple[list[tuple[str, str]], list[str]]:
    """The node shape of a trial's job: scontrol fields to set, and why it cannot be done in place."""
    fields: list[tuple[str, str]] = []
    why: list[str] = []
    assert dst.nodes is not None
    nodes = _first_int(shown.get("NumNodes", ""), dst.nodes)
    if nodes != dst.nodes:
        why.append(f"its script starts its launcher on {nodes} node(s) and this pool gives it {dst.nodes}")
    have = _gres(shown.get("TresPerNode", ""))
    if dst.gres and have != dst.gres:
        # 22.05 reads only the gres: form (gres/ is "Invalid Trackable RESource"); 24.11 reads both.
        fields.append(("TresPerNode", f"gres:{dst.gres}"))
    elif have and not dst.gres:
        why.append(
            f"Slurm cannot take a GRES ({have}) off a pending job: it would keep asking for nodes with "
            "that GRES and never start (BadConstraints)"
        )
    cpt = dst.cpus_per_task
    want = {"CPUs/Task": cpt, "MinCPUsNode": cpt, "NumCPUs": cpt * dst.nodes}
    if any(_first_int(shown.get(k, ""), -1) != v for k, v in want.items()):
        fields += [("CPUsPerTask", str(cpt)), ("MinCPUsNode", str(cpt)), ("NumCPUs", str(cpt * dst.nodes))]
    return fields, why


def _limit_fields(
    shown: Mapping[str, str], src: Optional[Shape], dst: Shape
) -> tuple[list[tuple[str, str]], list[str]]:
    """Account, QOS, time limit and the pool's extra arguments."""
    fields: list[tuple[str, str]] = []
    why: list[str] = []
    for key, name, value, before in (
        ("Account", "account", dst.account, src.account if src else ""),
        ("QOS", "QOS", dst.qos, src.qos if src else ""),
    ):
        if value and shown.get(key) != value:
            fields.append((key, value))
        elif before and not value:
            why.append(
                f"this pool sets no {name} and Slurm cannot reset a pending job's {name} ({before}) to the default"
            )
    if dst.time and _seconds(dst.time) != _seconds(shown.get("TimeLimit", "")):
        fields.append(("TimeLimit", dst.time))
    elif src is not None and src.time and not dst.time:
        why.append(
            f"this pool sets no time limit and Slurm cannot reset a pending job's ({src.time}) to its "
            "partition's default"
        )
    if dst.extra != (src.extra if src else ()):
        why.append("the pools' extra_sbatch_args differ and have no scontrol form")
    return fields, why


def in_place(
    shown: Mapping[str, str], src: Optional[Shape], dst: Shape
) -> tuple[tuple[tuple[str, str], ...], list[str]]:
    """The ``scontrol update`` fields that give a pending job ``dst`` (its shape in the target
    pool; ``src`` its shape in its pool, None for a job that is no trial) and the reasons it
    cannot be done in place ([] when it can). ``shown`` is ``scontrol show job``'s view of it."""
    fields: list[tuple[str, str]] = []
    why: list[str] = []
    if shown.get("Partition") != dst.partition:
        fields.append(("Partition", dst.partition))
    if dst.nodes is not None:
        f, w = _shape_fields(shown, dst)
        fields, why = fields + f, why + w
        if src is not None and src.image != dst.image:
            why.append(f"its script runs image {src.image or '(none)'} and this pool's is {dst.image or '(none)'}")
    elif _gres(shown.get("TresPerNode", "")) and not dst.gpu_pool:
        why.append(
            "it asks for a GRES this CPU pool's nodes may not have, and Slurm cannot take a GRES off a pending job"
        )
    f, w = _limit_fields(shown, src, dst)
    return tuple(fields + f), why + w


def plan_pool(
    job: QueuedJob,
    pool: str,
    keeper: Optional[Keeper],
    shapes: tuple[Optional[Shape], Shape],
    shown: Mapping[str, str],
) -> list[Op | PoolMove | Replace]:
    """``shapes``: the job's shape in its pool (None for a job that is no trial) and in ``pool``."""
    if keeper is not None and keeper.missing:
        # Never half done: the partition must not change while the experiment stays (its later
        # submissions would go back to the old pool).
        raise QueueError(
            f"job {job.job_id} was not moved: it is a trial of experiment {keeper.experiment_id}, which cannot "
            f"be moved with it ({keeper.missing}); nothing changed"
        )
    if job.state != SlurmState.PENDING:
        if keeper is None:
            raise QueueError(
                f"job {job.job_id} is {job.state.value.lower()}: Slurm cannot move a running job to another "
                "partition; cancel and resubmit it"
            )
        # Running: Slurm cannot move it, but a detslurm trial can checkpoint and be resubmitted in the
        # new pool, as Determined does (its master restarts the trials in the new pool).
        return [PoolMove(keeper.experiment_id, pool, keeper.tag, keeper.where)]
    src, dst = shapes
    fields, why = in_place(shown, src, dst)
    if why and keeper is None:
        raise QueueError(f"job {job.job_id} cannot move to pool {pool} in place: {'; '.join(why)}; nothing changed")
    if keeper is None:
        return [Op("update", job.job_id, fields)] if fields else []
    if why:
        return [Replace(job.job_id, keeper.experiment_id, pool, "; ".join(why), keeper.tag, keeper.where)]
    ops: list[Op | PoolMove | Replace] = [Op("update", job.job_id, fields)] if fields else []
    return [*ops, PoolMove(keeper.experiment_id, pool, keeper.tag, keeper.where)]


def find_job(queue: Sequence[QueuedJob], job_id: str, caller: Caller) -> QueuedJob:
    """The job ``job_id`` names, if it is still in the queue and the caller may change it."""
    job = _find(queue, job_id)
    _own(job, caller)
    return job


def plan_update(
    queue: Sequence[QueuedJob],
    job_id: str,
    caller: Caller,
    caps: Capabilities,
    *,
    keeper: Optional[Keeper] = None,
    priority: Optional[int] = None,
    ahead_of: Optional[str] = None,
    behind_of: Optional[str] = None,
    pool: Optional[tuple[str, tuple[Optional[Shape], Shape], Mapping[str, str]]] = None,
    hold: bool = False,
    release: bool = False,
) -> list[Op | PoolMove | Replace | SavePriority | NotKept]:
    """``keeper``: the job's experiment, for a detslurm trial. ``pool``: the target pool's name,
    the job's shapes (see :func:`plan_pool`) and ``scontrol show job``'s fields of the job."""
    job = find_job(queue, job_id, caller)
    # One change per call, as Determined's ``det job update`` takes one of its options.
    chosen = [x for x in (priority, ahead_of, behind_of, pool) if x is not None] + [1] * (hold + release)
    if len(chosen) != 1:
        raise QueueError("give exactly one of --priority, --ahead-of, --behind-of, --resource-pool, --hold, --release")
    if priority is not None:
        return list(plan_priority(job, priority, caller, keeper))
    if ahead_of is not None:
        return list(plan_ahead_of(job, _find(queue, ahead_of), caller, caps))
    if behind_of is not None:
        return list(plan_behind_of(job, _find(queue, behind_of), caller))
    if pool is not None:
        return list(plan_pool(job, pool[0], keeper, pool[1], pool[2]))
    if job.state != SlurmState.PENDING:
        raise QueueError(f"job {job.job_id} is {job.state.value.lower()}: only pending jobs can be held or released")
    if release and job.reason == "JobHeldAdmin" and not caller.admin:
        # Slurm's own answer is a bare "Access/permission denied".
        raise QueueError(
            f"job {job.job_id} is held by an administrator (Slurm's reason: JobHeldAdmin): only an "
            "administrator (root or the SlurmUser) can release it; ask yours"
        )
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
