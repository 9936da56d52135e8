"""Bounded, exactly-once reading of a trial's event file from a recorded byte offset.

The controller stores, per event file, the offset up to which lines are consumed; it commits
that offset with the rows the lines produced. This reader returns the complete lines after the
offset and the new offset, under three bounds that keep one trial from hurting the controller:

* at most ``max_chunk`` bytes per call (the rest waits for the next tick);
* a line longer than ``max_line`` is never held in memory: it is reported as a problem and
  skipped, the offset moving past it even across calls (see "skip mode" below);
* a torn last line (a writer mid-write, or killed mid-write) is left for a later call and is
  not counted in the offset, unless it is already longer than ``max_line``.

Skip mode needs no extra state: offsets only ever land just after a newline, except while a
too-long line is being skipped. So "the byte before the offset is not a newline" means "we are
inside a line already reported; drop bytes up to its newline".
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NamedTuple

from detslurm.util import file_kind, open_regular

MAX_CHUNK = 8 << 20
MAX_LINE = 1 << 20
SKIP_BLOCK = 1 << 20
# NFS writeback gap: a client that flushes dirty pages out of order extends the
# file before the earlier bytes arrive, and a reader on another host sees a NUL-filled region
# (often followed by the newline of a later line) that fills in moments later. Consuming it as
# "corrupt" would lose real events. So a line with NUL bytes is held back (nothing at or after
# it is consumed) while the file was modified within NUL_QUIET_S seconds and the line lies in
# its last NUL_WINDOW bytes, where unflushed pages can be. Once the file has been quiet that
# long, or the line is far behind the tail, the NULs are permanent: the line is reported as a
# problem and skipped. The cost is latency, never a lost event. (mtime is set by the file
# server's clock: skew against ours only lengthens or shortens the wait, as NTP allows.)
NUL_QUIET_S = 30.0
NUL_WINDOW = 16 << 20
PREVIEW = 80


class Line(NamedTuple):
    """A complete line at [start, end) (``end`` is just past its newline). ``problem`` says why
    it is quarantined, and ``data`` is then only a preview. (A NamedTuple: one per event line,
    ~100k a second at ingest, built at a third of a frozen dataclass's cost.)"""

    start: int
    end: int
    data: bytes
    problem: str | None = None


@dataclass(frozen=True)
class Batch:
    lines: list[Line] = field(default_factory=list)
    offset: int = 0  # everything before it is consumed
    waiting: str | None = None  # why the reader stopped short of the file's end, if it did
    # Complete lines may remain past ``offset`` (the chunk bound stopped the read): the next
    # read must not wait for the file to grow.
    more: bool = False
    # The path is no event file the trial's writer makes (a FIFO, a directory, a symlink): why.
    # Nothing was read, and nothing should be read from it again.
    refused: str | None = None
    # The file was shorter than the offset (it lost its tail): the offset it had. The lines are
    # then read on from the end of its last whole line.
    shrunk_from: int | None = None


def preview(raw: bytes) -> str:
    """A printable, bounded rendering of trial-written bytes, safe for a note in the store."""
    shown = ascii(raw[:PREVIEW])[2:-1]
    return shown + ("..." if len(raw) > PREVIEW else "")


def read_lines(
    path: Path,
    offset: int,
    *,
    max_chunk: int = MAX_CHUNK,
    max_line: int = MAX_LINE,
    quiet_s: float = NUL_QUIET_S,
    clock: Callable[[], float] = time.time,
) -> Batch:
    """The complete lines after ``offset`` in ``path`` (see the module doc for the bounds)."""
    assert max_chunk > max_line, "a chunk must be able to hold the longest allowed line"
    # O_NONBLOCK: a FIFO put in place of the file must not hang the daemon in its open (for a
    # regular file the flag changes nothing). O_NOFOLLOW: the writer makes no symlinks.
    try:
        opened = open_regular(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return Batch(offset=offset)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return Batch(offset=offset, refused="is a symbolic link")
        # EACCES, or EIO/ESTALE on a network filesystem: maybe not for long; the next tick retries.
        return Batch(offset=offset, waiting=f"cannot open it: {e.strerror}")
    if opened is None:
        try:
            return Batch(offset=offset, refused=f"is {file_kind(os.lstat(path).st_mode)}")
        except OSError:
            return Batch(offset=offset, refused="is not a regular file")
    f, st = opened
    with f:
        if st.st_size < offset:
            # Lost its tail (an NFS server that crashed with unsynced writes, a restore): what is
            # left is what was read, and the writer appends after it. Reading on from the end of
            # its last whole line consumes nothing twice.
            batch = _read(f, _end_of_last_line(f, st.st_size, max_line), max_chunk, max_line, clock() - quiet_s)
            return Batch(batch.lines, batch.offset, batch.waiting, batch.more, shrunk_from=offset)
        return _read(f, offset, max_chunk, max_line, clock() - quiet_s)


def _end_of_last_line(f: BinaryIO, size: int, max_line: int) -> int:
    """Just past the last newline in the file's first ``size`` bytes (0 when none is within
    ``max_line`` of the end, which then reads as a line too long, skipped)."""
    start = max(0, size - max_line - 1)
    f.seek(start)
    nl = f.read(size - start).rfind(b"\n")
    return start + nl + 1 if nl >= 0 else (0 if start == 0 else size)


def _read(f: BinaryIO, offset: int, max_chunk: int, max_line: int, quiet_since: float) -> Batch:
    st = os.fstat(f.fileno())
    if offset >= st.st_size:
        return Batch(offset=offset)
    end = min(st.st_size, offset + max_chunk)
    pos = offset
    if offset > 0 and _byte_at(f, offset - 1) != b"\n":
        pos = _skip_to_newline(f, offset, end)
        if pos < 0:  # still inside the long line: consume what we scanned
            return Batch(offset=end, more=end < st.st_size)
    recent = st.st_mtime > quiet_since
    f.seek(pos)
    batch = _split(f.read(end - pos), pos, st.st_size, recent, max_line)
    if end < st.st_size:
        batch = Batch(batch.lines, batch.offset, batch.waiting, more=True)
    return batch


def _split(data: bytes, base: int, size: int, recent: bool, max_line: int) -> Batch:
    lines: list[Line] = []
    i = 0
    while i < len(data):
        nl = data.find(b"\n", i, i + max_line + 1)
        if nl < 0:
            if len(data) - i <= max_line:
                break  # a torn last line, or the chunk's end: the next call sees all of it
            # Longer than max_line: report it and drop bytes up to its newline (if in sight).
            after = data.find(b"\n", i + max_line + 1)
            stop = len(data) if after < 0 else after + 1
            problem = f"a line longer than {max_line} bytes"
            lines.append(Line(base + i, base + stop, data[i : i + PREVIEW], problem))
            i = stop
            continue
        raw = data[i:nl]
        if b"\x00" in raw:
            if recent and size - (base + i) <= NUL_WINDOW:
                return Batch(lines, base + i, "NUL bytes in recently written data (NFS writeback?); waiting")
            lines.append(Line(base + i, base + nl + 1, raw[:PREVIEW], "NUL bytes in the line"))
        elif raw.strip():
            lines.append(Line(base + i, base + nl + 1, raw))
        i = nl + 1
    return Batch(lines, base + i)


def _byte_at(f: BinaryIO, pos: int) -> bytes:
    f.seek(pos)
    return f.read(1)


def _skip_to_newline(f: BinaryIO, start: int, end: int) -> int:
    """The offset just past the first newline in [start, end), or -1; reads SKIP_BLOCK at a time."""
    f.seek(start)
    pos = start
    while pos < end:
        block = f.read(min(SKIP_BLOCK, end - pos))
        if not block:
            break
        nl = block.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(block)
    return -1
