"""Queue edits -> scontrol plans (pure), on squeue rows shaped like the captured real output."""

from __future__ import annotations

from dataclasses import replace

import pytest

from detslurm import queue as q
from detslurm.slurm.parse import Capabilities, QueuedJob
from detslurm.slurm.site import Pool, SiteConfig
from detslurm.slurm.states import SlurmState

CAPS = Capabilities(
    version="22.05.8",
    accounting=False,
    enable_user_top=True,
    preemption=True,
    max_array_size=1001,
    cluster_name="t",
    slurm_user="root",
)
SITE = SiteConfig(
    default_pool="cpu", pools={"cpu": Pool(partition="cpu"), "gpu": Pool(partition="gpu", slot_type="gpu")}
)
ALICE = q.Caller(user="alice", admin=False)
ROOT = q.Caller(user="root", admin=True)


def job(
    jid: str,
    user: str = "alice",
    prio: int = 100,
    nice: int = 0,
    state: SlurmState = SlurmState.PENDING,
    comment: str = "",
    partition: str = "cpu",
) -> QueuedJob:
    return QueuedJob(
        job_id=jid,
        raw_id=int(jid),
        array_job_id=int(jid),
        array_task_id=None,
        state=state,
        state_text=state.value,
        partition=partition,
        user=user,
        priority=prio,
        reason="Priority",
        nodelist="",
        num_nodes=1,
        num_cpus=1,
        gres="",
        submit_time="2026-01-01T00:00:00",
        start_time="N/A",
        time_limit="UNLIMITED",
        nice=nice,
        name="x",
        comment=comment,
    )


QUEUE = [
    job("1", prio=100),
    job("2", prio=300),
    job("3", user="bob", prio=500),
    job("4", comment="detslurm:exp=7,trial=1,run=1", state=SlurmState.RUNNING),
]


def test_priority_direction_and_rights() -> None:
    assert q.nice_for(42) == 0 and q.nice_for(50) == 800 and q.nice_for(1) == -4100
    assert q.priority_for(800) == 50 and q.priority_for(-4100) == 1
    assert q.plan_update(QUEUE, "1", ALICE, CAPS, SITE, priority=60) == [q.Op("update", "1", (("Nice", "1800"),))]
    with pytest.raises(q.QueueError, match="lets ordinary users only lower the priority"):
        q.plan_update(QUEUE, "1", ALICE, CAPS, SITE, priority=10)
    assert q.plan_update(QUEUE, "1", ROOT, CAPS, SITE, priority=10) == [q.Op("update", "1", (("Nice", "-3200"),))]
    with pytest.raises(q.QueueError, match="priority must be between 1 and 99"):
        q.plan_update(QUEUE, "1", ROOT, CAPS, SITE, priority=0)


def test_only_own_jobs() -> None:
    with pytest.raises(q.QueueError, match="job 3 belongs to bob; you can only change your own jobs"):
        q.plan_update(QUEUE, "3", ALICE, CAPS, SITE, hold=True)
    assert q.plan_update(QUEUE, "3", ROOT, CAPS, SITE, hold=True) == [q.Op("hold", "3")]
    with pytest.raises(q.QueueError, match="job 99 not found"):
        q.plan_update(QUEUE, "99", ALICE, CAPS, SITE, hold=True)


def test_ahead_and_behind() -> None:
    assert q.plan_update(QUEUE, "1", ALICE, CAPS, SITE, ahead_of="2") == [q.Op("top", "1")]
    assert q.plan_update(QUEUE, "1", ROOT, CAPS, SITE, ahead_of="3") == [q.Op("update", "1", (("Priority", "501"),))]
    with pytest.raises(q.QueueError, match="only admins may raise"):
        q.plan_update(QUEUE, "1", ALICE, CAPS, SITE, ahead_of="3")
    no_top = replace(CAPS, enable_user_top=False)
    # without scontrol top, alice can still lower her other job below this one
    assert q.plan_update(QUEUE, "1", ALICE, no_top, SITE, ahead_of="2") == [q.Op("update", "2", (("Nice", "201"),))]
    assert q.plan_update(QUEUE, "2", ALICE, CAPS, SITE, behind_of="1") == [q.Op("update", "2", (("Nice", "201"),))]
    assert q.plan_update(QUEUE, "1", ALICE, CAPS, SITE, behind_of="2") == []  # already behind


def test_pools_and_holds() -> None:
    assert q.plan_update(QUEUE, "1", ALICE, CAPS, SITE, resource_pool="gpu") == [
        q.Op("update", "1", (("Partition", "gpu"),))
    ]
    assert q.plan_update(QUEUE, "4", ALICE, CAPS, SITE, resource_pool="gpu") == [q.PoolMove(7, "gpu")]
    with pytest.raises(q.QueueError, match="cannot move a running job"):
        q.plan_update([replace(QUEUE[0], state=SlurmState.RUNNING)], "1", ALICE, CAPS, SITE, resource_pool="gpu")
    with pytest.raises(Exception, match="resource pool 'nope' does not exist"):
        q.plan_update(QUEUE, "1", ALICE, CAPS, SITE, resource_pool="nope")
    with pytest.raises(q.QueueError, match="only pending jobs can be held"):
        q.plan_update(QUEUE, "4", ALICE, CAPS, SITE, hold=True)
    with pytest.raises(q.QueueError, match="exactly one of"):
        q.plan_update(QUEUE, "1", ALICE, CAPS, SITE, hold=True, priority=50)
    assert q.Op("update", "1", (("Nice", "5"),)).describe() == "scontrol update JobId=1 Nice=5"


def test_update_batch_format() -> None:
    assert q.parse_batch(["12.priority=1", "13.resource_pool=gpu"]) == [
        ("12", "priority", "1"),
        ("13", "resource-pool", "gpu"),
    ]
    with pytest.raises(q.QueueError, match="<jobID>.<operation>=<value>"):
        q.parse_batch(["12.weight=3"])
