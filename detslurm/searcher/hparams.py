"""Sampling and grids over normalised hyperparameter specs (see expconf.hparams)."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any


def _is_leaf(spec: Any) -> bool:
    """A typed hparam; any other mapping is a nested group."""
    return isinstance(spec, dict) and "type" in spec


def sample(spec: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """One random draw; names visited in sorted order so a seed always gives the same draw."""
    out: dict[str, Any] = {}
    for name in sorted(spec):
        hp = spec[name]
        if not _is_leaf(hp):
            out[name] = sample(hp, rng)
            continue
        t = hp["type"]
        if t == "const":
            out[name] = hp["val"]
        elif t == "int":
            # Both bounds inclusive, as Determined's ``minval + Intn(max-min+1)``.
            out[name] = hp["minval"] + rng.randrange(hp["maxval"] - hp["minval"] + 1)
        elif t == "double":
            out[name] = rng.uniform(hp["minval"], hp["maxval"])
        elif t == "log":
            # minval/maxval are exponents: the sample is uniform in log space.
            out[name] = float(hp["base"]) ** rng.uniform(hp["minval"], hp["maxval"])
        elif t == "categorical":
            out[name] = hp["vals"][rng.randrange(len(hp["vals"]))]
    return out


def go_round(x: float) -> int:
    """Go's math.Round: halves away from zero (Python's round() goes to even)."""
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def axis(hp: dict[str, Any]) -> list[Any]:
    """The grid values of one typed hparam, placed as Determined's grid.go places them."""
    t = hp["type"]
    if t == "const":
        return [hp["val"]]
    if t == "categorical":
        return list(hp["vals"])
    lo, hi = hp["minval"], hp["maxval"]
    if t == "int":
        # More points than integers in the range would only repeat values.
        count = min(hp["count"], hi - lo + 1)
        if count == 1:
            return [go_round((lo + hi) / 2)]
        # Go rounding, not Python's, so grid points match Determined's for the same config.
        return [go_round(lo + i * (hi - lo) / (count - 1)) for i in range(count)]
    count = hp["count"]
    points = [(lo + hi) / 2] if count == 1 else [lo + i * (hi - lo) / (count - 1) for i in range(count)]
    if t == "log":
        return [float(hp["base"]) ** p for p in points]
    return points


def grid(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Cartesian product over axes in sorted-name order, the first axis outermost."""
    names = sorted(spec)
    # Unlike Determined, an empty spec yields one point ``{}`` (itertools.product of no axes), so a
    # grid search without hyperparameters runs one trial instead of none.
    axes = [grid(spec[n]) if not _is_leaf(spec[n]) else axis(spec[n]) for n in names]
    return [dict(zip(names, combo, strict=False)) for combo in itertools.product(*axes)]
