"""The busy cluster's gate (bench/busy_cluster.py), on squeue and sinfo text as Slurm 22.05
prints it: a job is let through once it has waited the set time in the queue, and not before;
time spent waiting on itself is not counted; exactly the CPUs it needs are freed, once."""

from __future__ import annotations

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from busy_cluster import FILLER_PREFIX, Gate, Job, Node, parse_sinfo, parse_squeue

SINFO = """c1|cpu*|1|{c1}|(null)
c1|high|10|{c1}|(null)
c2|cpu*|1|{c2}|(null)
c2|high|10|{c2}|(null)
g1|gpu|1|2/0/0/2|gpu:2
g1|high|10|2/0/0/2|gpu:2(S:0)
"""
T0 = 1_800_000_000.0


def nodes(c1: str = "2/0/0/2", c2: str = "2/0/0/2") -> dict[str, Node]:
    return parse_sinfo(SINFO.format(c1=c1, c2=c2))


def filler(key: str, node: str, state: str = "RUNNING") -> Job:
    return Job(
        key,
        "detslurm-busy",
        state,
        "None",
        ("cpu",),
        1,
        1,
        0,
        node if state == "RUNNING" else "",
        T0,
        FILLER_PREFIX + node,
    )


def job(key: str, submit: float, cpus: int = 1, n: int = 1, reason: str = "Priority", part: str = "cpu") -> Job:
    return Job(key, "alice", "PENDING", reason, (part,), cpus, n, 0, "", submit, "det-e1-t1")


def full() -> list[Job]:
    """Both CPUs of c1, c2, g1 held by fillers, and as many pending behind each."""
    running = [filler(f"{i}_{k}", node) for i, node in enumerate(("c1", "c2", "g1")) for k in range(2)]
    pending = [filler(f"{i + 10}_{k}", node, "PENDING") for i, node in enumerate(("c1", "c2", "g1")) for k in range(2)]
    return running + pending


def test_parse_as_slurm_prints() -> None:
    (j,) = parse_squeue("1_2|detslurm-busy|PENDING|Resources|cpu|1|1|gres:gpu:1||2026-11-28T23:05:07|busy-c1\n")
    assert (j.key, j.state, j.partitions, j.cpus, j.gpus_per_node, j.name) == (
        "1_2",
        "PENDING",
        ("cpu",),
        1,
        1,
        "busy-c1",
    )
    n = nodes(c1="1/1/0/2")
    assert (n["c1"].cpus, n["c1"].idle_cpus, n["c1"].filler_partition) == (2, 1, "cpu")
    # Fillers on a GPU node hold its GPUs too, in the node's own partition, never `high` (which preempts).
    assert (n["g1"].gpus, n["g1"].filler_gpus, n["g1"].filler_partition) == (2, 1, "gpu")


def test_an_empty_cluster_is_filled_twice_over() -> None:
    acts = Gate(30, T0).step(T0, [], nodes())
    assert acts.fill == {"c1": 2, "c2": 2, "g1": 2} and not acts.cancel and not acts.let_through
    # Once full (two running and two pending per node), nothing more is asked.
    acts = Gate(30, T0).step(T0, full(), nodes(c1="2/0/0/2"))
    assert (acts.fill, acts.cancel, acts.let_through) == ({}, [], [])


def test_a_job_is_let_through_once_it_has_waited_the_set_time() -> None:
    gate, ns = Gate(30, T0), nodes(c1="2/0/0/2", c2="2/0/0/2")
    waiting = full() + [job("77", T0 + 1)]
    assert gate.step(T0 + 2, waiting, ns).let_through == []
    assert gate.step(T0 + 30.5, waiting, ns).let_through == []
    acts = gate.step(T0 + 31, waiting, ns)
    assert acts.let_through == ["77"]
    (freed,) = acts.cancel  # one CPU of one node of its partition: a filler of c1 or c2
    assert freed in {"0_0", "0_1", "1_0", "1_1"} and acts.fill == {}
    # The canceled filler is still listed while it ends: nothing more is freed, nor raised again.
    acts = gate.step(T0 + 31.5, waiting, ns)
    assert (acts.let_through, acts.cancel) == ([], [])


def test_its_own_waits_are_not_counted() -> None:
    """An array task held back by its throttle for 50 s waits the set time after that."""
    gate, ns = Gate(30, T0), nodes()
    throttled = job("5_3", T0, reason="JobArrayTaskLimit")
    for t in (T0 + 10, T0 + 50):
        assert gate.step(t, full() + [throttled], ns).let_through == []
    queued = job("5_3", T0)  # the same task, now waiting for room (submit time unchanged)
    assert gate.step(T0 + 51, full() + [queued], ns).let_through == []
    assert gate.step(T0 + 79.5, full() + [queued], ns).let_through == []
    assert gate.step(T0 + 80.5, full() + [queued], ns).let_through == ["5_3"]


def test_a_two_node_job_gets_two_cpus_on_each_node_of_its_partition() -> None:
    gate, ns = Gate(30, T0), nodes()
    acts = gate.step(T0 + 40, full() + [job("9", T0, cpus=4, n=2)], ns)
    assert acts.let_through == ["9"]
    assert sorted(acts.cancel) == ["0_0", "0_1", "1_0", "1_1"]  # c1 and c2; g1 is not in `cpu`


def test_jobs_beyond_the_room_wait_for_it() -> None:
    """Five overdue one-CPU jobs and four CPUs in their partition: four go, the fifth waits."""
    gate, ns = Gate(30, T0), nodes()
    jobs = [job(str(100 + i), T0 + i) for i in range(5)]
    acts = gate.step(T0 + 60, full() + jobs, ns)
    assert acts.let_through == ["100", "101", "102", "103"] and len(acts.cancel) == 4
    # When one of the four has started (and a filler's CPU is idle again), the fifth goes.
    started = [j for j in jobs if j.key != "100"]
    acts = gate.step(T0 + 61, full() + started, nodes(c1="1/1/0/2"))
    assert acts.let_through == ["104"]
