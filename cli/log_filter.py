"""What `det trial logs` and `det e logs` keep: ranks, a minimum level and a time window.

Pure (no store, no files), so the rules are tested on literal lines. Levels are read from the
line the way Determined's log shipper reads them: the first ``LEVEL:`` in the line. A line
without one (a bare print) counts as INFO, so ``--level WARNING`` hides plain output and
``--level INFO`` keeps it.

A trial's output lines carry no timestamps (they are what the program printed), so the time
window selects runs: a run's output is shown when the run was alive during the window. The
controller's notes have their own times and are filtered one by one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

# The prefix launchers/wrap_rank.py puts on every line of a rank's output, as Determined's
# wrap_rank does; --rank-id filters on it.
RANK = re.compile(r"\[rank=(\d+)\]")
# Determined's levels, lowest first (its LogLevel enum without UNSPECIFIED).
LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LEVEL = re.compile(r"\b(TRACE|DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL):")
# Spellings Python's logging also prints, mapped onto Determined's names.
_ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL"}


def line_level(line: str) -> str:
    """The level a line was logged at; INFO when it names none."""
    m = _LEVEL.search(line)
    if m is None:
        return "INFO"
    return _ALIASES.get(m.group(1), m.group(1))


def _rank(level: str) -> int:
    return LEVELS.index(level) if level in LEVELS else LEVELS.index("INFO")


def _utc(t: datetime) -> datetime:
    # SQLite hands back naive datetimes; the store writes UTC, so naive means UTC.
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class LogFilter:
    """The filters of one logs command; the empty filter keeps everything (and headers)."""

    ranks: tuple[int, ...] = ()
    min_level: str | None = None  # one of LEVELS; None keeps every level
    since: datetime | None = None
    until: datetime | None = None

    @property
    def empty(self) -> bool:
        return not self.ranks and self.min_level is None and self.since is None and self.until is None

    def keeps_line(self, line: str) -> bool:
        """A line of a trial's output, by its rank prefix and level."""
        if self.ranks:
            m = RANK.search(line)
            if m is None or int(m.group(1)) not in self.ranks:
                return False
        return self.min_level is None or _rank(line_level(line)) >= _rank(self.min_level)

    def keeps_run(self, start: datetime | None, end: datetime | None) -> bool:
        """Whether a run (alive from ``start`` to ``end``, None: still running) overlaps the window."""
        if self.until is not None and start is not None and _utc(start) > _utc(self.until):
            return False
        return self.since is None or end is None or _utc(end) >= _utc(self.since)

    def keeps_note(self, time: datetime, level: str) -> bool:
        """A controller note: its own time and level; rank filters hide notes (they have no rank)."""
        if self.ranks:
            return False
        t = _utc(time)
        if (self.since is not None and t < _utc(self.since)) or (self.until is not None and t > _utc(self.until)):
            return False
        return self.min_level is None or _rank(level) >= _rank(self.min_level)


def parse_time(text: str, what: str) -> datetime:
    """An ISO 8601 time (``2026-11-23T12:00:00Z``, ``2026-11-23 12:00``, a date); without a zone
    it is UTC, as every time detslurm prints is."""
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{what} {text!r}: expected an ISO 8601 time such as 2026-11-23T12:00:00Z") from None
    return _utc(t)
