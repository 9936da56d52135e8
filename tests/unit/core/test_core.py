from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from detslurm.core import DistributedContext, PreemptMode, get_cluster_info, init, merge_metadata
from detslurm.core._checkpoint import CheckpointContext
from detslurm.core._events import EventWriter
from detslurm.core._preempt import PreemptContext
from detslurm.errors import CheckpointNotFound
from detslurm.protocol import CheckpointDeleted, Metrics, decode, from_env, read_lines, trial_env
from detslurm.protocol.secret import SECRET_ENV, SECRET_FILE_ENV, new_secret


@pytest.fixture(autouse=True)
def run_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a launcher gives its ranks: a fresh random secret (groups refuse to form without one)."""
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, new_secret().hex())


def next_port() -> int:
    """A port free right now (not a fixed sequence: two suites may run side by side)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def run_ranks(
    size: int, local_size: int, fn: Callable[[DistributedContext], Any], force_tcp: bool = False
) -> list[Any]:
    """One thread per rank, each with a real DistributedContext (Determined's parallel.Execution)."""
    port = next_port()
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            ctx = DistributedContext(
                rank=rank,
                size=size,
                local_rank=rank % local_size,
                local_size=local_size,
                cross_rank=rank // local_size,
                cross_size=size // local_size,
                chief_ip="127.0.0.1",
                pub_port=port,
                pull_port=port + 1,
                force_tcp=force_tcp,
            )
            try:
                results[rank] = fn(ctx)
            finally:
                ctx.close()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("cross,local", [(1, 1), (1, 4), (4, 1), (2, 2)])
@pytest.mark.parametrize("force_tcp", [False, True])
def test_collectives(cross: int, local: int, force_tcp: bool) -> None:
    size = cross * local

    def body(d: DistributedContext) -> dict[str, Any]:
        return {
            "bcast": d.broadcast(d.rank * 10),
            "bcast_local": d.broadcast_local(d.rank),
            "gather": d.gather(d.rank),
            "gather_local": d.gather_local(d.rank),
            "allgather": d.allgather(d.rank),
            "allgather_local": d.allgather_local(d.rank),
        }

    res = run_ranks(size, local, body, force_tcp)
    for rank, r in enumerate(res):
        assert r["bcast"] == 0
        assert r["bcast_local"] == rank - rank % local
        assert r["gather"] == (list(range(size)) if rank == 0 else None)
        node = list(range(rank - rank % local, rank - rank % local + local))
        assert r["gather_local"] == (node if rank % local == 0 else None)
        assert r["allgather"] == list(range(size))
        assert r["allgather_local"] == node


def test_from_torch_distributed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    d = DistributedContext.from_torch_distributed()
    assert (d.rank, d.size, d.cross_size, d.get_num_agents()) == (0, 1, 1, 1)
    with pytest.raises(ValueError, match="chief_ip is required"):
        DistributedContext(rank=0, size=4, local_rank=0, local_size=2, cross_rank=0, cross_size=2)


def test_checkpoint_atomic_and_failure_keeps_previous(tmp_path: Path) -> None:
    reports: list[Any] = []
    with init() as core:
        ck = CheckpointContext(core.distributed, tmp_path, reports.append, require_steps=True)
        with ck.store_path({"steps_completed": 5}) as (path, first):
            (path / "w.txt").write_text("five")
        with pytest.raises(RuntimeError, match="disk full"):
            with ck.store_path({"steps_completed": 10}) as (path, second):
                (path / "w.txt").write_text("half")
                raise RuntimeError("disk full")
        assert [r.uuid for r in reports] == [first]  # the failed one was never reported
        assert not (tmp_path / second).exists()  # and never appears under its final name
        with ck.restore_path(first) as p:
            assert (p / "w.txt").read_text() == "five"
        assert ck.get_metadata(first) == {"steps_completed": 5}
        assert reports[0].resources == {"w.txt": 4, "metadata.json": reports[0].resources["metadata.json"]}
        with pytest.raises(ValueError, match="steps_completed"):
            with ck.store_path({}):
                pass
        with pytest.raises(CheckpointNotFound):
            with ck.restore_path("no-such-uuid"):
                pass
        ck.download(first, tmp_path / "dl")
        assert (tmp_path / "dl/w.txt").read_text() == "five"
        ck.delete(first)
        assert not (tmp_path / first).exists() and reports[-1] == CheckpointDeleted(uuid=first, time=reports[-1].time)


def test_sharded_checkpoint_across_ranks(tmp_path: Path) -> None:
    reports: list[Any] = []

    def body(d: DistributedContext) -> str:
        ck = CheckpointContext(d, tmp_path, reports.append, require_steps=True)
        with ck.store_path({"steps_completed": 3, f"rank{d.rank}": True}, shard=True) as (path, uuid):
            (path / f"shard-{d.rank}.bin").write_text(str(d.rank))
        return uuid

    uuids = run_ranks(4, 2, body)
    assert len(set(uuids)) == 1
    assert len(reports) == 1
    assert sorted(k for k in reports[0].resources if k.startswith("shard")) == [f"shard-{r}.bin" for r in range(4)]
    assert reports[0].metadata == {"steps_completed": 3, "rank0": True, "rank1": True, "rank2": True, "rank3": True}
    with pytest.raises(RuntimeError, match="metadata conflicts"):
        merge_metadata([{"a": 1}, {"a": 2}])
    assert merge_metadata([{"a": {"b": 1}}, {"a": {"c": 2}}, {"a": {"b": 1}}]) == {"a": {"b": 1, "c": 2}}


def test_sharded_checkpoint_node_pass_waits_for_the_nodes_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's one fsync pass runs once every rank of that node has written: their data sits
    in that node's page cache, which the chief's pass on another node cannot flush."""
    from detslurm.core import _checkpoint

    seen: dict[str, list[str]] = {}
    real_sync = _checkpoint.sync_tree

    def recording_sync(root: Path, modes: Any) -> None:
        seen["node" if modes is None else "final"] = sorted(os.listdir(root))
        real_sync(root, modes)

    monkeypatch.setattr(_checkpoint, "sync_tree", recording_sync)

    def body(d: DistributedContext) -> str:
        ck = CheckpointContext(d, tmp_path, lambda e: None, require_steps=True)
        with ck.store_path({"steps_completed": 1}, shard=True) as (path, uuid):
            if d.rank == 3:  # node 1's second rank finishes last
                time.sleep(0.5)
            (path / f"shard-{d.rank}.bin").write_text(str(d.rank))
        return uuid

    run_ranks(4, 2, body)
    # Node 1 (ranks 2 and 3) made one pass, after both of its shards were written.
    assert {"shard-2.bin", "shard-3.bin"} <= set(seen["node"])
    assert {f"shard-{r}.bin" for r in range(4)} <= set(seen["final"])


def test_non_chief_store_path_refused() -> None:
    def body(d: DistributedContext) -> str:
        ck = CheckpointContext(d, Path("/nonexistent"), lambda e: None, require_steps=False)
        if d.rank == 1:
            with pytest.raises(RuntimeError, match="non-chief"):
                with ck.store_path({}):
                    pass
        return "ok"

    assert run_ranks(2, 2, body) == ["ok", "ok"]


def test_preempt_from_control_file_reaches_all_ranks(tmp_path: Path) -> None:
    control = tmp_path / "control.json"
    acks: list[int] = []

    def body(d: DistributedContext) -> list[bool]:
        p = PreemptContext(d, control, lambda: acks.append(d.rank), PreemptMode.WorkersAskChief)
        p.start()
        try:
            seen = [p.should_preempt()]
            if d.rank == 0:
                control.write_text(json.dumps({"preempt": True, "reason": "pause"}))
            deadline = time.time() + 10
            while time.time() < deadline:
                ans = p.should_preempt()
                if ans:
                    seen.append(ans)
                    break
                time.sleep(0.05)
            return seen
        finally:
            p.close()

    assert run_ranks(3, 3, body) == [[False, True]] * 3
    assert acks == [0]  # only the chief acknowledges


def test_should_preempt_outside_init_refused() -> None:
    d = DistributedContext(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
    with pytest.raises(RuntimeError, match="inside"):
        PreemptContext(d, None, lambda: None).should_preempt()


def read_new(path: Path, offset: int) -> tuple[list[int], int]:
    """The ``steps_completed`` of the complete metrics lines after ``offset``, and the new offset."""
    batch = read_lines(path, offset)
    steps = []
    for line in batch.lines:
        ev = decode(line.data)
        assert isinstance(ev, Metrics)
        steps.append(ev.steps_completed)
    return steps, batch.offset


def test_events_exactly_once_and_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    w = EventWriter(path)
    for i in range(100):
        w.emit(Metrics(group="training", steps_completed=i, metrics={}))
    w.flush()
    events, off = read_new(path, 0)
    assert events == list(range(100))
    with open(path, "a") as f:
        # a writer killed mid-line
        f.write('{"type": "metrics", "group": "g", "steps_completed": 100, "metrics": {}}\n{"type": "met')
    more, off2 = read_new(path, off)
    assert more == [100]
    assert read_new(path, off2) == ([], off2)
    with open(path, "a") as f:
        f.write('rics", "group": "g", "steps_completed": 101, "metrics": {}}\n')
    last, _ = read_new(path, off2)
    assert last == [101]
    w.close()


def test_cluster_info_off_and_on_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("DET_"):
            monkeypatch.delenv(k)
    assert get_cluster_info() is None
    env = trial_env(
        experiment_id=3,
        trial_id=7,
        run_id=2,
        seed=42,
        hparams={"lr": 0.1},
        config={"data": {"x": 1}},
        latest_checkpoint="abc",
        steps_completed=50,
        run_dir=tmp_path / "r",
        trial_dir=tmp_path,
        exp_dir=tmp_path,
        checkpoint_base=str(tmp_path / "ck"),
        resources_type="slurm-job",
        slot_ids=[0, 1],
        container_addrs=["10.0.0.1", "10.0.0.2"],
        user="alice",
    )
    info = from_env(env)
    assert info is not None
    assert (info.trial.trial_id, info.trial.experiment_id, info.trial.hparams) == (7, 3, {"lr": 0.1})
    assert (info.latest_checkpoint, info.trial._steps_completed, info.trial._trial_run_id) == ("abc", 50, 2)
    assert info.slot_ids == [0, 1] and info.container_addrs == ["10.0.0.1", "10.0.0.2"]
    assert info.user_data == {"x": 1} and info.allocation_id == "exp-3-trial-7-run-2"


def test_off_cluster_context_works(tmp_path: Path) -> None:
    with init(checkpoint_storage=str(tmp_path)) as core:
        core.train.report_training_metrics(1, {"loss": 1.0})
        core.train.report_validation_metrics(1, {"loss": 1.0})
        with pytest.raises(ValueError):
            core.train.report_metrics("bad.group", 1, {})
        with pytest.raises(ValueError):
            core.train.report_progress(1.5)
        with core.checkpoint.store_path({}) as (path, uuid):
            (path / "x").write_text("1")
        assert (tmp_path / uuid / "x").exists()
        assert core.preempt.should_preempt() is False
        assert [op.length for op in _complete(core.searcher.operations())] == [1]
        assert core.info is None


def _complete(ops: Any) -> list[Any]:
    out = []
    for op in ops:
        op.report_completed(0.0)
        out.append(op)
    return out


_RANK_SCRIPT = """
import json, os, sys
from detslurm.core import DistributedContext
d = DistributedContext(rank=int(sys.argv[1]), size=4, local_rank=int(sys.argv[1]) % 2, local_size=2,
                       cross_rank=int(sys.argv[1]) // 2, cross_size=2, chief_ip="127.0.0.1", pub_port=int(sys.argv[2]))
out = {"all": d.allgather(d.rank * d.rank), "local": d.allgather_local(d.rank), "b": d.broadcast(f"from{d.rank}")}
d.close()
print(json.dumps(out))
"""


def test_collectives_across_processes() -> None:
    import subprocess
    import sys

    port = next_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(r), str(port)], stdout=subprocess.PIPE, text=True)
        for r in range(4)
    ]
    outs = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    assert all(o["all"] == [0, 1, 4, 9] and o["b"] == "from0" for o in outs)
    assert [o["local"] for o in outs] == [[0, 1], [0, 1], [2, 3], [2, 3]]
