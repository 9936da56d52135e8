"""A Slurm job the user holds (an ``salloc`` allocation, an sbatch job), as a place for trial
runs: what ``scontrol -d show job`` says of it, and how trial runs pack onto its nodes.

Pure: :class:`SlurmClient.allocation` runs the query, the step executor
(controller/step_executor.py) keeps the runs it placed and asks :func:`place` where the next
one goes. A run takes whole GPUs of one node (a 1-slot trial on a node with 2 GPUs gets one of
them, with its own CUDA_VISIBLE_DEVICES, which slurmstepd sets from the step's ``--gres``) and a
share of that node's CPUs in proportion; a trial of several nodes takes whole free nodes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from detslurm.slurm.parse import SlurmParseError, expand_nodelist, parse_key_values

# One line per group of nodes with the same allocation (`scontrol -d show job`):
#   Nodes=g[1-2] CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:0-1)
_DETAIL = re.compile(r"^\s*Nodes=(\S+) CPU_IDs=(\S+) Mem=(\d+)(?: GRES=(\S*))?", re.MULTILINE)
_GRES_ENTRY = re.compile(r"([^:,(]+)(?::[^:,(]+)?:(\d+)")


@dataclass(frozen=True)
class HeldNode:
    """One node of the allocation and what the allocation holds of it."""

    name: str
    cpus: int
    gpus: int
    mem_mb: int  # 0: memory is not a consumable resource here (no --mem on the steps)


@dataclass(frozen=True)
class Allocation:
    """A held job: its state, when it ends (None: no limit) and the nodes it holds."""

    job_id: str
    state: str
    end_time: Optional[float]
    nodes: tuple[HeldNode, ...]

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"

    def describe(self) -> str:
        """The nodes in words, for refusals: ``2 nodes (g1, g2) with 2 GPUs and 2 CPUs each``."""
        names = ", ".join(n.name for n in self.nodes)
        kinds = sorted({(n.gpus, n.cpus) for n in self.nodes})
        each = "; ".join(f"{g} GPU{'s' * (g != 1)} and {c} CPU{'s' * (c != 1)}" for g, c in kinds)
        count = f"{len(self.nodes)} node{'s' * (len(self.nodes) != 1)}"
        return f"{count} ({names}) with {each}{' each' * (len(kinds) == 1)}"


@dataclass(frozen=True)
class StepShape:
    """What one trial run asks of the allocation: ``nodes`` nodes with ``per_node`` slots each
    (GPUs where the allocation holds GPUs, else CPUs); 0 slots is a CPU-only trial."""

    nodes: int
    per_node: int
    slots: int


@dataclass(frozen=True)
class Share:
    """Where one run goes: its nodes, and the GPUs, CPUs and memory (MB, 0: unset) it takes on
    each of them. ``whole``: it takes its nodes whole (a trial of several nodes)."""

    nodes: tuple[str, ...]
    gpus: int
    cpus: int
    mem_mb: int = 0


def parse_allocation(job_id: str, text: str, gres_name: str = "gpu") -> Allocation:
    """``scontrol -d show job JOB`` (multi-line) -> :class:`Allocation`."""
    text = _record_of(job_id, text)
    head = parse_key_values(" ".join(_DETAIL.sub("", text).split()))
    state = head.get("JobState", "")
    if not state:
        raise SlurmParseError("scontrol show job", text)
    nodes: list[HeldNode] = []
    for m in _DETAIL.finditer(text):
        cpus = _count_ids(m.group(2))
        gpus = sum(int(c) for name, c in _GRES_ENTRY.findall(m.group(4) or "") if name == gres_name)
        nodes += [HeldNode(name, cpus, gpus, int(m.group(3))) for name in expand_nodelist(m.group(1))]
    return Allocation(job_id, state, _time(head.get("EndTime", "")), tuple(nodes))


def _record_of(job_id: str, text: str) -> str:
    """Job ``job_id``'s own record. The id of an array (that of its last task, as a pilot
    workers' array has) makes scontrol list every task of the array, each with its own JobId
    and nodes; merged, they would be one job holding all their nodes."""
    records = re.split(r"^(?=JobId=)", text, flags=re.MULTILINE)
    return next((r for r in records if r.startswith(f"JobId={job_id} ")), text)


def _count_ids(ids: str) -> int:
    """``0-1,4`` -> 3."""
    n = 0
    for part in ids.split(","):
        a, _, b = part.partition("-")
        n += int(b) - int(a) + 1 if b else 1
    return n


def _time(text: str) -> Optional[float]:
    """Slurm's local ISO time, or None ("Unknown", "None": no end)."""
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def step_shape(slots_per_trial: int, slots_per_node: Optional[int], alloc: Allocation) -> StepShape:
    """The shape of a trial of ``slots_per_trial`` slots in ``alloc``: one node when its slots
    fit the allocation's smallest node (or ``slurm.slots_per_node``), else whole nodes."""
    per_node_held = min((_slots(n, alloc) for n in alloc.nodes), default=0)
    spn = slots_per_node or max(1, per_node_held)
    nodes = max(1, math.ceil(slots_per_trial / spn)) if slots_per_trial else 1
    return StepShape(nodes, spn if nodes > 1 else slots_per_trial, slots_per_trial)


def uses_gpus(alloc: Allocation) -> bool:
    """Slots are GPUs where the allocation holds any, else CPUs."""
    return any(n.gpus for n in alloc.nodes)


def _slots(node: HeldNode, alloc: Allocation) -> int:
    return node.gpus if uses_gpus(alloc) else node.cpus


def share_on(node: HeldNode, shape: StepShape, alloc: Allocation) -> Share:
    """What a single-node run of ``shape`` takes of ``node``: its slots, CPUs in proportion to
    the GPUs (at least one), memory likewise where the allocation tracks it."""
    if not uses_gpus(alloc):
        cpus = max(1, shape.per_node)
        return Share((node.name,), 0, cpus, node.mem_mb * cpus // max(1, node.cpus))
    gpus = shape.per_node
    cpus = max(1, node.cpus * gpus // node.gpus) if node.gpus else 1
    return Share((node.name,), gpus, cpus, node.mem_mb * gpus // max(1, node.gpus))


def place(alloc: Allocation, shape: StepShape, taken: list[Share]) -> Optional[Share]:
    """Where the next run of ``shape`` goes given the shares ``taken`` by runs already placed,
    or None when it does not fit now. Single-node runs fill the busiest node first (so free
    nodes stay whole for trials of several nodes); those take whole free nodes, in order."""
    free = _free(alloc, taken)
    if shape.nodes > 1:
        whole = [n for n in alloc.nodes if free[n.name] == (n.gpus, n.cpus, n.mem_mb)]
        if len(whole) < shape.nodes or any(_slots(n, alloc) < shape.per_node for n in whole[: shape.nodes]):
            return None
        chosen = whole[: shape.nodes]
        first = chosen[0]
        return Share(tuple(n.name for n in chosen), first.gpus, first.cpus, first.mem_mb)
    fits: list[tuple[int, int, Share]] = []
    for i, node in enumerate(alloc.nodes):
        want = share_on(node, shape, alloc)
        gpus, cpus, mem = free[node.name]
        if want.gpus <= gpus and want.cpus <= cpus and want.mem_mb <= mem:
            fits.append((gpus + cpus, i, want))
    return min(fits, key=lambda f: (f[0], f[1]))[2] if fits else None


def room(alloc: Allocation, shape: StepShape, taken: list[Share]) -> int:
    """How many more runs of ``shape`` fit now beside ``taken``."""
    placed = list(taken)
    n = 0
    while (share := place(alloc, shape, placed)) is not None:
        placed.append(share)
        n += 1
    return n


def fits_empty(alloc: Allocation, shape: StepShape) -> bool:
    """Whether one run of ``shape`` fits the allocation with nothing else running."""
    return place(alloc, shape, []) is not None


def _free(alloc: Allocation, taken: list[Share]) -> dict[str, tuple[int, int, int]]:
    free = {n.name: (n.gpus, n.cpus, n.mem_mb) for n in alloc.nodes}
    for share in taken:
        for name in share.nodes:
            if name in free:
                g, c, m = free[name]
                free[name] = (g - share.gpus, c - share.cpus, m - share.mem_mb)
    return free
