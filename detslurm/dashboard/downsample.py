"""Curves small enough for a browser: each trial's series cut to a point budget on the server.

The store may hold a million points for one experiment; a browser drawing them all is slow and
the picture is no better than a few hundred points per curve. Points are grouped into buckets of
equal width along the step axis; each bucket keeps its mean (the line) and its min and max (the
band), so a spike is still visible after downsampling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The browser draws at most about this many points for one chart in total; a 1000-trial
# experiment then gets ~100 points per curve, one trial up to MAX_PER_SERIES.
TOTAL_POINT_BUDGET = 100_000
MAX_PER_SERIES = 1500
MIN_PER_SERIES = 50


def points_per_series(n_series: int) -> int:
    """How many points each of ``n_series`` curves may keep."""
    if n_series <= 0:
        return MAX_PER_SERIES
    return max(MIN_PER_SERIES, min(MAX_PER_SERIES, TOTAL_POINT_BUDGET // n_series))


def bucket_width(max_step: int, points: int) -> int:
    """Steps per bucket so that a series reaching ``max_step`` fits in ``points`` buckets."""
    return max(1, math.ceil((max_step + 1) / max(points, 1)))


@dataclass
class Series:
    """One trial's curve of one metric: parallel arrays, x in batches and in seconds since the
    trial's first report (the browser switches axes without asking again)."""

    trial_id: int
    batches: list[float]
    seconds: list[float]
    value: list[float]
    vmin: list[float]
    vmax: list[float]
    # Points in the store before downsampling (the page says "n of N points").
    raw_points: int


def bucketize(trial_id: int, rows: Sequence[tuple[int, float, float]], points: int) -> Series:
    """Downsample ``rows`` of (step, seconds, value), sorted by step, to at most ``points``
    buckets. Pure: the SQL path (:mod:`queries`) does the same grouping in the database."""
    out = Series(trial_id, [], [], [], [], [], raw_points=len(rows))
    if not rows:
        return out
    width = bucket_width(int(rows[-1][0]), points)
    current: int | None = None
    acc: list[tuple[int, float, float]] = []
    for row in rows:
        b = int(row[0]) // width
        if current is not None and b != current:
            _flush(out, acc)
            acc = []
        current = b
        acc.append(row)
    _flush(out, acc)
    return out


def _flush(out: Series, acc: list[tuple[int, float, float]]) -> None:
    vals = [v for _, _, v in acc]
    out.batches.append(sum(s for s, _, _ in acc) / len(acc))
    out.seconds.append(max(t for _, t, _ in acc))
    out.value.append(sum(vals) / len(vals))
    out.vmin.append(min(vals))
    out.vmax.append(max(vals))
