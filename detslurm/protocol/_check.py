"""Field checks for records a trial wrote: every failure is a :class:`BadRecord` naming the
field and why, never a KeyError/TypeError/ValueError escaping to the controller."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

MAX_TEXT = 4096  # free text: alert titles, status strings, storage paths
MAX_KEY = 256  # a metric's or a metadata entry's name
MAX_DEPTH = 32  # nesting of metadata / batch metrics
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
# A checkpoint id becomes a directory name below the storage base: no separators, no dot dirs.
UUID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


class BadRecord(ValueError):
    """A record that does not follow the protocol; ``reason`` says which field and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def req(obj: Mapping[str, Any], key: str) -> Any:
    if key not in obj:
        raise BadRecord(f"{key!r} is missing")
    return obj[key]


# Ranges default to what a BigInteger column holds: neither SQLite nor PostgreSQL takes a
# larger int, and the error would fail the whole transaction, not just this record.
def integer(value: Any, key: str, lo: int = 0, hi: int = INT64_MAX) -> int:
    # bool is an int subclass: `true` is not a step count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRecord(f"{key!r} must be an integer, got {_kind(value)}")
    if not lo <= value <= hi:
        raise BadRecord(f"{key!r} must be between {lo} and {hi}, got {value}")
    return value


def number(value: Any, key: str, allow_nonfinite: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRecord(f"{key!r} must be a number, got {_kind(value)}")
    out = float(value)  # an int is fine where a float is expected (`1` for `1.0`)
    if not allow_nonfinite and not math.isfinite(out):
        raise BadRecord(f"{key!r} must be a finite number, got {out}")
    return out


def text(value: Any, key: str, max_len: int = MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise BadRecord(f"{key!r} must be a string, got {_kind(value)}")
    if len(value) > max_len:
        raise BadRecord(f"{key!r} is longer than {max_len} characters")
    if "\x00" in value:
        # PostgreSQL text cannot hold NUL, and no legitimate writer produces one.
        raise BadRecord(f"{key!r} contains a NUL character")
    _unicode(value, key)
    return value


def _unicode(value: str, key: str) -> None:
    # A lone surrogate ("\ud800" in JSON) is no text UTF-8 can hold: the store (and PostgreSQL)
    # would fail on it later, outside this one record's reach.
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRecord(f"{key!r} holds a lone surrogate (not valid Unicode text)") from None


def uuid(value: Any, key: str = "uuid") -> str:
    s = text(value, key, 64)
    if not UUID_RE.fullmatch(s) or s in (".", ".."):
        raise BadRecord(f"{key!r} {s[:64]!r} is not a checkpoint id ([A-Za-z0-9._-]{{1,64}}, not . or ..)")
    return s


def json_tree(value: Any, key: str, depth: int = 0) -> Any:
    """A JSON value whose strings hold no NUL and whose dict keys are bounded strings.
    Non-finite floats pass (a diverged loss is a legitimate report); the store sanitizes them."""
    if depth > MAX_DEPTH:
        raise BadRecord(f"{key!r} is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for k, v in value.items():
            text(k, f"{key} key", MAX_KEY)
            json_tree(v, key, depth + 1)
    elif isinstance(value, list):
        for v in value:
            json_tree(v, key, depth + 1)
    elif isinstance(value, str):
        if "\x00" in value:
            raise BadRecord(f"{key!r} contains a NUL character")
        _unicode(value, key)
    elif value is not None and not isinstance(value, (bool, int, float)):
        raise BadRecord(f"{key!r} holds a {_kind(value)}")
    return value


def mapping(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRecord(f"{key!r} must be an object, got {_kind(value)}")
    if flat_ok(value):
        return value
    out: dict[str, Any] = json_tree(value, key)
    return out


def flat_ok(value: dict[Any, Any]) -> bool:
    """Whether ``json_tree`` would accept ``value`` at once: a flat object of scalars with short
    string keys and no NUL (a metrics report). One loop instead of a call per key and value;
    anything else takes ``json_tree``'s walk, which names the problem."""
    for k, v in value.items():
        if type(k) is not str or len(k) > MAX_KEY or "\x00" in k or not k.isascii():
            return False
        t = type(v)
        if t is str:
            if "\x00" in v or not v.isascii():  # json_tree checks such text whole
                return False
        elif t is not float and t is not int and t is not bool and v is not None:
            return False
    return True


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"a string {value[:40]!r}"
    return type(value).__name__
