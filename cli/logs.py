"""Trial logs: each run's output file, controller notes, rank filters, following.

A trial writes its output file, so its size and line lengths are untrusted
(docs/design/security.md): nothing here reads a whole file or a whole line into memory. Files are read in chunks of
CHUNK bytes, a line longer than MAX_LINE bytes is cut (its first MAX_LINE bytes and a marker
saying how much was dropped), and ``--tail`` reads backwards from the end of the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

import click

from detslurm.cli.app import App
from detslurm.cli.lazy import lazy_module
from detslurm.cli.log_filter import LEVELS, LogFilter, parse_time
from detslurm.util import open_regular

# Loaded on first use (cli/lazy.py): `det e list` and the other reads must not pay for the
# ORM, the controller or pydantic when their fast path needs none of them.
if TYPE_CHECKING:
    from detslurm import views
else:
    views = lazy_module("detslurm.views")

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


def _open(path: Path) -> BinaryIO | None:
    """``path`` for reading, or None when it is gone or not a regular file: the run dir is the
    trial's, and a FIFO it put at the log's name must not block this command (O_NONBLOCK)."""
    try:
        opened = open_regular(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    return None if opened is None else opened[0]


def file_lines(path: Path) -> Iterator[str]:
    """The lines of ``path``, first to last, in bounded memory."""
    cutter = LineCutter()
    if (f := _open(path)) is None:
        return
    with f:
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
    if (f := _open(path)) is None:
        return
    with f:
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
    start: datetime | None
    end: datetime | None


@dataclass(frozen=True)
class _Note:
    text: str
    time: datetime
    level: str


def _note(time: datetime, level: str, message: str) -> _Note:
    # Controller notes (requeues, exit reasons) are store rows, not file lines; they are shown
    # among the runs' output in Determined's "[time] source || level: message" log format.
    return _Note(f"[{time:%Y-%m-%dT%H:%M:%SZ}] detslurm || {level}: {message}", time, level)


def _utc(t: datetime) -> datetime:
    # SQLite hands back naive datetimes; the store writes UTC.
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def _in_time_order(runs: list[_Run], notes: list[_Note]) -> list[_Run | _Note]:
    """Runs and notes in time order. A run's output lines carry no times, so the order is by
    run: each note comes before the first run that started after it (a run's exit reason after
    its output, before the next run's); a run not started yet comes after every note."""
    pending = sorted(notes, key=lambda n: _utc(n.time))  # stable: notes of one second keep their order
    out: list[_Run | _Note] = []
    i = 0
    for run in runs:
        while i < len(pending) and (run.start is None or _utc(pending[i].time) < _utc(run.start)):
            out.append(pending[i])
            i += 1
        out.append(run)
    return out + pending[i:]


def _trial_sources(app: App, trial_id: int) -> tuple[list[_Run], list[_Note]]:
    # Another user's trial raises "not found" before any path is read.
    runs, notes = app.reads.trial_logs(trial_id, app.scope.owner)
    return [_Run(*r) for r in runs], [_note(*n) for n in notes]


def _filter(flt: LogFilter | Sequence[int]) -> LogFilter:
    # Older callers pass only ranks.
    return flt if isinstance(flt, LogFilter) else LogFilter(ranks=tuple(flt))


def _header(trial_id: int, run: _Run) -> str:
    return f"=== trial {trial_id} run {run.run_id} ({run.path})"


def lines(app: App, trial_id: int, ranks: LogFilter | Sequence[int] = ()) -> Iterator[str]:
    """Every run's output (each after a header line) and the controller's notes, in time order;
    with a filter, only the lines it keeps (and no headers)."""
    flt = _filter(ranks)
    for item in _in_time_order(*_trial_sources(app, trial_id)):
        if isinstance(item, _Note):
            if flt.keeps_note(item.time, item.level):
                yield item.text
            continue
        run = item
        if not flt.keeps_run(run.start, run.end):
            continue
        if flt.empty:
            yield _header(trial_id, run)
        p = Path(run.path)
        # is_file: a run may have no output file (a detached run outside Slurm records none).
        if run.path and p.is_file():
            yield from (line for line in file_lines(p) if flt.keeps_line(line))


def tail(app: App, trial_id: int, n: int, ranks: LogFilter | Sequence[int] = ()) -> list[str]:
    """The last ``n`` of :func:`lines`, read from the ends of the files backwards."""
    if n <= 0:
        return []
    flt = _filter(ranks)
    # Built last line first: each run's file from its end, then its header, with the notes
    # where they fall; the list is reversed once at the end.
    out: list[str] = []
    for item in reversed(_in_time_order(*_trial_sources(app, trial_id))):
        if len(out) >= n:
            break
        if isinstance(item, _Note):
            if flt.keeps_note(item.time, item.level):
                out.append(item.text)
            continue
        if not flt.keeps_run(item.start, item.end):
            continue
        p = Path(item.path)
        if item.path and p.is_file():
            out += islice((line for line in file_lines_reversed(p) if flt.keeps_line(line)), n - len(out))
        if len(out) < n and flt.empty:
            out.append(_header(trial_id, item))
    return out[::-1]


def head(app: App, trial_id: int, n: int, ranks: LogFilter | Sequence[int] = ()) -> list[str]:
    """The first ``n`` of :func:`lines` (only as much of the files as they need is read)."""
    return list(islice(lines(app, trial_id, ranks), max(n, 0)))


class Follower:
    """Prints new output of a trial's runs as they grow (used by -f), one chunk at a time; an
    unfinished last line waits (at most MAX_LINE bytes of it) for its newline."""

    def __init__(self, app: App, trial_id: int, ranks: LogFilter | Sequence[int] = ()) -> None:
        self.app = app
        self.trial_id = trial_id
        # Only rank and level apply while following: every line printed is new, so the time
        # window has nothing to choose.
        self.keep = _filter(ranks).keeps_line
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
            if (f := _open(p)) is None:
                continue
            with f:
                f.seek(self.offsets.get(path, 0))
                while chunk := f.read(CHUNK):
                    self.offsets[path] = self.offsets.get(path, 0) + len(chunk)
                    for line in cutter.feed(chunk):
                        if self.keep(line):
                            click.echo(line)


F = TypeVar("F", bound=Callable[..., Any])

# show() takes options named head and tail, which hide the functions of those names.
_first, _last = head, tail


def log_options(fn: F) -> F:
    """The options of `det trial logs` (and `det e logs`), in Determined's spelling."""
    opts = [
        click.option("-f", "--follow", is_flag=True, help="Keep printing new output until the trial ends."),
        click.option("--head", type=int, default=None, help="Only the first N lines."),
        click.option("--tail", type=int, default=None, help="Only the last N lines."),
        click.option("--rank-id", "ranks", type=int, multiple=True, help="Only lines of these ranks ([rank=N])."),
        click.option(
            "--level",
            type=click.Choice(["UNSPECIFIED", *LEVELS], case_sensitive=False),
            default=None,
            help="Only lines at this level or higher (a line naming no level is INFO).",
        ),
        click.option(
            "--since",
            "--timestamp-after",
            "since",
            default=None,
            metavar="TIME",
            help="Only what was logged after TIME (ISO 8601, UTC unless it says otherwise).",
        ),
        click.option(
            "--until",
            "--timestamp-before",
            "until",
            default=None,
            metavar="TIME",
            help="Only what was logged before TIME.",
        ),
    ]
    out: Any = fn
    for opt in reversed(opts):
        out = opt(out)
    return cast(F, out)


def show(
    app: App,
    trial_id: int,
    *,
    follow: bool,
    head: int | None,
    tail: int | None,
    ranks: tuple[int, ...],
    level: str | None,
    since: str | None,
    until: str | None,
) -> None:
    """Print a trial's logs as the options ask (one reconcile first, so they are current)."""
    from detslurm.cli import slurm as slurm_mod

    # Refused rather than combined: Determined's CLI allows one of them, and silently
    # preferring either would show lines the user did not ask for.
    if head is not None and tail is not None:
        raise click.UsageError("use at most one of --head and --tail")
    try:
        flt = LogFilter(
            ranks=ranks,
            min_level=None if level is None or level.upper() == "UNSPECIFIED" else level.upper(),
            since=parse_time(since, "--since") if since else None,
            until=parse_time(until, "--until") if until else None,
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    slurm_mod.reconcile(app)
    if follow:
        _follow(app, trial_id, flt)
        return
    if head is not None:
        shown: Iterable[str] = _first(app, trial_id, head, flt)
    elif tail is not None:
        shown = _last(app, trial_id, tail, flt)
    else:
        shown = lines(app, trial_id, flt)
    for line in shown:
        click.echo(line)


def _follow(app: App, trial_id: int, flt: LogFilter) -> None:
    from detslurm.cli import slurm as slurm_mod
    from detslurm.store.models import TrialState

    follower = Follower(app, trial_id, flt)

    def step() -> bool | None:
        follower.pump()
        slurm_mod.reconcile(app)
        with app.store.read() as s:
            done = TrialState(views.get_trial(s, trial_id, app.scope).state).is_terminal
        if done:
            follower.pump()  # what it wrote before it ended
        # None keeps poll_until going; a final pump above catches output written just before the end.
        return True if done else None

    app.poll_until(step)


def follow_first_trial(app: App, exp_id: int) -> None:
    """Stream the first trial's output until it ends, saying why its job waits meanwhile."""
    click.echo("Waiting for first trial to begin...")
    follower: Follower | None = None
    shown_reason: str | None = None

    def step() -> bool | None:
        nonlocal follower, shown_reason
        with app.store.read() as s:
            tid, runner, done = views.first_trial(s, exp_id, app.scope)
        if tid is not None and follower is None:
            follower = Follower(app, tid)
            click.echo(f"Following first trial with ID {tid}")
        # Say why the job waits (Slurm's pending reason) only when it changes, not every poll.
        if runner and runner.startswith("queued") and runner != shown_reason:
            click.echo(f"HPC job waiting to be scheduled: {views.pending_words(runner)}")
            shown_reason = runner
        if follower is not None:
            follower.pump()
        if not done:
            return None
        if follower is not None:
            follower.pump()  # the last lines written before the trial ended
            click.echo(f"Trial log stream ended. To reopen log stream, run: det trial logs -f {tid}")
        return True

    app.poll_until(step)
