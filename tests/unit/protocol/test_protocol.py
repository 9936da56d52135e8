"""The shared-filesystem protocol: encode/decode of every record, hostile input, bounded reads."""

from __future__ import annotations

import json
import math
import os
import time
import tracemalloc
from pathlib import Path

import pytest

from detslurm.protocol import (
    Alert,
    BadEvent,
    BadRecord,
    CheckpointDeleted,
    CheckpointSaved,
    ControlRecord,
    EarlyExit,
    Event,
    EventType,
    ExitRecord,
    ExpPaths,
    Metrics,
    NotARunDir,
    OpCompleted,
    PreemptAck,
    Progress,
    RunMetadata,
    RunPaths,
    SearcherOps,
    Status,
    UnknownEvent,
    decode,
    encode,
    exit_outcome,
    read_lines,
)

EVERY_EVENT: list[Event] = [
    Metrics(group="training", steps_completed=10, metrics={"loss": 0.5, "acc": 1}, batch_metrics=[{"loss": 1.0}]),
    Metrics(group="validation", steps_completed=0, metrics={}),
    CheckpointSaved(
        uuid="0b5c-uuid", steps_completed=3, storage_path="/ck/0b5c", metadata={"a": [1]}, resources={"w": 4}, size=4
    ),
    CheckpointDeleted(uuid="0b5c-uuid"),
    Progress(progress=0.25),
    Progress(progress=1.0, raw=40.0),
    Status(state="validating"),
    PreemptAck(),
    EarlyExit(reason="INVALID_HP"),
    OpCompleted(index=2, length=100, metric=0.125),
    Alert(title="t", description="d", level="warn"),
    RunMetadata(metadata={"k": {"nested": True}}),
]


def test_every_event_type_round_trips() -> None:
    assert {type(e).TYPE for e in EVERY_EVENT} == set(EventType)
    for ev in EVERY_EVENT:
        line = encode(ev)
        assert line.endswith("\n") and line.count("\n") == 1
        assert json.loads(line)["v"] == 1
        assert decode(line.encode()) == ev


def test_nan_metrics_survive_and_lines_without_version_are_v1() -> None:
    ev = decode(encode(Metrics(group="validation", steps_completed=1, metrics={"loss": math.nan})))
    assert isinstance(ev, Metrics) and math.isnan(ev.metrics["loss"])
    old = decode(b'{"type": "progress", "progress": 0.5, "time": 1700000000.0}')
    assert old == Progress(progress=0.5, time=1700000000.0)


# Poison lines (malformed fields of each event type), and more of the same kind: each is a BadEvent with a reason.
POISON = [
    ('{"type": "metrics", "group": "g", "steps_completed": "ten", "metrics": {}}', "'steps_completed' must be an int"),
    ('{"type": "metrics", "group": "g", "steps_completed": 1.5, "metrics": {}}', "'steps_completed' must be an int"),
    ('{"type": "metrics", "group": "g", "steps_completed": true, "metrics": {}}', "'steps_completed' must be an int"),
    ('{"type": "metrics", "group": "g", "steps_completed": -1, "metrics": {}}', "must be between"),
    ('{"type": "metrics", "group": "g", "steps_completed": 1, "metrics": [1, 2]}', "'metrics' must be an object"),
    ('{"type": "metrics", "group": "' + "g" * 65 + '", "steps_completed": 1, "metrics": {}}', "longer than 64"),
    ('{"type": "metrics", "group": "g", "steps_completed": 1, "metrics": {"a\\u0000": 1}}', "NUL"),
    ('{"type": "checkpoint", "steps_completed": 1}', "'uuid' is missing"),
    ('{"type": "checkpoint", "uuid": "../../x", "steps_completed": 1}', "not a checkpoint id"),
    ('{"type": "checkpoint", "uuid": "..", "steps_completed": 1}', "not a checkpoint id"),
    ('{"type": "checkpoint", "uuid": "a", "steps_completed": 1, "storage_path": 5}', "'storage_path' must be a str"),
    ('{"type": "checkpoint_deleted", "uuid": "a/b"}', "not a checkpoint id"),
    ('{"type": "progress", "progress": null}', "'progress' must be a number, got null"),
    ('{"type": "progress", "progress": "half"}', "'progress' must be a number"),
    ('{"type": "progress", "progress": NaN}', "finite"),
    ('{"type": "progress", "progress": 3}', "between 0 and 1"),
    ('{"type": "op_completed", "index": "a", "length": 1, "metric": 0}', "'index' must be an int"),
    ('{"type": "op_completed", "index": 1, "length": 1, "metric": "x"}', "'metric' must be a number"),
    ('{"type": "status", "state": ["x"]}', "'state' must be a string"),
    ('{"type": "alert", "title": "' + "t" * 5000 + '"}', "longer than 4096"),
    ('{"type": "run_metadata", "metadata": 3}', "'metadata' must be an object"),
    ('{"type": "progress", "progress": 0.5, "time": "noon"}', "'time' must be a number"),
    ('{"type": "progress", "progress": 0.5, "time": 1e300}', "not a timestamp"),
    ('{"type": "progress", "progress": 0.5, "v": 2}', "unsupported event version"),
    ("[1, 2]", "must be a JSON object"),
    ("not json at all", "not JSON"),
    ("[" * 100000, "not JSON"),
    (
        '{"type": "metrics", "group": "g", "steps_completed": 1, "metrics": {"a": ' + "[" * 40 + "]" * 40 + "}}",
        "deeper",
    ),
]


@pytest.mark.parametrize("line,reason", POISON, ids=[str(i) for i in range(len(POISON))])
def test_poison_lines_are_bad_events(line: str, reason: str) -> None:
    with pytest.raises(BadEvent) as e:
        decode(line.encode())
    assert reason in e.value.reason and len(e.value.reason) < 300


def test_unknown_type_and_non_utf8() -> None:
    with pytest.raises(UnknownEvent, match="'telemetry'"):
        decode(b'{"type": "telemetry"}')
    with pytest.raises(BadEvent):
        decode(b'{"type": "status", "state": "\xff\xfe"}')


@pytest.mark.parametrize(
    "content,problem",
    [
        (b'{"code": null}', "'code' must be an integer, got null"),
        (b"[1]", "must be a JSON object, got list"),
        (b"\xff\xfe", "not UTF-8 JSON"),
        (b'{"code": "1"}', "'code' must be an integer"),
        (b"{}", "'code' is missing"),
        (b'{"code": 0, "pad": "' + b"x" * (1 << 20) + b'"}', "larger than"),
    ],
)
def test_exit_record_never_raises(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "exit.json"
    path.write_bytes(content)
    out = exit_outcome(path)
    assert out.present and out.code is None and out.problem is not None and problem in out.problem
    with pytest.raises(BadRecord):
        ExitRecord.read(path)


def test_exit_record_round_trip_and_batch_format(tmp_path: Path) -> None:
    from detslurm.protocol import BATCH_EXIT_PRINTF

    assert not exit_outcome(tmp_path / "none.json").present
    ExitRecord(code=3, start=1.0, end=2.0).write(tmp_path / "exit.json")
    assert exit_outcome(tmp_path / "exit.json").code == 3
    # What the batch shell's printf writes decodes with the same decoder.
    shell = BATCH_EXIT_PRINTF.replace("\\n", "\n") % (137, "12_3")
    assert ExitRecord.decode(json.loads(shell)) == ExitRecord(code=137, source="batch", job="12_3")


def test_control_and_ops_records(tmp_path: Path) -> None:
    ControlRecord(preempt=True, reason="pause").write(tmp_path / "c.json")
    assert ControlRecord.read(tmp_path / "c.json") == ControlRecord(True, "pause")
    (tmp_path / "c.json").write_text('{"preempt": "yes"}')
    with pytest.raises(BadRecord, match="preempt"):
        ControlRecord.read(tmp_path / "c.json")
    ops = SearcherOps(ops=(10, 20), completed=1, closed=False, idle_after=1)
    ops.write(tmp_path / "o.json")
    assert SearcherOps.read(tmp_path / "o.json") == ops


def test_paths_one_spelling(tmp_path: Path) -> None:
    run = ExpPaths(tmp_path).run(4, 2)
    assert run.dir == tmp_path / "trials" / "4" / "runs" / "2"
    assert RunPaths.from_run_dir(run.dir) == run and run.exp_root == tmp_path
    env = {"DETSLURM_EXP_DIR": str(tmp_path), "DET_TRIAL_ID": "4", "DET_TRIAL_RUN_ID": "2"}
    assert RunPaths.from_env(env) == run
    assert RunPaths.from_env({"DET_RUN_DIR": str(run.dir)}) == run
    with pytest.raises(NotARunDir):
        RunPaths.from_run_dir(tmp_path / "somewhere" / "else")
    run.events_dir.mkdir(parents=True)
    for name in ("rank-1.jsonl", "rank-0.jsonl", "rank-x.jsonl", "notes.txt", "rank-10.jsonl"):
        (run.events_dir / name).write_text("")
    assert [p.name for p in run.event_files()] == ["rank-0.jsonl", "rank-1.jsonl", "rank-10.jsonl"]


# -- the bounded reader --------------------------------------------------------------------
GOOD = b'{"type": "progress", "progress": 0.5}\n'


def test_reader_torn_line_held_back(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.jsonl"
    path.write_bytes(GOOD + b'{"type": "prog')
    batch = read_lines(path, 0)
    assert [ln.data + b"\n" for ln in batch.lines] == [GOOD] and batch.offset == len(GOOD)
    assert read_lines(path, batch.offset).lines == []
    assert read_lines(tmp_path / "missing.jsonl", 7).offset == 7


def test_reader_chunk_cap(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.jsonl"
    path.write_bytes(GOOD * 100)
    offset, seen = 0, 0
    for _ in range(100):
        batch = read_lines(path, offset, max_chunk=len(GOOD) * 7 + 3, max_line=len(GOOD) * 2)
        if not batch.lines:
            break
        assert len(batch.lines) <= 7
        offset, seen = batch.offset, seen + len(batch.lines)
    assert seen == 100 and offset == len(GOOD) * 100


def test_reader_overlong_line_in_chunk_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.jsonl"
    path.write_bytes(GOOD + b"x" * 5000 + b"\n" + GOOD)
    batch = read_lines(path, 0, max_chunk=1 << 16, max_line=1000)
    assert [ln.problem for ln in batch.lines] == [None, "a line longer than 1000 bytes", None]
    assert batch.offset == path.stat().st_size


def test_reader_100mib_line_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.jsonl"
    with open(path, "wb") as f:
        f.write(GOOD)
        block = b"x" * (1 << 20)
        for _ in range(100):
            f.write(block)
    tracemalloc.start()
    started = time.monotonic()
    first = read_lines(path, 0)
    took = time.monotonic() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 32 << 20 and took < 30
    assert [ln.problem for ln in first.lines] == [None, "a line longer than 1048576 bytes"]
    offset, calls = first.offset, 1
    while offset < path.stat().st_size:  # skip mode: bounded chunks, never re-reading
        nxt = read_lines(path, offset)
        assert nxt.lines == [] and nxt.offset > offset
        offset, calls = nxt.offset, calls + 1
    assert calls <= 14
    with open(path, "ab") as f:
        f.write(b"tail of the long line\n" + GOOD)
    last = read_lines(path, offset)
    assert [ln.data + b"\n" for ln in last.lines] == [GOOD] and last.offset == path.stat().st_size


def test_reader_nul_gap_waits_while_recent_then_fills_in(tmp_path: Path) -> None:
    """NFS out-of-order writeback: zeros now, the real bytes a moment later. No event is lost."""
    path = tmp_path / "rank-0.jsonl"
    second = b'{"type": "status", "state": "late"}\n'
    path.write_bytes(GOOD + b"\0" * len(second) + GOOD)
    batch = read_lines(path, 0)
    assert len(batch.lines) == 1 and batch.offset == len(GOOD) and batch.waiting is not None
    with open(path, "r+b") as f:  # the writeback arrives
        f.seek(len(GOOD))
        f.write(second)
    batch = read_lines(path, batch.offset)
    assert [ln.data + b"\n" for ln in batch.lines] == [second, GOOD]
    assert all(ln.problem is None for ln in batch.lines)


def test_reader_nul_line_quarantined_once_quiet(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.jsonl"
    path.write_bytes(b"\0\0\0" + GOOD + GOOD)
    old = time.time() - 3600
    os.utime(path, (old, old))
    batch = read_lines(path, 0)
    assert [ln.problem for ln in batch.lines] == ["NUL bytes in the line", None]
    assert batch.offset == path.stat().st_size and batch.waiting is None
    # The same file read "now + 31 s" by an injected clock: quiet as well.
    os.utime(path, None)
    later = read_lines(path, 0, clock=lambda: time.time() + 31)
    assert [ln.problem for ln in later.lines] == ["NUL bytes in the line", None]


def test_a_record_that_is_no_file_is_refused_without_a_leak(tmp_path: Path) -> None:
    """A directory, a FIFO or a symlink where a record belongs is a BadRecord, and every
    descriptor opened on the way is closed (the daemon reads records on every tick)."""
    from detslurm.protocol.records import BadRecord, read_record

    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "real.json")
    fds = "/proc/self/fd"
    before = len(os.listdir(fds)) if os.path.isdir(fds) else 0
    for _ in range(20):
        for name, why in (("dir", "not a regular file"), ("fifo", "not a regular file"), ("link", "symbolic link")):
            with pytest.raises(BadRecord, match=why):
                read_record(tmp_path / name)
    assert (len(os.listdir(fds)) if before else 0) == before
    assert read_record(tmp_path / "real.json") == {}


def test_record_text_with_a_lone_surrogate_is_refused_and_other_unicode_kept() -> None:
    """Detached-run records and metadata are checked field by field (protocol/_check.py): a lone
    surrogate would fail the store's flush later, for every run in that transaction."""
    from detslurm.protocol import _check

    assert _check.text("naïve ✓", "name") == "naïve ✓"
    assert _check.mapping({"é": 1.0, "note": "ü"}, "metrics") == {"é": 1.0, "note": "ü"}
    for bad in (lambda: _check.text("a\ud800", "name"), lambda: _check.mapping({"x": ["\udfff"]}, "metadata")):
        with pytest.raises(_check.BadRecord, match="lone surrogate"):
            bad()
    with pytest.raises(_check.BadRecord, match="lone surrogate"):
        _check.mapping({"\ud83d": 1.0}, "metrics")  # a key: half of a pair


def test_an_events_dir_that_is_a_link_or_a_loop_lists_no_event_files(tmp_path: Path) -> None:
    """Another run's events reached through a link would be counted twice; a link loop or an
    unreadable dir must not fail the tick: no event files, for now."""
    from detslurm.protocol import RunPaths

    real = RunPaths(tmp_path / "exp", 1, 1)
    real.events_dir.mkdir(parents=True)
    real.event_file(0).write_text("")
    assert real.event_files() == [real.event_file(0)]
    linked = RunPaths(tmp_path / "exp", 2, 1)
    linked.dir.mkdir(parents=True)
    linked.events_dir.symlink_to(real.events_dir)
    assert linked.event_files() == []
    loop = RunPaths(tmp_path / "exp", 3, 1)
    loop.dir.mkdir(parents=True)
    loop.events_dir.symlink_to(loop.events_dir)
    assert loop.event_files() == []
