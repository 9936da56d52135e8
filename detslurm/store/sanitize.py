"""Make trial-written values storable in SQLite and PostgreSQL alike.

PostgreSQL rejects some values that SQLite stores without complaint, and a rejected row fails
the whole transaction (with ingest, the whole tick):

- ``NaN``/``Infinity`` in a JSON column: Python's json writes them, PostgreSQL's JSON parser
  refuses them. They are stored as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.
- a NUL character in a text column (and ``\\u0000`` in JSONB): removed.
- strings longer than their column: VARCHAR lengths are enforced. Metric groups are bounded
  (:data:`METRIC_GROUP_MAX`, refused beyond it), free text is cut.

Everything a trial writes should pass through these before it reaches a row: ``json_safe`` for
JSON columns, ``clean_text`` for text columns, ``metric_group`` for ``Metric.group``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# The width of Metric.group (models.py; migration 0002).
METRIC_GROUP_MAX = 256
# Bounds for values inside JSON columns: a metric is a number or a short string; anything far
# larger is a bug in the trial, and must not cost the store (or every reader) megabytes.
JSON_STR_MAX = 64 * 1024
JSON_DEPTH_MAX = 32
_TRUNCATED = "...[truncated]"


def _float(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def clean_text(value: str, limit: int | None = None) -> str:
    """``value`` without NUL characters, cut to ``limit`` characters (marked as cut) if given."""
    text = value.replace("\x00", "")
    if limit is not None and len(text) > limit:
        keep = max(limit - len(_TRUNCATED), 0)
        # The marker tells a reader the value was cut; slicing again keeps the result within
        # limit even when limit is shorter than the marker itself.
        text = (text[:keep] + _TRUNCATED)[:limit]
    return text


def json_safe(value: Any, *, max_str: int = JSON_STR_MAX, max_depth: int = JSON_DEPTH_MAX) -> Any:
    """A copy of ``value`` that every store's JSON column accepts.

    Non-finite floats become ``"NaN"``/``"Infinity"``/``"-Infinity"``; NUL characters are removed
    from strings and keys; keys become strings (as JSON would make them); tuples become lists;
    strings are cut to ``max_str`` characters; containers nested deeper than ``max_depth``
    become ``None``. Values json cannot represent at all (bytes, objects) become their ``repr``.
    """
    return _safe(value, max_str, max_depth)


def _safe(value: Any, max_str: int, depth: int) -> Any:
    # bool before int/float: bool is an int subclass and must stay a bool.
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return clean_text(value, max_str)
    # Depth is bounded so a deeply nested (or self-referencing) value cannot exhaust the
    # recursion limit of the process doing the ingest.
    if depth <= 0:
        return None
    if isinstance(value, Mapping):
        return {clean_text(str(k), max_str): _safe(v, max_str, depth - 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_safe(v, max_str, depth - 1) for v in value]
    # repr rather than an error: one odd value must not lose the rest of the trial's report.
    return clean_text(repr(value), max_str)


def metric_group(name: str) -> str:
    """A metric group name as stored: NUL removed; ValueError when longer than :data:`METRIC_GROUP_MAX`.

    Refused rather than cut, so two long names never merge into one group.
    """
    group = clean_text(name)
    if not group:
        raise ValueError("metric group name is empty")
    if len(group) > METRIC_GROUP_MAX:
        raise ValueError(f"metric group name has {len(group)} characters; at most {METRIC_GROUP_MAX} are allowed")
    return group
