"""Hyperparameter specs: validation (with paths) and normalisation.

A value that is not a mapping is a const; a mapping without ``type`` is a nested group.
"""

from __future__ import annotations

import numbers
from typing import Any

TYPES = ("const", "int", "double", "log", "categorical")
# The keys Determined's schema allows per type; anything else is reported as an unknown key.
_KEYS = {
    "const": {"type", "val"},
    "int": {"type", "minval", "maxval", "count"},
    "double": {"type", "minval", "maxval", "count"},
    "log": {"type", "minval", "maxval", "base", "count"},
    "categorical": {"type", "vals"},
}


# bool is an int subclass in Python, but YAML ``true`` is never a valid bound.
def _is_num(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_leaf(spec: dict[str, Any], where: str, grid: bool) -> list[str]:
    typ = spec.get("type")
    if typ not in TYPES:
        return [f"{where}.type: must be one of {', '.join(TYPES)}, got {typ!r}"]
    errors = [
        f"{where}: unknown key {k!r}; valid keys: {', '.join(sorted(_KEYS[typ]))}"
        for k in sorted(set(spec) - _KEYS[typ])
    ]
    if typ == "const":
        if "val" not in spec:
            errors.append(f"{where}: val is a required property")
        return errors
    if typ == "categorical":
        vals = spec.get("vals")
        if not isinstance(vals, list) or not vals:
            errors.append(f"{where}.vals: must be a non-empty list")
        return errors
    check = _is_int if typ == "int" else _is_num
    for k in ("minval", "maxval"):
        if k not in spec:
            errors.append(f"{where}: {k} is a required property")
        elif not check(spec[k]):
            errors.append(f"{where}.{k}: must be {'an integer' if typ == 'int' else 'a number'}, got {spec[k]!r}")
    # Only compared once both bounds are present and numeric, so one mistake gives one error line.
    # Equal bounds are rejected as in Determined; a fixed value is written as a const.
    if not errors and spec["minval"] >= spec["maxval"]:
        errors.append(f"{where}: minval must be less than maxval")
    if typ == "log":
        # The value is base**x, so a base <= 0 gives complex or undefined samples.
        base = spec.get("base", 10)
        if not _is_num(base) or base <= 0:
            errors.append(f"{where}.base: must be a number greater than 0, got {base!r}")
    if "count" in spec and (not _is_int(spec["count"]) or spec["count"] < 1):
        errors.append(f"{where}.count: must be an integer of at least 1, got {spec['count']!r}")
    # Grid search needs a count to place points on a continuous range (Determined's message).
    if grid and "count" not in spec:
        errors.append(f"{where}: grid search is in use but count was not provided")
    return errors


def check_hyperparameters(hps: dict[str, Any], where: str, grid: bool = False, only_grid: bool = False) -> list[str]:
    """Return error lines for a hyperparameter mapping (``only_grid``: just the grid rule)."""
    errors: list[str] = []
    for name, spec in hps.items():
        path = f"{where}.{name}"
        if not isinstance(name, str) or not name:
            errors.append(f"{where}: hyperparameter names must be non-empty strings, got {name!r}")
        elif isinstance(spec, dict) and "type" not in spec:
            # A mapping without ``type`` is a nested group (any depth), the shape trials receive in
            # DET_HPARAMS.
            errors.extend(check_hyperparameters(spec, path, grid, only_grid))
        elif isinstance(spec, dict):
            leaf = _check_leaf(spec, path, grid)
            if only_grid:
                leaf = [e for e in leaf if "grid search" in e]
            errors.extend(leaf)
    return errors


def normalize_hyperparameters(hps: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a checked spec so every leaf is a typed mapping (plain values become consts)."""
    out: dict[str, Any] = {}
    for name, spec in hps.items():
        if isinstance(spec, dict) and "type" not in spec:
            out[name] = normalize_hyperparameters(spec)
        elif isinstance(spec, dict):
            out[name] = dict(spec)
            if spec["type"] == "log":
                # Filled here so samplers and the stored config agree on Determined's default base.
                out[name].setdefault("base", 10.0)
        else:
            out[name] = {"type": "const", "val": spec}
    return out
