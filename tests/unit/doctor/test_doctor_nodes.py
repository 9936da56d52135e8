"""The doctor's node checks (docs/admin/doctor.md): every pool's partition shows its nodes by
state and warns of nodes that take no jobs, and every kind of pool's slots_per_node is checked
against the nodes (CPUs for a CPU pool, GPUs for a GPU pool). Facts captured from the 22.05 test
cluster, with sinfo's lines changed as a dead slurmd or a drain changes them."""

from __future__ import annotations

import dataclasses

import pytest
from test_doctor import by_subject, facts

from detslurm.doctor import checks
from detslurm.doctor.findings import Status
from detslurm.slurm.parse import PartitionNodes
from detslurm.slurm.refusals import takes_no_jobs
from detslurm.slurm.site import Pool, SiteConfig


def with_gpu_nodes(*lines: tuple[str, str]) -> list[PartitionNodes]:
    """The captured sinfo with partition gpu's nodes in the given (state, node) lines."""
    f = facts()
    template = next(n for n in f.sinfo if n.partition == "gpu")
    others = [n for n in f.sinfo if n.partition != "gpu"]
    return others + [
        dataclasses.replace(template, state=state, nodelist=node, nodes=1, cpus_total=2) for state, node in lines
    ]


def test_every_partition_shows_its_nodes_by_state() -> None:
    found = by_subject(checks.site_findings(facts()))
    assert "nodes 1 allocated (c1), 1 mixed (c2)" in found["partition cpu"].detail
    assert found["partition cpu"].status is Status.OK


def test_a_dead_slurmd_in_a_pools_partition_is_a_warning_naming_the_node() -> None:
    f = facts(sinfo=with_gpu_nodes(("mixed", "g1"), ("down*", "g2")))
    found = by_subject(checks.site_findings(f))["partition gpu"]
    assert found.status is Status.WARNING
    assert "1 down* (g2)" in found.detail and "1 of 2 nodes take no jobs (g2 down*)" in found.action


def test_a_partition_whose_every_node_is_away_is_a_problem() -> None:
    f = facts(sinfo=with_gpu_nodes(("drained", "g1"), ("idle*", "g2")))
    found = by_subject(checks.site_findings(f))["partition gpu"]
    assert found.status is Status.PROBLEM and "no node takes jobs" in found.action


@pytest.mark.parametrize(
    ("state", "away"),
    [
        ("idle", False),
        ("mixed", False),
        ("allocated", False),
        ("completing", False),
        ("idle-", False),
        ("down*", True),
        ("idle*", True),
        ("idle~", True),
        ("drained", True),
        ("draining", True),
        ("mixed+drain", True),
        ("maint", True),
    ],
)
def test_which_sinfo_states_take_no_jobs(state: str, away: bool) -> None:
    assert takes_no_jobs(state) is away


def test_a_cpu_pool_with_more_slots_per_node_than_cpus_is_a_warning() -> None:
    """2-CPU nodes; a pool of 8 CPU slots per node never starts a trial that fills a node."""
    site = SiteConfig(default_pool="cpu", pools={"cpu": Pool(partition="cpu", slot_type="cpu", slots_per_node=8)})
    found = checks.check_pool(facts(site=site), "cpu", site.pools["cpu"])
    assert found.status is Status.WARNING and "the nodes have 2 CPUs" in found.detail
    assert "set slots_per_node 2" in found.action
    fits = checks.check_pool(facts(site=site), "cpu", Pool(partition="cpu", slot_type="cpu", slots_per_node=2))
    assert fits.status is Status.OK
