"""Queue edits -> scontrol plans (pure), on squeue rows shaped like the captured real output."""

from __future__ import annotations

from dataclasses import replace

import pytest

from detslurm import queue as q
from detslurm.slurm.parse import Capabilities, QueuedJob
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
    assert q.plan_update(QUEUE, "1", ALICE, CAPS, priority=60) == [q.Op("update", "1", (("Nice", "1800"),))]
    with pytest.raises(q.QueueError, match="lets ordinary users only lower the priority"):
        q.plan_update(QUEUE, "1", ALICE, CAPS, priority=10)
    assert q.plan_update(QUEUE, "1", ROOT, CAPS, priority=10) == [q.Op("update", "1", (("Nice", "-3200"),))]
    with pytest.raises(q.QueueError, match="priority must be between 1 and 99"):
        q.plan_update(QUEUE, "1", ROOT, CAPS, priority=0)


def test_only_own_jobs() -> None:
    with pytest.raises(q.QueueError, match="job 3 belongs to bob; you can only change your own jobs"):
        q.plan_update(QUEUE, "3", ALICE, CAPS, hold=True)
    assert q.plan_update(QUEUE, "3", ROOT, CAPS, hold=True) == [q.Op("hold", "3")]
    with pytest.raises(q.QueueError, match="job 99 not found"):
        q.plan_update(QUEUE, "99", ALICE, CAPS, hold=True)


def test_ahead_and_behind() -> None:
    assert q.plan_update(QUEUE, "1", ALICE, CAPS, ahead_of="2") == [q.Op("top", "1")]
    assert q.plan_update(QUEUE, "1", ROOT, CAPS, ahead_of="3") == [q.Op("update", "1", (("Priority", "501"),))]
    with pytest.raises(q.QueueError, match="only admins may raise"):
        q.plan_update(QUEUE, "1", ALICE, CAPS, ahead_of="3")
    no_top = replace(CAPS, enable_user_top=False)
    # without scontrol top, alice can still lower her other job below this one
    assert q.plan_update(QUEUE, "1", ALICE, no_top, ahead_of="2") == [q.Op("update", "2", (("Nice", "201"),))]
    assert q.plan_update(QUEUE, "2", ALICE, CAPS, behind_of="1") == [q.Op("update", "2", (("Nice", "201"),))]
    assert q.plan_update(QUEUE, "1", ALICE, CAPS, behind_of="2") == []  # already behind


GPU = q.Shape("gpu", gpu_pool=True)
SHOWN_CPU = {"Partition": "cpu", "NumNodes": "1-1", "NumCPUs": "2", "CPUs/Task": "2", "MinCPUsNode": "2"}
KEEPER = q.Keeper(7, "abc", "your store")


def pool(name: str, src: q.Shape | None, dst: q.Shape, shown: dict[str, str] | None = None) -> object:
    return (name, (src, dst), SHOWN_CPU if shown is None else shown)


def test_pools_and_holds() -> None:
    # A job that is no trial: the partition and what the pool sets, its shape its own.
    assert q.plan_update(QUEUE, "1", ALICE, CAPS, pool=pool("gpu", None, GPU)) == [
        q.Op("update", "1", (("Partition", "gpu"),))
    ]
    running = q.plan_update(QUEUE, "4", ALICE, CAPS, keeper=KEEPER, pool=pool("gpu", None, GPU, {}))
    assert running == [q.PoolMove(7, "gpu", "abc", "your store")]
    with pytest.raises(q.QueueError, match="cannot move a running job"):
        q.plan_update([replace(QUEUE[0], state=SlurmState.RUNNING)], "1", ALICE, CAPS, pool=pool("gpu", None, GPU))
    with pytest.raises(q.QueueError, match="only pending jobs can be held"):
        q.plan_update(QUEUE, "4", ALICE, CAPS, hold=True)
    with pytest.raises(q.QueueError, match="exactly one of"):
        q.plan_update(QUEUE, "1", ALICE, CAPS, hold=True, priority=50)
    assert q.Op("update", "1", (("Nice", "5"),)).describe() == "scontrol update JobId=1 Nice=5"


def test_owner_cannot_release_an_admin_hold() -> None:
    held = [replace(QUEUE[0], reason="JobHeldAdmin")]
    with pytest.raises(q.QueueError, match="held by an administrator .*JobHeldAdmin.*only an administrator"):
        q.plan_update(held, "1", ALICE, CAPS, release=True)
    assert q.plan_update(held, "1", ROOT, CAPS, release=True) == [q.Op("release", "1")]
    user_held = [replace(QUEUE[0], reason="JobHeldUser")]
    assert q.plan_update(user_held, "1", ALICE, CAPS, release=True) == [q.Op("release", "1")]


CPU2 = q.Shape("cpu", nodes=1, cpus_per_task=2)


def test_cpu_trial_to_gpu_pool_gets_gres_in_place() -> None:
    dst = q.Shape("gpu", gpu_pool=True, nodes=1, gres="gpu:2")
    ops = q.plan_update(QUEUE, "1", ALICE, CAPS, keeper=KEEPER, pool=pool("gpu", CPU2, dst))
    fields = (
        ("Partition", "gpu"),
        ("TresPerNode", "gres:gpu:2"),
        ("CPUsPerTask", "1"),
        ("MinCPUsNode", "1"),
        ("NumCPUs", "1"),
    )
    assert ops == [q.Op("update", "1", fields), q.PoolMove(7, "gpu", "abc", "your store")]
    assert ops[0].describe() == (
        "scontrol update JobId=1 Partition=gpu TresPerNode=gres:gpu:2 CPUsPerTask=1 MinCPUsNode=1 NumCPUs=1"
    )


def test_what_scontrol_cannot_change_replaces_a_trial_and_refuses_other_jobs() -> None:
    shown_gpu = {"Partition": "gpu", "NumNodes": "1", "TresPerNode": "gres:gpu:2", "NumCPUs": "1"}
    src = q.Shape("gpu", gpu_pool=True, nodes=1, gres="gpu:2")
    ops = q.plan_update(QUEUE, "1", ALICE, CAPS, keeper=KEEPER, pool=pool("cpu", src, CPU2, shown_gpu))
    assert len(ops) == 1 and isinstance(ops[0], q.Replace)
    assert "cannot take a GRES (gpu:2) off a pending job" in ops[0].why
    assert ops[0].describe().startswith("scancel --state=PENDING 1, then resubmit its trial in pool cpu")
    with pytest.raises(q.QueueError, match="cannot move to pool cpu in place: .*GRES.*nothing changed"):
        q.plan_update(QUEUE, "1", ALICE, CAPS, pool=pool("cpu", None, q.Shape("cpu"), shown_gpu))
    # A node count its script fixes; an account, QOS or time limit Slurm cannot reset.
    two = q.Shape("cpu", nodes=2, cpus_per_task=2)
    assert "on 1 node(s) and this pool gives it 2" in q.in_place(SHOWN_CPU, CPU2, two)[1][0]
    billed = replace(CPU2, account="a", qos="hi", time="60")
    why = q.in_place(SHOWN_CPU, billed, CPU2)[1]
    assert len(why) == 3 and "no account" in why[0] and "no QOS" in why[1] and "no time limit" in why[2]
    fields, why = q.in_place({**SHOWN_CPU, "TimeLimit": "01:00:00"}, CPU2, billed)
    assert why == [] and ("Account", "a") in fields and ("QOS", "hi") in fields and ("TimeLimit", "60") not in fields


def test_a_move_or_priority_its_experiment_cannot_keep() -> None:
    lost = q.Keeper(7, "abc", "bob's store", "bob's store has no experiment 7")
    with pytest.raises(
        q.QueueError, match="not moved: .*experiment 7, which cannot be moved with it .*nothing changed"
    ):
        q.plan_update(QUEUE, "1", ROOT, CAPS, keeper=lost, pool=pool("gpu", None, GPU))
    ops = q.plan_update(QUEUE, "1", ROOT, CAPS, keeper=lost, priority=10)
    assert ops[0] == q.Op("update", "1", (("Nice", "-3200"),))
    assert ops[1] == q.NotKept(
        "priority 10 is for job 1 only: experiment 7's later submissions keep their priority "
        "(bob's store has no experiment 7)"
    )
    assert q.plan_update(QUEUE, "1", ROOT, CAPS, keeper=KEEPER, priority=10)[1] == q.SavePriority(
        7, 10, "abc", "your store"
    )


def test_update_batch_format() -> None:
    assert q.parse_batch(["12.priority=1", "13.resource_pool=gpu"]) == [
        ("12", "priority", "1"),
        ("13", "resource-pool", "gpu"),
    ]
    with pytest.raises(q.QueueError, match="<jobID>.<operation>=<value>"):
        q.parse_batch(["12.weight=3"])
