"""Trial logs: each run's output file, controller notes, rank filters, following.

A trial writes its output file, so its size and line lengths are untrusted (security review
M2): nothing here reads a whole file or a whole line into memory. Files are read in chunks of
CHUNK bytes, a line longer than MAX_LINE bytes is cut (its first MAX_LINE bytes and a marker
saying how much was dropped), and ``--tail`` reads backwards from the end of the file.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import BinaryIO

import click

from detslurm import views
from detslurm.cli.app import App

# The prefix launchers/wrap_rank.py puts on every line of a rank's output, as Determined's
# wrap_rank does; --rank-id filters on it.
RANK = re.compile(r"\[rank=(\d+)\]")
CHUNK = 1 << 20  # bytes read at a time
MAX_LINE = 1 << 20  # bytes of one line kept; the rest is dropped and counted


def _decode(data: bytes, cut: int) -> list[str]:
    """One line's bytes as text lines (a progress bar's \\r also splits, as before), with the
    cut marker on the last."""
    # errors="replace": a trial may write any bytes, and one bad byte must not hide the log.
    out = data.decode(errors="replace").splitlines() or [""]
    if cut:
        out[-1] += f" ... [line cut: {cut} more bytes]"
    return out


class LineCutter:
    """Splits a byte stream fed in chunks into text lines, holding at most MAX_LINE bytes of an
    unfinished line (the rest of a longer line is only counted)."""

    def __init__(self, max_line: int | None = None) -> None:
        self.max_line = MAX_LINE if max_line is None else max_line
        self.pending = bytearray()
        self.cut = 0

    def _take(self, piece: bytes) -> None:
        room = self.max_line - len(self.pending)
        if room > 0:
            self.pending += piece[:room]
        # Only the count of dropped bytes is kept, so a line of gigabytes costs MAX_LINE of memory.
        self.cut += max(0, len(piece) - max(room, 0))

    def feed(self, chunk: bytes) -> list[str]:
        """The lines that ``chunk`` completes."""
        out: list[str] = []
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._take(chunk[start:end])
            out += _decode(bytes(self.pending), self.cut)
            self.pending.clear()
            self.cut = 0
            start = end + 1
        # The tail after the last newline is an unfinished line: it waits for the next chunk.
        self._take(chunk[start:])
        return out

    def flush(self) -> list[str]:
        """The unterminated last line, if any (at the end of a file that is complete)."""
        if not self.pending and not self.cut:
            return []
        out = _decode(bytes(self.pending), self.cut)
        self.pending.clear()
        self.cut = 0
        return out


def file_lines(path: Path) -> Iterator[str]:
    """The lines of ``path``, first to last, in bounded memory."""
    cutter = LineCutter()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield from cutter.feed(chunk)
    yield from cutter.flush()


def _newlines_backwards(f: BinaryIO, end: int) -> Iterator[int]:
    """Positions of the newlines before ``end``, last first, reading one CHUNK at a time."""
    pos = end
    while pos > 0:
        start = max(0, pos - CHUNK)
        f.seek(start)
        block = f.read(pos - start)
        i = len(block)
        while (i := block.rfind(b"\n", 0, i)) >= 0:
            yield start + i
        pos = start


def file_lines_reversed(path: Path) -> Iterator[str]:
    """The lines of ``path``, last to first, reading backwards from the end: the cost follows
    how many lines the caller takes, not the size of the file."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        end = size
        for nl in _newlines_backwards(f, size):
            if nl != size - 1:  # a final newline ends the last line; it does not start an empty one
                yield from _read_line(f, nl + 1, end)
            end = nl
        # The first line has no newline before it, so the loop above never yields it.
        yield from _read_line(f, 0, end)


def file_tail(path: Path, n: int) -> list[str]:
    """The last ``n`` lines of ``path``, first to last."""
    return list(islice(file_lines_reversed(path), max(n, 0)))[::-1]


def _read_line(f: BinaryIO, start: int, end: int) -> Iterator[str]:
    """The line at [start, end) as text lines, last first, keeping at most MAX_LINE bytes of it."""
    f.seek(start)
    n = end - start
    data = f.read(min(n, MAX_LINE))
    yield from reversed(_decode(data, n - len(data)))


@dataclass(frozen=True)
class _Run:
    run_id: int
    path: str


def _trial_sources(app: App, trial_id: int) -> tuple[list[_Run], list[str]]:
    with app.store.read() as s:
        # Called for its check: another user's trial raises "not found" before any path is read.
        views.get_trial(s, trial_id, app.scope)
        runs = [_Run(r.run_id, r.log_path) for r in views.runs(s, trial_id)]
        # Controller notes (requeues, exit reasons) are store rows, not file lines; they are shown
        # after the output in Determined's "[time] source || level: message" log format.
        notes = [f"[{n.time:%Y-%m-%dT%H:%M:%SZ}] detslurm || {n.level}: {n.message}" for n in views.notes(s, trial_id)]
    return runs, notes


def _rank_filter(ranks: Sequence[int]) -> Callable[[str], bool]:
    wanted = set(ranks)

    def keep(line: str) -> bool:
        if not wanted:
            return True
        m = RANK.search(line)
        return m is not None and int(m.group(1)) in wanted

    return keep


def lines(app: App, trial_id: int, ranks: Sequence[int] = ()) -> Iterator[str]:
    """Every run's output (each after a header line), then the controller's notes; with
    ``ranks``, only those ranks' output lines."""
    runs, notes = _trial_sources(app, trial_id)
    keep = _rank_filter(ranks)
    for run in runs:
        if not ranks:
            yield f"=== trial {trial_id} run {run.run_id} ({run.path})"
        p = Path(run.path)
        # is_file: a run may have no output file (a detached run outside Slurm records none).
        if run.path and p.is_file():
            yield from (line for line in file_lines(p) if keep(line))
    if not ranks:
        yield from notes


def tail(app: App, trial_id: int, n: int, ranks: Sequence[int] = ()) -> list[str]:
    """The last ``n`` of :func:`lines`, read from the ends of the files backwards."""
    if n <= 0:
        return []
    runs, notes = _trial_sources(app, trial_id)
    keep = _rank_filter(ranks)
    # Built last line first: notes come after all runs, then each run's file from its end,
    # then its header; the list is reversed once at the end.
    out: list[str] = [] if ranks else notes[::-1][:n]
    for run in reversed(runs):
        p = Path(run.path)
        if len(out) < n and run.path and p.is_file():
            out += islice((line for line in file_lines_reversed(p) if keep(line)), n - len(out))
        if len(out) < n and not ranks:
            out.append(f"=== trial {trial_id} run {run.run_id} ({run.path})")
        if len(out) >= n:
            break
    return out[::-1]


def head(app: App, trial_id: int, n: int, ranks: Sequence[int] = ()) -> list[str]:
    """The first ``n`` of :func:`lines` (only as much of the files as they need is read)."""
    return list(islice(lines(app, trial_id, ranks), max(n, 0)))


class Follower:
    """Prints new output of a trial's runs as they grow (used by -f), one chunk at a time; an
    unfinished last line waits (at most MAX_LINE bytes of it) for its newline."""

    def __init__(self, app: App, trial_id: int, ranks: Sequence[int] = ()) -> None:
        self.app = app
        self.trial_id = trial_id
        self.keep = _rank_filter(ranks)
        # Bytes already printed per log file: each pump reads only what was appended since.
        self.offsets: dict[str, int] = {}
        self.cutters: dict[str, LineCutter] = {}

    def pump(self) -> None:
        with self.app.store.read() as s:
            views.get_trial(s, self.trial_id, self.app.scope)  # another user's trial is "not found"
            # Read the runs every pump: a requeued or resumed trial gets a new run with its own file.
            paths = [r.log_path for r in views.runs(s, self.trial_id)]
        for path in paths:
            p = Path(path)
            if not path or not p.is_file():
                continue
            # One cutter per file, kept across pumps, so a line split over two pumps is printed whole.
            cutter = self.cutters.setdefault(path, LineCutter())
            with open(p, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                while chunk := f.read(CHUNK):
                    self.offsets[path] = self.offsets.get(path, 0) + len(chunk)
                    for line in cutter.feed(chunk):
                        if self.keep(line):
                            click.echo(line)
