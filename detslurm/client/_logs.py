"""A trial's log lines for ``Trial.iter_logs``, read as `det trial logs` reads them: the options
checked and turned into the CLI's log filter, then the reader's lines."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional, Union

from detslurm.cli import logs as reader
from detslurm.cli.log_filter import LEVELS, LogFilter, parse_time
from detslurm.errors import DetSlurmError

if TYPE_CHECKING:
    from detslurm.client._session import Session


def log_lines(session: Session, trial_id: int, options: Mapping[str, Any]) -> Iterator[str]:
    """The lines (without newlines) ``Trial.iter_logs(**options)`` gives; ``min_level`` by name."""
    head, tail, search_text = options.get("head"), options.get("tail"), options.get("search_text")
    flt = _log_filter(options)
    # The reader takes the CLI's app; a session has what it reads (reads, scope).
    app: Any = session
    if tail is not None and not search_text:
        return iter(reader.tail(app, trial_id, tail, flt))
    found: Iterable[str] = (line for line in reader.lines(app, trial_id, flt) if not search_text or search_text in line)
    if tail is not None:
        found = collections.deque(found, maxlen=tail)
    elif head is not None:
        found = itertools.islice(found, head)
    return iter(found)


def _log_time(value: Union[str, int, None], what: str) -> Optional[datetime]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{what} must be an RFC 3339 string or epoch seconds (int), not {type(value).__name__}")
    if isinstance(value, int):
        return datetime.fromtimestamp(value, tz=timezone.utc)
    return parse_time(value, what)


def _log_filter(options: Mapping[str, Any]) -> LogFilter:
    """Trial.iter_logs' arguments checked, as the filter of `det trial logs`."""
    head, tail = options.get("head"), options.get("tail")
    if options.get("follow"):
        raise DetSlurmError("iter_logs(follow=True) is not built in the SDK: `det trial logs -f` follows a trial")
    if head is not None and tail is not None:
        raise ValueError("iter_logs(): head and tail are mutually exclusive")
    for name, n in (("head", head), ("tail", tail)):
        if n is not None and n < 0:
            raise ValueError(f"iter_logs(): {name} must be non-negative, got {n}")
    # One output file per run holds stdout and stderr of every rank on every node.
    stdtypes = options.get("stdtypes")
    if (
        options.get("container_ids")
        or options.get("sources")
        or (stdtypes and not {"stdout", "stderr"} <= set(stdtypes))
    ):
        raise ValueError(
            "iter_logs(): container_ids, sources and stdtypes do not apply here (a run's stdout and stderr "
            "are one file); filter by rank_ids, min_level or the timestamps"
        )
    level = options.get("min_level")
    if level is not None and level not in LEVELS:
        raise ValueError(f"iter_logs(): min_level must be one of {', '.join(LEVELS)} (got {level!r})")
    # A filter with a time always set: the reader then prints no "=== run" header lines, which
    # are not lines of the trial's log.
    since = _log_time(options.get("timestamp_after"), "timestamp_after") or datetime.min.replace(tzinfo=timezone.utc)
    until = _log_time(options.get("timestamp_before"), "timestamp_before")
    return LogFilter(ranks=tuple(options.get("rank_ids") or ()), min_level=level, since=since, until=until)
