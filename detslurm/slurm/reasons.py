"""Slurm's pending reasons (squeue's REASON column) in words a user understands, and which of
them mean the job can never start.

One table, used by ``det e describe``, ``det t describe`` and ``det job list`` (words with
Slurm's code beside them) and by the executor, which ends a trial whose job waits for a
reason that no amount of waiting fixes (squeue(1) "JOB REASON CODES", Slurm 22.05-24.11).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class PendingReason:
    """One of Slurm's reason codes: what it means, and whether waiting can ever end it."""

    code: str
    words: str
    # True: the job can never start as submitted (its request is outside what the partition,
    # account or QOS allows). Only an admin changing the cluster's configuration would help, so
    # detslurm ends the trial with the reason instead of waiting forever.
    permanent: bool = False

    def shown(self) -> str:
        """``waiting for free nodes (Resources)``: the words, then Slurm's own code."""
        words = f"never runs: {self.words}" if self.permanent else self.words
        # "None" is Slurm's word for no reason at all: nothing to put beside the words.
        return f"{words} ({self.code})" if self.code not in ("", "None") else words


def _r(code: str, words: str, permanent: bool = False) -> tuple[str, PendingReason]:
    return code, PendingReason(code, words, permanent)


# Waiting reasons first, then the ones that never clear. Deliberately NOT permanent:
# ReqNodeNotAvail (nodes down or reserved: they come back), PartitionDown/PartitionInactive (an
# admin's temporary action), holds (the user or admin releases them), and every Grp* limit
# (aggregate limits free up as other jobs end).
REASONS: dict[str, PendingReason] = dict(
    [
        _r("Priority", "waiting for higher-priority jobs"),
        _r("Resources", "waiting for free nodes"),
        _r("None", "waiting to be scheduled"),
        _r("BeginTime", "waiting for its start time (--begin)"),
        _r("Dependency", "waiting for the jobs it depends on"),
        _r("JobHeldUser", "held (det e pause or scontrol hold); release to run"),
        _r("JobHeldAdmin", "held by an administrator"),
        _r("ReqNodeNotAvail", "waiting for nodes that are down, drained or reserved"),
        # What 22.05 says of a job that needs (every node of its partition, or by name) a drained
        # node: squeue prints the whole sentence, of which only the part before the comma counts.
        _r("Nodes required for job are DOWN", "waiting for nodes that are down, drained or reserved"),
        _r("NodeDown", "waiting for a node that is down"),
        _r("PartitionDown", "waiting: the partition is down"),
        _r("PartitionInactive", "waiting: the partition is inactive"),
        _r("Reservation", "waiting for its reservation to start"),
        _r("Licenses", "waiting for licenses"),
        _r("BurstBufferResources", "waiting for burst buffer space"),
        _r("Prolog", "running the node prolog"),
        _r("Cleaning", "waiting for its previous run to finish cleaning up"),
        _r("JobArrayTaskLimit", "waiting: the array's max_slots throttle is reached"),
        _r("QOSJobLimit", "waiting: the QOS's job limit is reached"),
        _r("QOSResourceLimit", "waiting: the QOS's resource limit is reached"),
        _r("AssocJobLimit", "waiting: your account's job limit is reached"),
        _r("AssocResourceLimit", "waiting: your account's resource limit is reached"),
        _r("AccountingPolicy", "waiting: an accounting limit is reached"),
        _r("launch failed requeued held", "held after a failed launch; release to retry"),
        # Never clear while the job stays as it is:
        _r("PartitionConfig", "the request does not fit the partition's nodes", True),
        _r("PartitionNodeLimit", "more nodes than the partition allows per job", True),
        _r("PartitionTimeLimit", "a longer time limit than the partition allows", True),
        _r("AccountNotAllowed", "the account may not use this partition", True),
        _r("QOSNotAllowed", "the QOS may not use this partition", True),
        _r("InvalidAccount", "the account does not exist or is not yours", True),
        _r("InvalidQOS", "the QOS does not exist or is not allowed for the account", True),
        _r("BadConstraints", "no node has the features asked for (--constraint)", True),
        _r("DependencyNeverSatisfied", "a job it depends on failed", True),
        _r("FrontEndDown", "waiting: no front end node is available"),
    ]
)

# Families Slurm names by prefix (QOSGrpCpuLimit, AssocMaxWallDurationPerJobLimit, ...).
# A per-job maximum is a property of the job itself: it never clears. A group (Grp) limit is
# shared with other jobs and clears as they end.
_PREFIXES: tuple[tuple[str, str, bool], ...] = (
    ("QOSGrp", "waiting: a limit of the QOS shared with other jobs is reached", False),
    ("AssocGrp", "waiting: a limit of your account shared with other jobs is reached", False),
    ("QOSMax", "waiting: a per-user limit of the QOS is reached", False),
    ("AssocMax", "waiting: a per-user limit of your account is reached", False),
    ("Max", "waiting: a per-account limit of the QOS is reached", False),
)


@functools.lru_cache(maxsize=1024)
def pending_reason(code: str | None) -> PendingReason:
    """The reason for a code as squeue prints it (``ReqNodeNotAvail, UnavailableNodes:c1``
    counts by its first word). An unknown code of a newer Slurm is shown as it is, and never
    counts as permanent: ending a trial on a guess would be worse than waiting."""
    head = (code or "").split(",", 1)[0].strip()
    if head in ("", "(null)"):
        return REASONS["None"]
    if head in REASONS:
        return REASONS[head]
    if _per_job_limit(head):
        return PendingReason(head, "the job asks for more than a per-job limit allows", True)
    for prefix, words, permanent in _PREFIXES:
        if head.startswith(prefix):
            return PendingReason(head, words, permanent)
    return PendingReason(head, "waiting")


def _per_job_limit(code: str) -> bool:
    """QOSMaxNodePerJobLimit, AssocMaxWallDurationPerJobLimit, QOSMaxGRESPerJob, ...: the job's
    own size or length is over a maximum. (Per-user or per-account maxima only wait.)"""
    return code.startswith(("QOSMax", "AssocMax")) and "PerJob" in code


def describe_reason(code: str | None) -> str:
    """``waiting for free nodes (Resources)``, for tables."""
    return pending_reason(code).shown()


# The controller notes a queued run as "queued: <Slurm's reason code>" (controller/reconcile.py, _observe).
_QUEUED = "queued: "


def pending_words(runner_state: str | None) -> str | None:
    """A queued trial's pending reason in words, or None when it is not waiting in a queue."""
    if not runner_state or not runner_state.startswith(_QUEUED):
        return None
    code = runner_state.removeprefix(_QUEUED)
    # "waiting" is what the controller notes when Slurm gave no reason at all.
    return describe_reason(None if code == "waiting" else code)
