"""A trial's output for the dashboard, in bounded chunks: the page asks again with the cursor it
got back, which is how "follow" works (a poll every second or two; nothing is held open).

Log files are written by the trial (untrusted, any size): a request reads at most
READ_BUDGET bytes, a first request starts TAIL_BYTES before the end, and only whole lines are
returned (a line longer than MAX_LINE is cut, as `det trial logs` cuts it).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from detslurm.util import open_regular

# launchers/wrap_rank.py's prefix, the one `det trial logs --rank-id` filters on.
RANK = re.compile(r"\[rank=(\d+)\]")
TAIL_BYTES = 256 * 1024
READ_BUDGET = 1 << 20
MAX_LINE = 64 * 1024


@dataclass
class Cursor:
    """Bytes already shown of each run's log (by position in the trial's run list)."""

    offsets: dict[int, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Cursor:
        """``"0:123,1:45"`` (what :meth:`render` wrote); anything else is a fresh cursor."""
        out = cls()
        for part in text.split(","):
            a, _, b = part.partition(":")
            if a.isdigit() and b.isdigit():
                out.offsets[int(a)] = int(b)
        return out

    def render(self) -> str:
        return ",".join(f"{k}:{v}" for k, v in sorted(self.offsets.items()))


@dataclass
class LogChunk:
    lines: list[str]
    cursor: str
    # More is waiting right now (the budget ran out): the page asks again at once.
    more: bool


def _fresh(paths: list[str]) -> Cursor:
    """A first look: the last TAIL_BYTES of the trial's output, the newest run's end last."""
    cur = Cursor()
    budget = TAIL_BYTES
    for i in reversed(range(len(paths))):
        size = _size(paths[i])
        cur.offsets[i] = max(0, size - budget)
        budget = max(0, budget - size)
    return cur


def _size(path: str) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def read(paths: list[str], cursor: Cursor, rank: int | None = None) -> LogChunk:
    """New whole lines of every run's log after ``cursor``; ``rank`` keeps only that rank's."""
    fresh = not cursor.offsets
    if fresh:
        cursor = _fresh(paths)
    lines: list[str] = []
    budget = READ_BUDGET
    more = False
    for i, path in enumerate(paths):
        start = cursor.offsets.get(i, 0)
        if budget <= 0:
            more = more or _size(path) > start
            continue
        data = _read(path, start, budget)
        # Only whole lines: the rest (a line still being written) is read again next time.
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) >= MAX_LINE:
            end = len(data)  # one enormous line: shown cut rather than waited for forever
        body = data[:end]
        if fresh and start > 0:
            # Started mid-file: the first line is a fragment.
            body = body[body.find(b"\n") + 1 :]
        if start == 0 and end:
            lines.append(f"=== run {i + 1} ({path})")
        cursor.offsets[i] = start + end
        # The read filled the budget: there may be more behind it.
        more = more or len(data) == budget
        budget -= end
        lines += _lines(body, rank)
    return LogChunk(lines, cursor.render(), more)


def _read(path: str, start: int, budget: int) -> bytes:
    # O_NONBLOCK and a regular file only: the run dir is the trial's, and a FIFO at the log's
    # name would hold a server thread on every poll of the page.
    try:
        opened = open_regular(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if opened is None:
            return b""
        with opened[0] as f:
            f.seek(start)
            return f.read(budget)
    except OSError:
        return b""


def _lines(body: bytes, rank: int | None) -> list[str]:
    out: list[str] = []
    if not body:
        return out
    for raw in body.split(b"\n")[:-1] if body.endswith(b"\n") else body.split(b"\n"):
        line = raw.decode("utf-8", errors="replace")
        if len(line) > MAX_LINE:
            line = line[:MAX_LINE] + f" [... {len(line) - MAX_LINE} characters cut]"
        if rank is not None:
            m = RANK.search(line)
            if m is None or int(m.group(1)) != rank:
                continue
        out.append(line)
    return out
