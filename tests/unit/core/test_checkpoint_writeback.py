"""Early writeback of checkpoints (core/_writeback.py): large files are flushed while they are
written, small ones and links are left to store_path's final fsync pass, and nothing of the
checkpoint's contract changes (it is complete and renamed only at the end)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from detslurm.ckpt_settings import WRITEBACK_ENV
from detslurm.core import _checkpoint
from detslurm.core._checkpoint import CheckpointContext
from detslurm.core._distributed import DummyDistributedContext
from detslurm.core._writeback import EarlyWriteback
from detslurm.protocol.events import CheckpointSaved, Event

MIB = 1 << 20


def test_a_pass_flushes_files_that_grew_enough_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/big.pt").write_bytes(b"x" * (2 * MIB))
    (tmp_path / "small.json").write_text("{}")
    os.symlink(tmp_path / "sub/big.pt", tmp_path / "link.pt")
    wb = EarlyWriteback(tmp_path, min_bytes=MIB)
    wb.flush_grown()
    assert wb.flushes == 1  # big.pt; not the small file, not the link to big.pt
    wb.flush_grown()
    assert wb.flushes == 1, "an unchanged file is not flushed again"
    with open(tmp_path / "sub/big.pt", "ab") as f:
        f.write(b"y" * (MIB // 2))
    wb.flush_grown()
    assert wb.flushes == 1, "half of min_bytes of growth waits for the final pass"
    with open(tmp_path / "sub/big.pt", "ab") as f:
        f.write(b"y" * (MIB // 2))
    wb.flush_grown()
    assert wb.flushes == 2


def test_a_file_removed_mid_pass_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = str(tmp_path / "a.pt")
    Path(target).write_bytes(b"x" * MIB)
    (tmp_path / "b.pt").write_bytes(b"x" * MIB)
    real_lstat = os.lstat

    def lstat_after_removal(path: str) -> os.stat_result:
        # Only this one path: a patched os.lstat also serves pytest and everything else meanwhile.
        if path == target:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # the writer renames or removes it between the listing and the stat
        return real_lstat(path)

    monkeypatch.setattr(os, "lstat", lstat_after_removal)
    wb = EarlyWriteback(tmp_path, min_bytes=MIB)
    wb.flush_grown()
    assert wb.flushes == 1


def test_the_thread_flushes_while_the_body_writes_and_stops_at_exit(tmp_path: Path) -> None:
    with EarlyWriteback(tmp_path, period_s=0.01, min_bytes=MIB) as wb:
        with open(tmp_path / "weights.pt", "wb") as f:
            for _ in range(8):
                f.write(b"w" * MIB)
                f.flush()
                want = wb.flushes + 1
                for _ in range(500):  # up to 5 s for the thread to see this MiB
                    if wb.flushes >= want:
                        break
                    threading.Event().wait(0.01)
        assert wb.flushes >= 8
    assert not any(t.name == "detslurm-ckpt-writeback" for t in threading.enumerate())


class Recording(EarlyWriteback):
    made: list[Recording] = []

    def __init__(self, root: Path) -> None:
        super().__init__(root, period_s=0.01, min_bytes=MIB)
        Recording.made.append(self)


def test_store_path_flushes_a_large_checkpoint_before_its_final_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_checkpoint, "EarlyWriteback", Recording)
    Recording.made.clear()
    events: list[Event] = []
    ctx = CheckpointContext(DummyDistributedContext(), tmp_path / "ckpts", events.append, require_steps=False)
    with ctx.store_path({"steps_completed": 3}) as (path, uuid):
        with open(path / "state.pt", "wb") as f:
            for _ in range(4):
                f.write(b"s" * (2 * MIB))
                f.flush()
                os.fsync(f.fileno())  # not needed for the thread; makes the size visible at once
                threading.Event().wait(0.05)
        assert not (tmp_path / "ckpts" / uuid).exists(), "still partial while the body runs"
    (wb,) = Recording.made
    assert wb.flushes >= 1
    assert (tmp_path / "ckpts" / uuid / "state.pt").stat().st_size == 8 * MIB
    (saved,) = events
    assert isinstance(saved, CheckpointSaved) and saved.uuid == uuid and saved.size > 8 * MIB


def test_a_failed_write_stops_the_thread_and_leaves_no_partial(tmp_path: Path) -> None:
    ctx = CheckpointContext(DummyDistributedContext(), tmp_path, [].append, require_steps=False)
    with pytest.raises(RuntimeError, match="disk full"):
        with ctx.store_path({"steps_completed": 1}) as (path, _):
            (path / "state.pt").write_bytes(b"x" * MIB)
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []
    assert not any(t.name == "detslurm-ckpt-writeback" for t in threading.enumerate())


def test_the_setting_turns_it_off_and_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checkpoint, "EarlyWriteback", Recording)
    Recording.made.clear()
    monkeypatch.setenv(WRITEBACK_ENV, "0")
    ctx = CheckpointContext(DummyDistributedContext(), tmp_path, [].append, require_steps=False)
    with ctx.store_path({"steps_completed": 1}) as (path, _):
        (path / "state.pt").write_bytes(b"x" * (2 * MIB))
    assert Recording.made == []
    monkeypatch.setenv(WRITEBACK_ENV, "off")
    with pytest.raises(ValueError, match=f"{WRITEBACK_ENV}='off': expected 0 or 1"):
        CheckpointContext(DummyDistributedContext(), tmp_path, [].append, require_steps=False)


def test_a_walk_that_costs_cpu_is_followed_by_four_times_as_long_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint with thousands of small files (the Trainer copies the trial's code) must not
    have this thread take the writer's CPU: here every pass "costs" 1 s of CPU."""
    from detslurm.core import _writeback

    ticks = iter(range(0, 10**6))
    monkeypatch.setattr(_writeback.time, "thread_time", lambda: float(next(ticks)))
    (tmp_path / "big.pt").write_bytes(b"x" * MIB)
    with EarlyWriteback(tmp_path, period_s=0.001, min_bytes=MIB) as wb:
        for _ in range(200):  # the first pass, within 2 s
            if wb.passes:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.2)  # well inside the 4 s the rule asks after that pass
    assert (wb.passes, wb.flushes) == (1, 1)


def test_sharded_checkpoints_keep_only_the_final_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node writes into one shared dir: a walk would stat the other nodes' files."""
    monkeypatch.setattr(_checkpoint, "EarlyWriteback", Recording)
    Recording.made.clear()
    events: list[Event] = []
    ctx = CheckpointContext(DummyDistributedContext(), tmp_path, events.append, require_steps=False)
    with ctx.store_path({"steps_completed": 1}, shard=True) as (path, uuid):
        (path / "shard-0.pt").write_bytes(b"x" * (2 * MIB))
    assert Recording.made == []
    assert (tmp_path / uuid / "shard-0.pt").stat().st_size == 2 * MIB


def test_linux_starts_writeback_without_waiting_and_others_fall_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from detslurm.core import _writeback

    start, waits = _writeback._start_writeback_fn()
    if sys.platform.startswith("linux"):
        assert start not in (getattr(os, "fdatasync", None), os.fsync) and not waits  # sync_file_range
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * MIB)
        start(fd)
        with pytest.raises(OSError):
            start(-1)  # errors surface as OSError, which the thread logs and skips
    finally:
        os.close(fd)
    monkeypatch.setattr(_writeback.sys, "platform", "darwin")
    fallback, waits = _writeback._start_writeback_fn()
    assert fallback in (getattr(os, "fdatasync", None), os.fsync) and waits


def _failing(err: int, first_only: bool = False) -> tuple[list[int], Callable[[int], None]]:
    """A flush that fails with ``err`` (the first call only, with ``first_only``), and the
    list of the calls it got."""
    calls: list[int] = []

    def start(fd: int) -> None:
        calls.append(fd)
        if not first_only or len(calls) == 1:
            raise OSError(err, os.strerror(err))

    return calls, start


def test_a_file_that_cannot_be_flushed_does_not_stop_the_pass(tmp_path: Path) -> None:
    (tmp_path / "a.pt").write_bytes(b"x" * MIB)
    (tmp_path / "b.pt").write_bytes(b"x" * MIB)
    wb = EarlyWriteback(tmp_path, min_bytes=MIB)
    calls, wb._start = _failing(errno.EIO, first_only=True)
    wb._waits = False  # sync_file_range: it only starts writes, the final fsync reports errors
    assert wb.flush_grown() == 1 and len(calls) == 2  # the second file is still flushed
    assert wb.flush_grown() == 0 and len(calls) == 2  # the failed one waits until it grows again
    assert wb.error is None  # the error is the final pass's to report


def test_a_write_error_a_waiting_flush_saw_fails_the_save(tmp_path: Path) -> None:
    """fdatasync marks a write error as reported (Linux), so the final fsync might not see it
    again: the writeback raises it when the body ends, and store_path removes the partial."""
    (tmp_path / "a.pt").write_bytes(b"x" * MIB)
    wb = EarlyWriteback(tmp_path, min_bytes=MIB)
    _calls, wb._start = _failing(errno.EIO)
    wb._waits = True
    with pytest.raises(OSError, match="Input/output error"), wb:
        wb.flush_grown()


def test_writeback_stops_where_the_system_cannot_do_it(tmp_path: Path) -> None:
    (tmp_path / "a.pt").write_bytes(b"x" * MIB)
    (tmp_path / "b.pt").write_bytes(b"x" * MIB)
    wb = EarlyWriteback(tmp_path, min_bytes=MIB)
    calls, wb._start = _failing(errno.ENOSYS)  # a sandbox without sync_file_range
    wb._waits = False
    assert wb.flush_grown() == 0 and len(calls) == 1 and wb._start is None
    (tmp_path / "c.pt").write_bytes(b"x" * MIB)
    assert wb.flush_grown() == 0 and len(calls) == 1  # no more tries for this checkpoint
    assert wb.error is None  # not an error: the final pass makes it durable


def test_a_file_swapped_for_a_fifo_after_the_stat_does_not_hang_the_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = str(tmp_path / "a.pt")
    Path(target).write_bytes(b"x" * MIB)
    real_lstat = os.lstat

    def lstat_then_swap(path: str) -> os.stat_result:
        st = real_lstat(path)
        if path == target and stat.S_ISREG(st.st_mode):  # this one file, once; nothing else
            os.unlink(path)
            os.mkfifo(path)  # no writer: a blocking open for reading would wait forever
        return st

    monkeypatch.setattr(os, "lstat", lstat_then_swap)
    wb = EarlyWriteback(tmp_path, min_bytes=MIB)
    errors: list[OSError] = []

    def one_pass() -> None:
        try:
            wb.flush_grown()
        except OSError as e:  # sync_file_range on a FIFO: the thread logs it and goes on
            errors.append(e)

    t = threading.Thread(target=one_pass, daemon=True)  # daemon: a hang must not keep pytest alive
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "the pass hung opening a FIFO"


def test_a_fallback_flush_the_filesystem_cannot_do_is_no_error(tmp_path: Path) -> None:
    """fdatasync's EINVAL (a filesystem that cannot sync) is what the final pass tolerates too:
    it must not fail the save."""
    (tmp_path / "a.pt").write_bytes(b"x" * MIB)
    wb = EarlyWriteback(tmp_path, min_bytes=MIB)
    calls, wb._start = _failing(errno.EINVAL)
    wb._waits = True
    wb.flush_grown()
    assert len(calls) == 1 and wb.error is None
