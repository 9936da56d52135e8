"""Trial events: one typed, versioned record per event type, one encoder, one decoder.

The trial appends records to its event files (``RunPaths.event_file``) with :func:`encode`;
the controller turns each line back into a record with :func:`decode`, which checks every
field's type and range and raises :class:`BadEvent` for anything else. A line is untrusted
input: the decoder is the only thing standing between it and the store.
"""

from __future__ import annotations

import enum
import json
import re
import time as _time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from detslurm.protocol import _check as c
from detslurm.protocol._check import BadRecord

# Bumped only for a change an older controller would misread; adding an optional field is not one.
VERSION = 1
MAX_GROUP = 64  # Metric.group is String(64) in the store


class BadEvent(BadRecord):
    """An event line the controller will not apply (quarantined with a note)."""


class UnknownEvent(BadEvent):
    """A well-formed line whose type this controller does not know (a newer writer?)."""


class EventType(enum.Enum):
    METRICS = "metrics"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_DELETED = "checkpoint_deleted"
    PROGRESS = "progress"
    STATUS = "status"
    PREEMPT_ACK = "preempt_ack"
    EARLY_EXIT = "early_exit"
    OP_COMPLETED = "op_completed"
    ALERT = "alert"
    RUN_METADATA = "run_metadata"


def _now() -> float:
    return _time.time()


# kw_only: the common `time` field has a default, and fields are always named in the encoding.
@dataclass(frozen=True, kw_only=True)
class _Event:
    TYPE: ClassVar[EventType]
    # When the trial reported it (the compute node's clock); stamped by the writer.
    time: float = field(default_factory=_now)


@dataclass(frozen=True, kw_only=True)
class Metrics(_Event):
    TYPE = EventType.METRICS
    group: str
    steps_completed: int
    metrics: dict[str, Any]
    batch_metrics: list[Any] | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointSaved(_Event):
    TYPE = EventType.CHECKPOINT
    uuid: str
    steps_completed: int
    storage_path: str
    metadata: dict[str, Any]
    resources: dict[str, int]
    size: int


@dataclass(frozen=True, kw_only=True)
class CheckpointDeleted(_Event):
    TYPE = EventType.CHECKPOINT_DELETED
    uuid: str


@dataclass(frozen=True, kw_only=True)
class Progress(_Event):
    TYPE = EventType.PROGRESS
    progress: float
    raw: float | None = None  # an op's raw length, for 0.37-style searcher operations


@dataclass(frozen=True, kw_only=True)
class Status(_Event):
    TYPE = EventType.STATUS
    state: str


@dataclass(frozen=True, kw_only=True)
class PreemptAck(_Event):
    TYPE = EventType.PREEMPT_ACK
    # When Slurm's signal (SIGTERM or the warning signal) reached the trial, on the compute
    # node's clock like ``time``; None for a stop asked through the control file. The controller
    # measures the trial's stop time from it (signal -> acknowledged checkpoint, docs/design/preemption.md).
    signal_time: float | None = None


@dataclass(frozen=True, kw_only=True)
class EarlyExit(_Event):
    TYPE = EventType.EARLY_EXIT
    reason: str  # an EarlyExitReason name, e.g. INVALID_HP


@dataclass(frozen=True, kw_only=True)
class OpCompleted(_Event):
    TYPE = EventType.OP_COMPLETED
    index: int
    length: int
    metric: float  # may be NaN: a diverged trial still completes its operation


@dataclass(frozen=True, kw_only=True)
class Alert(_Event):
    TYPE = EventType.ALERT
    title: str
    description: str
    level: str


@dataclass(frozen=True, kw_only=True)
class RunMetadata(_Event):
    TYPE = EventType.RUN_METADATA
    metadata: dict[str, Any]


Event = Union[
    Metrics,
    CheckpointSaved,
    CheckpointDeleted,
    Progress,
    Status,
    PreemptAck,
    EarlyExit,
    OpCompleted,
    Alert,
    RunMetadata,
]


# -- encoding (the trial side) -------------------------------------------------------------
def to_dict(ev: Event) -> dict[str, Any]:
    """The record as the JSON object written to the event file (``type`` and ``v`` first)."""
    # `type` and `v` lead each line, so a human grepping an event file sees them first.
    out: dict[str, Any] = {"type": ev.TYPE.value, "v": VERSION}
    # Optional fields left at None are omitted: lines stay short, and decode() restores None.
    out.update(
        {k: v for k, v in ev.__dict__.items() if not (k in ("raw", "batch_metrics", "signal_time") and v is None)}
    )
    return out


def encode(ev: Event, default: Callable[[Any], Any] | None = None) -> str:
    """One line (newline included). ``default`` converts values json cannot (numpy scalars).
    NaN is written as ``NaN``: Python's json reads it back, and the controller sanitizes it."""
    return json.dumps(to_dict(ev), default=default, allow_nan=True) + "\n"


# -- decoding (the controller side) --------------------------------------------------------
# One decoder per type. Each reads only the fields it knows (a newer writer may add more) and
# checks each one; a missing optional field gets the writer's default.
def _metrics(d: dict[str, Any]) -> Metrics:
    # The common report, accepted in one condition (ingest decodes ~100k of them a second): the
    # same checks as below, which alone name what is wrong when any of these fails.
    group, steps, metrics, t = d.get("group"), d.get("steps_completed"), d.get("metrics"), d.get("time")
    if (
        type(group) is str
        and 0 < len(group) <= MAX_GROUP
        and "\x00" not in group
        and type(steps) is int
        and 0 <= steps <= c.INT64_MAX
        and type(metrics) is dict
        and c.flat_ok(metrics)
        and d.get("batch_metrics") is None
        and type(t) is float
        and 0 <= t < 1e11
    ):
        return Metrics(group=group, steps_completed=steps, metrics=metrics, time=t)
    return _metrics_checked(d)


def _metrics_checked(d: dict[str, Any]) -> Metrics:
    group = c.text(c.req(d, "group"), "group", MAX_GROUP)
    if not group:
        raise BadEvent("'group' is empty")
    batch = d.get("batch_metrics")
    if batch is not None and not isinstance(batch, list):
        raise BadEvent(f"'batch_metrics' must be a list, got {type(batch).__name__}")
    return Metrics(
        group=group,
        steps_completed=c.integer(c.req(d, "steps_completed"), "steps_completed"),
        metrics=c.mapping(c.req(d, "metrics"), "metrics"),
        batch_metrics=None if batch is None else c.json_tree(batch, "batch_metrics"),
        time=_time_of(d),
    )


def _checkpoint(d: dict[str, Any]) -> CheckpointSaved:
    # The uuid names a directory below the storage base that GC later deletes: it must not be
    # able to point anywhere else (no "/", no "..").
    resources = c.mapping(d.get("resources", {}), "resources")
    for k, v in resources.items():
        c.integer(v, f"resources[{k[:64]!r}]")
    return CheckpointSaved(
        uuid=c.uuid(c.req(d, "uuid")),
        steps_completed=c.integer(c.req(d, "steps_completed"), "steps_completed"),
        storage_path=c.text(d.get("storage_path", ""), "storage_path"),
        metadata=c.mapping(d.get("metadata", {}), "metadata"),
        resources=resources,
        size=c.integer(d.get("size", 0), "size"),
        time=_time_of(d),
    )


def _progress(d: dict[str, Any]) -> Progress:
    # Trial.progress is shown as a percentage and fed to the experiment's progress.
    p = c.number(c.req(d, "progress"), "progress")
    if not 0.0 <= p <= 1.0:
        raise BadEvent(f"'progress' must be between 0 and 1, got {p}")
    raw = d.get("raw")
    return Progress(progress=p, raw=None if raw is None else c.number(raw, "raw"), time=_time_of(d))


def _op_completed(d: dict[str, Any]) -> OpCompleted:
    return OpCompleted(
        index=c.integer(c.req(d, "index"), "index", hi=c.INT32_MAX - 1),
        length=c.integer(c.req(d, "length"), "length"),
        metric=c.number(c.req(d, "metric"), "metric", allow_nonfinite=True),
        time=_time_of(d),
    )


def _alert(d: dict[str, Any]) -> Alert:
    return Alert(
        title=c.text(d.get("title", ""), "title"),
        description=c.text(d.get("description", ""), "description"),
        level=c.text(d.get("level", "warn"), "level", 16),
        time=_time_of(d),
    )


_DECODERS: dict[EventType, Callable[[dict[str, Any]], Event]] = {
    EventType.METRICS: _metrics,
    EventType.CHECKPOINT: _checkpoint,
    EventType.CHECKPOINT_DELETED: lambda d: CheckpointDeleted(uuid=c.uuid(c.req(d, "uuid")), time=_time_of(d)),
    EventType.PROGRESS: _progress,
    EventType.STATUS: lambda d: Status(state=c.text(c.req(d, "state"), "state"), time=_time_of(d)),
    EventType.PREEMPT_ACK: lambda d: PreemptAck(time=_time_of(d), signal_time=_opt_time(d, "signal_time")),
    EventType.EARLY_EXIT: lambda d: EarlyExit(reason=c.text(c.req(d, "reason"), "reason", 64), time=_time_of(d)),
    EventType.OP_COMPLETED: _op_completed,
    EventType.ALERT: _alert,
    EventType.RUN_METADATA: lambda d: RunMetadata(
        metadata=c.mapping(c.req(d, "metadata"), "metadata"), time=_time_of(d)
    ),
}
_TYPES = {t.value: t for t in EventType}


def _time_of(d: dict[str, Any]) -> float:
    # The trial's clock: within datetime's range, or the report is dated "now" on ingest.
    value = _opt_time(d, "time")
    return _now() if value is None else value


def _opt_time(d: dict[str, Any], key: str) -> float | None:
    t = d.get(key)
    if t is None:
        return None
    value = c.number(t, key)
    if not 0 <= value < 1e11:
        raise BadEvent(f"'{key}' {value} is not a timestamp")
    return value


# What may put a lone surrogate into a parsed line: a surrogate itself (bytes read with
# "surrogatepass", as json.loads reads them) or a \uD800-\uDFFF escape. A pair of them (an
# emoji written as two escapes) is one character and fine: only a match is checked further.
_SURROGATE_HINT = re.compile(r"[\ud800-\udfff]|\\u[dD][89abcdefABCDEF]")


def decode(line: bytes | str) -> Event:
    """One event line -> its record. Raises :class:`BadEvent` (or :class:`UnknownEvent`) and
    nothing else, whatever the line holds."""
    try:
        # Decoded here as json.loads decodes bytes (UTF-8, -16 or -32 by detection), so that
        # the text can be checked below.
        if isinstance(line, bytes):
            line = line.decode(json.detect_encoding(line), "surrogatepass")
        obj = json.loads(line)  # RecursionError comes from "[[[[..." lines
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise BadEvent(f"not JSON: {str(e)[:120]}") from None
    # The regex only where a surrogate can be at all: an escape, or a character beyond ASCII.
    if ("\\u" in line or not line.isascii()) and _SURROGATE_HINT.search(line) and _has_lone_surrogate(obj):
        # No UTF-8 (so neither a TensorBoard tag nor PostgreSQL text) can hold one: the store
        # would fail on it later, outside any single event's reach.
        raise BadEvent("a string holds a lone surrogate (not valid Unicode text)")
    return decode_value(obj)


def _has_lone_surrogate(obj: Any) -> bool:
    todo = [obj]  # a stack, not recursion: json.loads allows deeper nesting than the stack
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return False


def decode_value(obj: Any) -> Event:
    """A parsed event line -> its record: :func:`decode` after its JSON parse (for a parser that
    reads the same JSON values). Raises :class:`BadEvent` (or :class:`UnknownEvent`) and nothing else."""
    if not isinstance(obj, dict):
        raise BadEvent(f"an event must be a JSON object, got {type(obj).__name__}")
    # A line from a newer writer could mean something else for the same field names: refuse it
    # rather than guess (it is quarantined with a note saying so).
    version = obj.get("v", VERSION)  # lines written before versioning are version 1
    if version != VERSION or isinstance(version, bool):
        raise BadEvent(f"unsupported event version {str(version)[:20]!r} (this controller reads {VERSION})")
    name = obj.get("type")
    typ = _TYPES.get(name) if isinstance(name, str) else None
    if typ is None:
        raise UnknownEvent(f"unknown event type {str(name)[:64]!r}")
    try:
        return _DECODERS[typ](obj)
    except BadRecord as e:
        raise BadEvent(f"{typ.value}: {e.reason}") from None
