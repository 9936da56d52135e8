"""A busy test cluster, on purpose: another Unix user's jobs keep every node occupied, and any
other user's job starts only once it has waited a set time in the queue.

How: the load user (``detslurm-busy``, created the way tests/security_harness.py creates its
second user) holds every CPU of every node with one-CPU "filler" jobs (a GPU each on GPU nodes),
and keeps as many fillers again pending on each node at a priority above everyone else's, so a
CPU that frees up goes back to a filler at once. A gate times every other user's pending job from
when it became eligible (submitted, or let out of its array's throttle); once it has waited
``wait_s``, the gate (as root, the cluster's operator) raises that job's priority above the
fillers' and cancels as many fillers on nodes of its partition as it needs, so the freed CPUs go
to it. So every job waits the set time plus Slurm's own scheduling delay, whatever else is
queued: the cluster a user meets when each job waits W in the queue. ``probe`` measures the wait
it really produces, from Slurm's own submit and start times.

    eval "$(scripts/test-cluster env .state/cluster)"
    python bench/busy_cluster.py [--wait-s 30] [--probes 3] [--together 3]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from _common import ROOT, require_cluster, save

# Reasons a pending job gives for a wait of its own making (its array's throttle, a dependency,
# a hold, a begin time, as after a requeue), not the queue's: it is not timed while it gives one.
# Any other (Priority, Resources, nodes reserved for higher priority jobs, ...) is the queue's.
OWN_WAITS = ("JobArrayTaskLimit", "Dependency", "BeginTime", "JobHeld", "launch failed")
BUSY_USER = "detslurm-busy"
FILLER_PREFIX = "busy-"
# Above anything multifactor gives the test cluster's jobs (at most its PriorityWeightPartition);
# a job let through gets one more.
FILLER_PRIORITY = 1_000_000
# With a time limit, Slurm's backfill can tell when the fillers end, so it keeps a raised job's
# freed CPUs for it rather than start a lower filler there while the job waits for the rest.
FILLER_TIME = "1-00:00:00"
SQUEUE_FORMAT = "%i|%u|%T|%r|%P|%C|%D|%b|%N|%V|%j"
SINFO_FORMAT = "%N|%P|%p|%C|%G"


@dataclass(frozen=True)
class Job:
    """One line of ``squeue -r -o SQUEUE_FORMAT``."""

    key: str
    user: str
    state: str
    reason: str
    partitions: tuple[str, ...]
    cpus: int
    nodes: int
    gpus_per_node: int
    nodelist: str
    submit: float
    name: str


@dataclass(frozen=True)
class Node:
    """A node as ``sinfo -N`` shows it; ``partitions`` is (name, priority tier) of each."""

    name: str
    cpus: int
    idle_cpus: int
    gpus: int
    partitions: tuple[tuple[str, int], ...]

    @property
    def filler_gpus(self) -> int:
        """GPUs each filler holds, so that fillers on every CPU hold every GPU too."""
        return self.gpus // self.cpus if self.cpus else 0

    @property
    def filler_partition(self) -> str:
        """The node's partition of the lowest tier: fillers there preempt nobody."""
        return min(self.partitions, key=lambda p: (p[1], p[0]))[0]


@dataclass
class Actions:
    """What one step of the gate asks for, in this order: jobs to let through (their priority
    raised above the fillers'), fillers to cancel, new pending fillers per node."""

    let_through: list[str] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    fill: dict[str, int] = field(default_factory=dict)


def _gpus(gres: str) -> int:
    m = re.search(r"gpu(?::[^:,=()]+)?[:=](\d+)", gres)
    return int(m.group(1)) if m else 0


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S").timestamp()


def parse_squeue(text: str) -> list[Job]:
    jobs = []
    for line in text.splitlines():
        if not line.strip():
            continue
        key, user, state, reason, part, cpus, nodes, gres, nodelist, submit, name = line.split("|", 10)
        jobs.append(
            Job(
                key=key,
                user=user,
                state=state,
                reason=reason,
                partitions=tuple(part.split(",")),
                cpus=int(cpus),
                nodes=int(nodes),
                gpus_per_node=_gpus(gres),
                nodelist=nodelist,
                submit=_epoch(submit),
                name=name,
            )
        )
    return jobs


def parse_sinfo(text: str) -> dict[str, Node]:
    """One Node per name from ``sinfo -h -N -o SINFO_FORMAT`` (a line per node and partition)."""
    nodes: dict[str, Node] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, part, tier, cpus, gres = line.split("|")
        _alloc, idle, _other, total = (int(x) for x in cpus.split("/"))
        prev = nodes.get(name)
        parts = (prev.partitions if prev else ()) + ((part.rstrip("*"), int(tier)),)
        nodes[name] = Node(name, total, idle, _gpus(gres), parts)
    return nodes


def queued(job: Job) -> bool:
    """Whether ``job`` waits for room (and is timed), not for something of its own."""
    return not job.reason.startswith(OWN_WAITS)


class Gate:
    """The load generator's decisions, from what squeue and sinfo show (no Slurm calls here)."""

    def __init__(self, wait_s: float, started: float, user: str = BUSY_USER) -> None:
        self.wait_s = wait_s
        self.user = user
        self.ready_since: dict[str, float] = {}
        self.grants: dict[str, dict[str, int]] = {}  # job -> fillers to free on each node
        self.cancelled: set[str] = set()  # fillers canceled, until squeue no longer lists them
        self.last_poll = started

    def step(self, now: float, jobs: Sequence[Job], nodes: dict[str, Node]) -> Actions:
        waiting = [j for j in jobs if j.user != self.user and j.state == "PENDING" and queued(j)]
        for j in waiting:
            # It became eligible since the last look, and not before its submission.
            self.ready_since.setdefault(j.key, max(j.submit, self.last_poll))
        keys = {j.key for j in waiting}
        self.ready_since = {k: t for k, t in self.ready_since.items() if k in keys}
        self.grants = {k: g for k, g in self.grants.items() if k in keys}
        fillers = [j for j in jobs if j.user == self.user and j.name.startswith(FILLER_PREFIX)]
        self.cancelled &= {f.key for f in fillers}
        overdue = [j for j in waiting if j.key not in self.grants and now - self.ready_since[j.key] >= self.wait_s]
        let_through = []
        for j in sorted(overdue, key=lambda j: (self.ready_since[j.key], j.key)):
            where = self._place(j, nodes, fillers)
            if where:
                self.grants[j.key] = where
                let_through.append(j.key)
        self.last_poll = now
        acts = self._actions(nodes, fillers)
        acts.let_through = let_through
        return acts

    def opened(self, node: str) -> int:
        return sum(g.get(node, 0) for g in self.grants.values())

    def _place(self, job: Job, nodes: dict[str, Node], fillers: Sequence[Job]) -> dict[str, int]:
        """The nodes to free for ``job`` and how many fillers on each; {} if none can be now."""
        per_node: dict[str, int] = {}
        room: dict[str, int] = {}
        for n in nodes.values():
            if not set(job.partitions) & {p for p, _ in n.partitions}:
                continue
            if job.gpus_per_node > n.gpus:
                continue
            slots = math.ceil(job.cpus / max(1, job.nodes))
            if job.gpus_per_node and n.filler_gpus:
                slots = max(slots, math.ceil(job.gpus_per_node / n.filler_gpus))
            if slots > n.cpus:
                continue
            held = sum(1 for f in fillers if f.state == "RUNNING" and f.nodelist == n.name)
            free = n.idle_cpus + held - self.opened(n.name)
            if free >= slots:
                per_node[n.name], room[n.name] = slots, free
        if len(per_node) < job.nodes:
            return {}
        best = sorted(per_node, key=lambda name: (-room[name], name))[: job.nodes]
        return {name: per_node[name] for name in best}

    def _actions(self, nodes: dict[str, Node], fillers: Sequence[Job]) -> Actions:
        acts = Actions()
        for n in nodes.values():
            mine = [f for f in fillers if f.key not in self.cancelled]
            pending = [f for f in mine if f.state == "PENDING" and f.name == FILLER_PREFIX + n.name]
            running = [f for f in mine if f.state == "RUNNING" and f.nodelist == n.name]
            freeing = sum(1 for f in fillers if f.key in self.cancelled and f.nodelist == n.name)
            # Free what the jobs let through here still lack (a filler may have taken a CPU
            # before the raised priority reached Slurm: then one more is canceled next time).
            short = max(0, self.opened(n.name) - n.idle_cpus - freeing)
            acts.cancel += [f.key for f in running[:short]]
            if len(pending) < n.cpus:
                acts.fill[n.name] = n.cpus - len(pending)
        self.cancelled |= set(acts.cancel)
        return acts


def slurm(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


class BusyCluster:
    """The load generator: a thread that applies the gate every ``poll_s`` until ``stop``."""

    def __init__(self, wait_s: float, poll_s: float = 0.5, user: str = BUSY_USER) -> None:
        sys.path.insert(0, str(ROOT))
        from tests.security_harness import ensure_user

        self.account = ensure_user(user)
        self.gate = Gate(wait_s, time.time(), user)
        self.poll_s = poll_s
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="busy-cluster", daemon=True)

    def __enter__(self) -> BusyCluster:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        subprocess.run(["scancel", "-u", self.account.pw_name], check=False)

    def snapshot(self) -> tuple[list[Job], dict[str, Node]]:
        jobs = slurm("squeue", "-h", "-a", "-r", "-t", "PENDING,RUNNING,CONFIGURING,COMPLETING", "-o", SQUEUE_FORMAT)
        return parse_squeue(jobs), parse_sinfo(slurm("sinfo", "-h", "-N", "-o", SINFO_FORMAT))

    def full(self) -> bool:
        """Every CPU held by a filler, and every node with its pending fillers."""
        jobs, nodes = self.snapshot()
        pending = [j for j in jobs if j.user == self.account.pw_name and j.state == "PENDING"]
        return all(n.idle_cpus == 0 for n in nodes.values()) and len(pending) >= sum(n.cpus for n in nodes.values())

    def wait_full(self, timeout_s: float = 120) -> None:
        end = time.time() + timeout_s
        while not self.full():
            if time.time() > end:
                raise RuntimeError(
                    f"the load user's fillers did not fill the cluster in {timeout_s:g} s: {self.errors}"
                )
            time.sleep(1)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                jobs, nodes = self.snapshot()
                self._apply(self.gate.step(time.time(), jobs, nodes), nodes)
            except (subprocess.CalledProcessError, ValueError) as e:
                self.errors.append(str(getattr(e, "stderr", "") or e))
            self._stop.wait(self.poll_s)

    def _apply(self, acts: Actions, nodes: dict[str, Node]) -> None:
        for key in acts.let_through:
            subprocess.run(["scontrol", "update", f"JobId={key}", f"Priority={FILLER_PRIORITY + 1}"], check=False)
        if acts.cancel:
            subprocess.run(["scancel", *acts.cancel], check=False, capture_output=True)
        for name, count in acts.fill.items():
            self._submit_fillers(nodes[name], count)

    def _submit_fillers(self, node: Node, count: int) -> None:
        argv = ["sbatch", "--parsable", f"--array=0-{count - 1}", f"--job-name={FILLER_PREFIX}{node.name}"]
        argv += [f"--partition={node.filler_partition}", f"--nodelist={node.name}", "--cpus-per-task=1"]
        argv += [f"--time={FILLER_TIME}"]
        argv += [f"--gres=gpu:{node.filler_gpus}"] if node.filler_gpus else []
        argv += ["--output=/dev/null", "--wrap=exec sleep 1000000"]
        env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": os.environ["SLURM_CONF"]}
        uid, gid = self.account.pw_uid, self.account.pw_gid
        cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *argv]
        out = subprocess.run(cmd, env=env, cwd="/tmp", capture_output=True, text=True, check=True).stdout
        # Priority is an operator's to set: root raises it right after the load user submits.
        slurm("scontrol", "update", f"JobId={out.strip().split(';')[0]}", f"Priority={FILLER_PRIORITY}")


def probe(partition: str = "cpu", count: int = 1, timeout_s: float = 600) -> list[float]:
    """Submit ``count`` one-CPU jobs at once; each one's wait in the queue (Slurm's start time
    less its submit time, in seconds), once all have started."""
    ids = [
        slurm("sbatch", "--parsable", f"--partition={partition}", "-c1", "--output=/dev/null", "--wrap=sleep 2").strip()
        for _ in range(count)
    ]
    waits: dict[str, float] = {}
    end = time.time() + timeout_s
    while len(waits) < count and time.time() < end:
        time.sleep(0.5)
        out = slurm("squeue", "-h", "--states=all", "-j", ",".join(ids), "-o", "%i|%T|%V|%S")
        for line in out.splitlines():
            key, state, submit, start = line.split("|")
            if state not in ("PENDING", "CONFIGURING") and start != "N/A":
                waits[key] = _epoch(start) - _epoch(submit)
    subprocess.run(["scancel", *ids], check=False)
    if len(waits) < count:
        raise RuntimeError(f"probe jobs {ids} did not start in {timeout_s:g} s")
    return [waits[i] for i in ids]


def summary(waits: Iterable[float]) -> dict[str, float]:
    xs = sorted(waits)
    return {"n": len(xs), "min_s": xs[0], "median_s": statistics.median(xs), "max_s": xs[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wait-s", type=float, default=30.0, help="the wait every job should meet")
    ap.add_argument("--probes", type=int, default=3, help="probe jobs submitted one after another")
    ap.add_argument("--together", type=int, default=3, help="then this many probe jobs submitted at once")
    ap.add_argument("--partition", default="cpu")
    args = ap.parse_args()
    require_cluster()
    idle = probe(args.partition)
    with BusyCluster(args.wait_s) as busy:
        busy.wait_full()
        one_by_one = [w for _ in range(args.probes) for w in probe(args.partition)]
        together = probe(args.partition, args.together) if args.together else []
        errors = busy.errors
    result = {
        "benchmark": "busy_cluster",
        "wait_s": args.wait_s,
        "idle_wait_s": idle[0],
        "one_by_one": summary(one_by_one) | {"waits_s": one_by_one},
        "together": (summary(together) | {"waits_s": together}) if together else None,
        "load_average": list(os.getloadavg()),
        "errors": errors[:10],
    }
    save("busy_cluster", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
