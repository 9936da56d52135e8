"""The small JSON files the two sides hand each other, as typed records.

Controller -> trial: the control file (preempt/stop requests), the searcher-ops file and the
experiment's best validation. Trial -> controller: the exit record (written by the launcher,
or by the batch shell for a Slurm job). Each has one encoder and one decoder; decoders read at
most ``MAX_RECORD_BYTES`` and turn anything malformed into :class:`BadRecord`.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detslurm.protocol import _check as c
from detslurm.protocol._check import BadRecord
from detslurm.util import atomic_write_json, open_regular

# Every record here is a few hundred bytes; anything larger was not written by us.
MAX_RECORD_BYTES = 64 * 1024
# The batch shell's printf format for the exit record (code, then job id). It is rendered into
# the sbatch script by render.py, so ExitRecord.decode and the shell cannot disagree.
BATCH_EXIT_PRINTF = '{"v": 1, "code": %d, "source": "batch", "job": "%s"}\\n'
# The same, written when the container runtime could not provide the run's image (fetch or start
# failed before any trial code ran): the controller ends the trial without retrying it, since
# the next run would fail the same way.
IMAGE_SOURCE = "image"
IMAGE_EXIT_PRINTF = '{"v": 1, "code": %d, "source": "image", "job": "%s"}\\n'


def read_record(path: Path) -> Any:
    """The JSON value in ``path``; None when the file does not exist. Bounded: a file larger
    than MAX_RECORD_BYTES, non-UTF-8 bytes or bad JSON raise BadRecord."""
    try:
        # O_NONBLOCK: a FIFO put where a record belongs (by a trial, or a link to one) must not
        # block the reader, which is the daemon serving every experiment; only files are read.
        # O_NOFOLLOW: the writers make no symlinks, and one would let a trial point us at any
        # file of the user's.
        opened = open_regular(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        if opened is None:
            raise BadRecord(f"{path.name} is not a regular file")
        with opened[0] as f:
            # One byte over the limit is enough to know the file is too large, without reading it.
            data = f.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise BadRecord(f"cannot read {path.name}: {why}") from None
    if len(data) > MAX_RECORD_BYTES:
        raise BadRecord(f"{path.name} is larger than {MAX_RECORD_BYTES} bytes")
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise BadRecord(f"{path.name} is not UTF-8 JSON: {str(e)[:120]}") from None


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRecord(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ExitRecord:
    """How a run's process tree ended. ``source`` is ``launcher`` or ``batch``."""

    code: int
    source: str = "launcher"
    job: str = ""
    start: float | None = None
    end: float | None = None

    def encode(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": 1, "code": self.code, "source": self.source}
        if self.job:
            out["job"] = self.job
        if self.start is not None:
            out["start"] = self.start
        if self.end is not None:
            out["end"] = self.end
        return out

    def write(self, path: Path) -> None:
        atomic_write_json(path, self.encode())

    @classmethod
    def decode(cls, value: Any) -> ExitRecord:
        d = _object(value, "the exit record")
        try:
            start, end = d.get("start"), d.get("end")
            return cls(
                # TrialRun.exit_code is a 32-bit column; shells report 0-255, signals as 128+N.
                code=c.integer(c.req(d, "code"), "code", lo=-(2**31), hi=c.INT32_MAX),
                source=c.text(d.get("source", "launcher"), "source", 16),
                job=c.text(d.get("job", ""), "job", 128),
                start=None if start is None else c.number(start, "start"),
                end=None if end is None else c.number(end, "end"),
            )
        except BadRecord as e:
            raise BadRecord(f"exit record: {e.reason}") from None

    @classmethod
    def read(cls, path: Path) -> ExitRecord | None:
        """None when there is no record yet; BadRecord when there is one we cannot use."""
        value = read_record(path)
        return None if value is None else cls.decode(value)


@dataclass(frozen=True)
class ExitOutcome:
    """What an executor needs from a run dir's exit record: the code if one is usable, and
    why not otherwise. Never raises, whatever the trial left in the file."""

    present: bool
    code: int | None = None
    problem: str | None = None
    source: str | None = None


def exit_outcome(path: Path) -> ExitOutcome:
    # An unusable record still says "the run ended": executors then fall back to what the
    # scheduler knows (sacct's code, or the launcher process's own exit status).
    try:
        record = ExitRecord.read(path)
    except BadRecord as e:
        return ExitOutcome(True, None, e.reason)
    return ExitOutcome(False) if record is None else ExitOutcome(True, record.code, source=record.source)


@dataclass(frozen=True)
class ControlRecord:
    """Controller -> trial: stop at the next preemption check, and why."""

    preempt: bool
    reason: str = "preempt"

    def encode(self) -> dict[str, Any]:
        return {"v": 1, "preempt": self.preempt, "reason": self.reason}

    def write(self, path: Path) -> None:
        atomic_write_json(path, self.encode())

    @classmethod
    def decode(cls, value: Any) -> ControlRecord:
        d = _object(value, "the control file")
        # Strict: "yes" or 1 would be a writer bug, and a wrong preemption is costly.
        preempt = d.get("preempt", False)
        if not isinstance(preempt, bool):
            raise BadRecord("control file: 'preempt' must be true or false")
        return cls(preempt=preempt, reason=c.text(d.get("reason", "preempt"), "reason", 64))

    @classmethod
    def read(cls, path: Path) -> ControlRecord | None:
        value = read_record(path)
        return None if value is None else cls.decode(value)


@dataclass(frozen=True)
class SearcherOps:
    """Controller -> trial: 0.37-style searcher operations (absolute lengths) handed out so
    far, how many the trial completed, and whether more may come."""

    ops: tuple[int, ...]
    completed: int = 0
    closed: bool = False
    idle_after: int = -1  # the trial is idle (waits for a promotion) after this many ops

    def encode(self) -> dict[str, Any]:
        return {
            "ops": list(self.ops),
            "completed": self.completed,
            "closed": self.closed,
            "idle_after": self.idle_after,
        }

    def write(self, path: Path) -> None:
        # Not fsynced: the controller rewrites it from the store whenever it differs.
        atomic_write_json(path, self.encode(), durable=False)

    @classmethod
    def decode(cls, value: Any) -> SearcherOps:
        d = _object(value, "the searcher ops file")
        ops = d.get("ops", [])
        if not isinstance(ops, list):
            raise BadRecord("searcher ops: 'ops' must be a list")
        return cls(
            ops=tuple(c.integer(x, "ops[]") for x in ops),
            completed=c.integer(d.get("completed", 0), "completed"),
            closed=bool(d.get("closed", False)),
            idle_after=c.integer(d.get("idle_after", -1), "idle_after", lo=-1),
        )

    @classmethod
    def read(cls, path: Path) -> SearcherOps | None:
        value = read_record(path)
        return None if value is None else cls.decode(value)


@dataclass(frozen=True)
class BestValidation:
    """Controller -> trial: the experiment's best searcher metric so far."""

    value: float | None

    def write(self, path: Path) -> None:
        atomic_write_json(path, {"value": self.value}, durable=False)

    @classmethod
    def read(cls, path: Path) -> BestValidation | None:
        value = read_record(path)
        if value is None:
            return None
        v = _object(value, "best validation").get("value")
        return cls(None if v is None else c.number(v, "value", allow_nonfinite=True))
