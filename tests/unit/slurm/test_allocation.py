"""A held job as a place for trial runs (detslurm/slurm/allocation.py): Slurm's account of it,
parsed from output captured on the test cluster, and how runs pack onto its nodes."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from detslurm.slurm.allocation import Allocation, HeldNode, Share, StepShape, parse_allocation, place, room, step_shape

DATA = Path(__file__).parents[2] / "data" / "slurm-22.05"


def two_by_two(cpus: int = 2) -> Allocation:
    return Allocation("9", "RUNNING", None, (HeldNode("g1", cpus, 2, 0), HeldNode("g2", cpus, 2, 0)))


def test_scontrol_show_job_of_an_allocation() -> None:
    # sbatch -p gpu -N2 --gres=gpu:2 --cpus-per-gpu=1 --time=30 on the 22.05 test cluster.
    alloc = parse_allocation("9", (DATA / "show-job-allocation.txt").read_text())
    assert alloc.running and alloc.nodes == (HeldNode("g1", 2, 2, 0), HeldNode("g2", 2, 2, 0))
    assert alloc.end_time == datetime.fromisoformat("2026-11-28T23:22:52").timestamp()
    assert alloc.describe() == "2 nodes (g1, g2) with 2 GPUs and 2 CPUs each"


def test_an_arrays_id_is_its_last_task_not_every_task() -> None:
    # sbatch -p cpu -c2 --array=0-1 on the 22.05 test cluster, both tasks running: task 1 has
    # the array's id (162), for which scontrol lists every task (task 0 is job 163, on c1).
    text = (DATA / "show-job-array.txt").read_text()
    assert parse_allocation("162", text).nodes == (HeldNode("c2", 2, 0, 0),)
    assert parse_allocation("163", text).nodes == (HeldNode("c1", 2, 0, 0),)


def test_node_groups_with_different_shares() -> None:
    text = (
        "JobId=7 JobName=x\n   JobState=RUNNING Reason=None\n   EndTime=Unknown Deadline=N/A\n"
        "     Nodes=g1 CPU_IDs=0-3 Mem=8000 GRES=gpu:tesla:4(IDX:0-3)\n"
        "     Nodes=g[2-3] CPU_IDs=0,2 Mem=4000 GRES=gpu:tesla:2(IDX:0-1),mps:100(0/100)\n"
    )
    alloc = parse_allocation("7", text)
    assert alloc.end_time is None
    assert alloc.nodes == (HeldNode("g1", 4, 4, 8000), HeldNode("g2", 2, 2, 4000), HeldNode("g3", 2, 2, 4000))


def test_one_slot_runs_fill_every_gpu_one_each() -> None:
    alloc = two_by_two()
    shape = step_shape(1, None, alloc)
    assert shape == StepShape(1, 1, 1) and room(alloc, shape, []) == 4
    placed: list[Share] = []
    while (share := place(alloc, shape, placed)) is not None:
        placed.append(share)
    # The busiest node fills first, so whole nodes stay free for runs of several nodes.
    assert [s.nodes for s in placed] == [("g1",), ("g1",), ("g2",), ("g2",)]
    assert all(s.gpus == 1 and s.cpus == 1 for s in placed)


def test_cpus_bound_the_packing_too() -> None:
    # salloc --gres=gpu:2 alone gives one CPU per node: one run per node, not two.
    assert room(two_by_two(cpus=1), StepShape(1, 1, 1), []) == 2


def test_a_run_of_several_nodes_takes_whole_free_nodes() -> None:
    alloc = two_by_two()
    shape = step_shape(4, None, alloc)
    assert shape == StepShape(2, 2, 4)
    assert place(alloc, shape, []) == Share(("g1", "g2"), 2, 2)
    one = Share(("g2",), 1, 1)
    assert place(alloc, shape, [one]) is None and room(alloc, StepShape(1, 1, 1), [one]) == 3


def test_memory_is_shared_where_slurm_tracks_it() -> None:
    alloc = Allocation("9", "RUNNING", None, (HeldNode("g1", 4, 2, 8000),))
    assert place(alloc, StepShape(1, 1, 1), []) == Share(("g1",), 1, 2, 4000)
