"""Refuse what can never run, before anything is queued (docs/user/refusals.md).

A request bigger than its pool (more nodes than the partition has, more slots than any node
holds, a time limit over MaxTime, an account or QOS the partition does not allow) would sit
PENDING forever with a reason like PartitionConfig. ``check_shape`` compares a job's shape
with the partitions and nodes Slurm reported and returns typed refusals that carry the
numbers and the config path to change. Pure: the planner runs the probes
(SlurmPlanner.refusals, controller/slurm_plan.py) and ``sbatch --test-only`` for what only
slurmctld can judge.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from detslurm.errors import ConfigError
from detslurm.expconf import ExperimentConfig
from detslurm.expconf.sbatch_args import SbatchArgError, parse_sbatch_args
from detslurm.slurm.parse import NodeInfo
from detslurm.slurm.partitions import PartitionInfo, parse_duration_s
from detslurm.slurm.render import ResourcePlan
from detslurm.slurm.site import ROOT as SITE_ROOT
from detslurm.slurm.site import SiteConfig

CONFIG = "<config>"


class RefusalKind(enum.Enum):
    """What about the request can never be satisfied."""

    NO_PARTITION = "no such partition"
    TOO_MANY_NODES = "more nodes than the pool has"
    NODE_TOO_SMALL = "more slots per node than any node has"
    MAX_NODES = "over the partition's MaxNodes"
    MAX_CPUS_PER_NODE = "over the partition's MaxCPUsPerNode"
    MAX_TIME = "over the partition's MaxTime"
    ACCOUNT = "account not allowed"
    QOS = "QOS not allowed"
    SBATCH = "refused by sbatch --test-only"
    SITE_LIMIT = "locked by the site"


@dataclass(frozen=True)
class Refusal:
    """One reason a request can never run: ``<path>: <message>``, with the numbers."""

    kind: RefusalKind
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class RequestRefused(ConfigError):
    """The experiment can never run on this cluster; nothing was created."""

    def __init__(self, refusals: Sequence[Refusal]) -> None:
        self.refusals = list(refusals)
        super().__init__([str(r) for r in refusals], source="experiment configuration: it can never run here")


@dataclass(frozen=True)
class Setting:
    """An sbatch option's effective value and the config path it came from."""

    value: str
    path: str


@dataclass(frozen=True)
class JobShape:
    """What a trial's job asks of its partition, from the config and the site (no I/O)."""

    pool: str
    partition: str  # "" = Slurm's default partition
    partition_path: str
    slot_type: str
    gres_name: str  # the GRES a GPU pool's slots are (sinfo counts only "gpu" per node)
    slots: int
    nodes: int
    slots_per_node: int  # slots each node must hold
    slots_path: str  # where the node size came from (slots_per_trial or slurm.slots_per_node)
    time: Optional[Setting]
    account: Optional[Setting]
    qos: Optional[Setting]


# The options checked against partition limits, by long name (-t, -A, -q resolve to these).
_WATCHED = frozenset({"time", "account", "qos"})


def _last_values(args: Sequence[str], path: str) -> dict[str, Setting]:
    """--time/--account/--qos as sbatch reads ``args`` (the last one wins), each with the
    path of the word that set it (``path[i]``)."""
    try:
        parsed = parse_sbatch_args(args)
    except SbatchArgError:
        return {}  # validation has already reported it (expconf / site config)
    out: dict[str, Setting] = {}
    for p in parsed:
        if p.option.long in _WATCHED and p.value is not None:
            out[p.option.long] = Setting(p.value, f"{path}[{p.index}]")
    return out


def _sbatch_settings(config: ExperimentConfig, site: SiteConfig) -> tuple[str, dict[str, Setting]]:
    """The pool's name, and --time/--account/--qos as sbatch will read them for ``config``."""
    pool_name, pool = site.pool(config.resources.resource_pool)
    at = f"{SITE_ROOT}.pools.{pool_name}"
    # Later values win, as in sbatch: the pool's fields, its extra args, then the user's args.
    found: dict[str, Setting] = {}
    if pool.time_limit_min:
        found["time"] = Setting(str(pool.time_limit_min), f"{at}.time_limit_min")
    if pool.account:
        found["account"] = Setting(pool.account, f"{at}.account")
    if pool.qos:
        found["qos"] = Setting(pool.qos, f"{at}.qos")
    found.update(_last_values(pool.extra_sbatch_args, f"{at}.extra_sbatch_args"))
    found.update(_last_values(config.slurm.sbatch_args, f"{CONFIG}.slurm.sbatch_args"))
    return pool_name, found


def site_limit_refusals(config: ExperimentConfig, site: SiteConfig) -> list[Refusal]:
    """The --account, --qos and --time (from the pool or the user's sbatch_args, which come
    later on sbatch's line) that the site's ``limits`` do not allow, each naming the site file
    that set the limit. Pure: a dry run with no Slurm in reach refuses them too."""
    _, found = _sbatch_settings(config, site)
    lim, out = site.limits, []
    for option, limit in (("account", "accounts"), ("qos", "qos")):
        allowed, got = getattr(lim, limit), found.get(option)
        if allowed is not None and got is not None and got.value not in allowed:
            where = site.origin(f"limits.{limit}")
            out.append(
                Refusal(
                    RefusalKind.SITE_LIMIT,
                    got.path,
                    f"--{option} {got.value} is not allowed: limits.{limit} in {where} allows only "
                    f"{', '.join(allowed) or 'none'}",
                )
            )
    time = found.get("time")
    if lim.max_time_min is not None and time is not None:
        try:
            seconds = parse_duration_s(time.value)
        except ValueError:
            seconds = 0  # malformed: sbatch --test-only says so in its own words
        if seconds is None or seconds > lim.max_time_min * 60:  # None: UNLIMITED
            where = site.origin("limits.max_time_min")
            out.append(
                Refusal(
                    RefusalKind.SITE_LIMIT,
                    time.path,
                    f"--time {time.value} is over the site's maximum {fmt_duration(lim.max_time_min * 60)} "
                    f"(limits.max_time_min in {where})",
                )
            )
    return out


def job_shape(config: ExperimentConfig, site: SiteConfig, res: ResourcePlan) -> JobShape:
    """The job a trial of ``config`` asks for, ``res`` being its resource plan on ``site``."""
    pool_name, found = _sbatch_settings(config, site)
    pool = site.pool(pool_name)[1]
    at = f"{SITE_ROOT}.pools.{pool_name}"
    spn_set = config.slurm.slots_per_node is not None
    return JobShape(
        pool=pool_name,
        partition=pool.partition,
        partition_path=f"{at}.partition" if site.pools else f"{CONFIG}.resources.resource_pool",
        slot_type=pool.slot_type,
        gres_name=pool.gres_name,
        slots=res.slots,
        nodes=res.nodes,
        slots_per_node=res.per_node,
        slots_path=f"{CONFIG}.slurm.slots_per_node"
        if spn_set and res.nodes > 1
        else f"{CONFIG}.resources.slots_per_trial",
        time=found.get("time"),
        account=found.get("account"),
        qos=found.get("qos"),
    )


def fmt_duration(seconds: int) -> str:
    """Seconds in Slurm's own notation (``1-02:03:04``, ``02:00:00``)."""
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    text = f"{h:02d}:{m:02d}:{s:02d}"
    return f"{days}-{text}" if days else text


def _capacity(shape: JobShape, node: NodeInfo) -> int:
    """The slots one node holds for this pool: its GPUs in a GPU pool, else its CPUs."""
    return node.gpus if shape.slot_type == "gpu" else node.cpus


def _pool_words(shape: JobShape, sizes: Counter[int]) -> str:
    """``pool cpu has 2 nodes x 2 slots`` (sizes: slots per node -> how many nodes)."""
    parts = [f"{n} node{'s' if n != 1 else ''} x {c} slot{'s' if c != 1 else ''}" for c, n in sorted(sizes.items())]
    return f"pool {shape.pool} has " + (" + ".join(parts) if parts else "no nodes")


def _node_refusals(shape: JobShape, part: PartitionInfo, nodes: Sequence[NodeInfo]) -> list[Refusal]:
    """Nodes and slots: enough nodes, each big enough, within MaxNodes/MaxCPUsPerNode."""
    ours = [n for n in nodes if part.name in n.partitions]
    # Every node counts, down or drained too: a node that comes back makes the job runnable, so
    # only the partition's size, not its state today, decides "never".
    sizes = Counter(_capacity(shape, n) for n in ours)
    asked = f"slots_per_trial={shape.slots}"
    out: list[Refusal] = []
    # A pool of another GRES (shard, mps, a site's own name) has slots we cannot count here:
    # sbatch --test-only judges those.
    countable = shape.slot_type == "cpu" or shape.gres_name == "gpu"
    if shape.slots > 0 and ours and countable:
        big = sum(n for c, n in sizes.items() if c >= shape.slots_per_node)
        if big == 0:
            largest = max(sizes)
            msg = f"{asked} puts {shape.slots_per_node} slots on each node; {_pool_words(shape, sizes)}"
            if largest == 0:
                msg += f" (no {shape.slot_type.upper()}s at all)"
            out.append(Refusal(RefusalKind.NODE_TOO_SMALL, shape.slots_path, msg))
        elif shape.nodes > big:
            msg = f"{asked} needs {shape.nodes} nodes; {_pool_words(shape, sizes)}"
            out.append(Refusal(RefusalKind.TOO_MANY_NODES, shape.slots_path, msg))
    if part.max_nodes is not None and shape.nodes > part.max_nodes:
        limit = f"partition {part.name} allows at most {part.max_nodes} per job (MaxNodes)"
        msg = f"{asked} needs {shape.nodes} nodes; {limit}"
        out.append(Refusal(RefusalKind.MAX_NODES, shape.slots_path, msg))
    cpus = shape.slots_per_node if shape.slot_type == "cpu" and shape.slots > 0 else 0
    if part.max_cpus_per_node is not None and cpus > part.max_cpus_per_node:
        msg = (
            f"{asked} puts {cpus} CPUs on each node; partition {part.name} allows at most "
            f"{part.max_cpus_per_node} (MaxCPUsPerNode)"
        )
        out.append(Refusal(RefusalKind.MAX_CPUS_PER_NODE, shape.slots_path, msg))
    return out


def _limit_refusals(shape: JobShape, part: PartitionInfo) -> list[Refusal]:
    """Time limit, account and QOS against the partition's limits."""
    out: list[Refusal] = []
    if shape.time is not None and part.max_time_s is not None:
        try:
            asked = parse_duration_s(shape.time.value)
        except ValueError:
            asked = None  # sbatch --test-only reports a malformed time in its own words
        if asked is not None and asked > part.max_time_s:
            msg = (
                f"--time={shape.time.value} ({fmt_duration(asked)}) is longer than partition {part.name} "
                f"allows: MaxTime={fmt_duration(part.max_time_s)}"
            )
            out.append(Refusal(RefusalKind.MAX_TIME, shape.time.path, msg))
    if shape.account is not None and not part.allows_account(shape.account.value):
        allowed = ", ".join(sorted(part.allow_accounts or ())) or "all but the denied ones"
        msg = f"account {shape.account.value!r} may not use partition {part.name} (allowed: {allowed})"
        out.append(Refusal(RefusalKind.ACCOUNT, shape.account.path, msg))
    if shape.qos is not None and not part.allows_qos(shape.qos.value):
        allowed = ", ".join(sorted(part.allow_qos or ())) or "all but the denied ones"
        msg = f"QOS {shape.qos.value!r} may not use partition {part.name} (allowed: {allowed})"
        out.append(Refusal(RefusalKind.QOS, shape.qos.path, msg))
    return out


def find_partition(shape: JobShape, partitions: Sequence[PartitionInfo]) -> Optional[PartitionInfo]:
    """The partition the job goes to: the named one, or Slurm's default when none is named."""
    if not shape.partition:
        return next((p for p in partitions if p.default), None)
    return next((p for p in partitions if p.name == shape.partition), None)


def check_shape(shape: JobShape, partitions: Sequence[PartitionInfo], nodes: Sequence[NodeInfo]) -> list[Refusal]:
    """Every reason ``shape`` can never run, given what Slurm reported; [] if it may run."""
    part = find_partition(shape, partitions)
    if part is None:
        if not shape.partition:
            return []  # no default partition known: sbatch --test-only judges it
        names = ", ".join(sorted(p.name for p in partitions)) or "none"
        msg = f"partition {shape.partition!r} does not exist on this cluster (partitions: {names})"
        return [Refusal(RefusalKind.NO_PARTITION, shape.partition_path, msg)]
    return [*_node_refusals(shape, part, nodes), *_limit_refusals(shape, part)]


# What sbatch --test-only answers (22.05 and 24.11) when the job needs a node that is down or
# drained right now, although sbatch itself queues that job (PENDING, ReqNodeNotAvail). It is
# also its answer for a request that is too big, which check_shape judges first.
NODES_NOT_AVAILABLE = "Requested node configuration is not available"

# Node state words (sinfo's spelling, parse._node_state) that keep new jobs off a node.
_AWAY = frozenset(
    [
        "down",
        "drain",
        "drained",
        "draining",
        "fail",
        "failing",
        "future",
        "inval",
        "maint",
        "not_responding",
        "power_down",
        "powered_down",
        "powering_down",
        "reboot_issued",
        "reboot_requested",
        "reserved",
    ]
)


def nodes_away(shape: JobShape, partitions: Sequence[PartitionInfo], nodes: Sequence[NodeInfo]) -> list[str]:
    """The nodes of the job's partition (every node, where it is not known) that take no new
    jobs now: while any is away, sbatch --test-only's "not available" may mean only "not now"."""
    part = find_partition(shape, partitions)
    ours = [n for n in nodes if part is None or part.name in n.partitions]
    return [n.name for n in ours if takes_no_jobs(n.state)]


# sinfo's one-character suffixes (%T) of a node that takes no jobs now: not responding, powered
# off, powering down, power down pending, in a maintenance reservation, reboot pending or issued.
_AWAY_SUFFIXES = ("*", "~", "%", "!", "$", "@", "^")


def takes_no_jobs(state: str) -> bool:
    """A node state as sinfo spells it (``idle``, ``mixed+drain``, ``down*``, ``idle~``) is one
    that keeps new jobs off the node."""
    state = state.lower()
    return state.endswith(_AWAY_SUFFIXES) or bool(_AWAY.intersection(state.rstrip("*~%!$@^#-").split("+")))
