"""Hyperparameter searchers: pure, seeded by ``reproducibility.experiment_seed``."""

from __future__ import annotations

from typing import Any

from detslurm.searcher.asha import AdaptiveASHA
from detslurm.searcher.base import (
    EXIT_ERRORED,
    EXIT_INVALID_HP,
    EXIT_USER_CANCELED,
    Action,
    Close,
    Create,
    Idle,
    SearcherError,
    SearchMethod,
    Shutdown,
    Stop,
    ValidateAfter,
)
from detslurm.searcher.simple import GridSearch, RandomSearch

__all__ = [
    "EXIT_ERRORED",
    "EXIT_INVALID_HP",
    "EXIT_USER_CANCELED",
    "Action",
    "AdaptiveASHA",
    "Close",
    "Create",
    "GridSearch",
    "Idle",
    "RandomSearch",
    "SearchMethod",
    "SearcherError",
    "Shutdown",
    "Stop",
    "ValidateAfter",
    "build",
]


def build(config: dict[str, Any]) -> SearchMethod:
    """A searcher for a validated, defaults-filled experiment config dict."""
    sc = config["searcher"]
    hps = config["hyperparameters"]
    seed = int(config["reproducibility"]["experiment_seed"])
    ml = sc.get("max_length")
    ops: tuple[int, ...] = (int(next(iter(ml.values()))),) if ml else ()
    name = sc["name"]
    if name == "single":
        return RandomSearch(hps, seed, max_trials=1, max_concurrent=1, ops=ops)
    if name == "random":
        return RandomSearch(hps, seed, sc["max_trials"], sc["max_concurrent_trials"], ops=ops)
    if name == "grid":
        return GridSearch(hps, seed, sc["max_concurrent_trials"], ops=ops)
    if name == "adaptive_asha":
        promotion = sc.get("max_time") is None and ml is not None
        return AdaptiveASHA(
            hps,
            seed,
            metric=sc["metric"],
            smaller_is_better=sc["smaller_is_better"],
            max_trials=sc["max_trials"],
            max_time=int(sc["max_time"] or ops[0]),
            time_metric=sc.get("time_metric"),
            divisor=sc["divisor"],
            max_rungs_cfg=sc["max_rungs"],
            mode=sc["mode"],
            explicit_rungs=sc["bracket_rungs"] or None,
            max_concurrent=sc["max_concurrent_trials"],
            promotion=promotion,
        )
    raise SearcherError(f"unknown searcher {name!r}")
