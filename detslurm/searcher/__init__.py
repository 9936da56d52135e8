"""Hyperparameter searchers: pure, seeded by ``reproducibility.experiment_seed``."""

from __future__ import annotations

from detslurm.expconf import ExperimentConfig
from detslurm.expconf.schema import AdaptiveASHASearcher, GridSearcher, RandomSearcher, SingleSearcher
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


def build(config: ExperimentConfig) -> SearchMethod:
    """The searcher of a validated experiment config."""
    sc = config.searcher
    hps = config.hyperparameters
    # One seed for the whole search, as in Determined: the same config and seed give the same trials.
    seed = config.top.reproducibility.experiment_seed
    # A legacy max_length (0.37 configs) becomes each trial's first ValidateAfter target; without it
    # the trial decides its own length, as in 0.38.
    ops: tuple[int, ...] = (sc.max_length.value,) if sc.max_length is not None else ()
    if isinstance(sc, SingleSearcher):
        # Determined implements single exactly this way (random.go).
        return RandomSearch(hps, seed, max_trials=1, max_concurrent=1, ops=ops, metric=sc.metric)
    if isinstance(sc, RandomSearcher):
        assert sc.max_trials is not None  # validation requires it
        return RandomSearch(hps, seed, sc.max_trials, sc.max_concurrent_trials, ops=ops, metric=sc.metric)
    if isinstance(sc, GridSearcher):
        return GridSearch(hps, seed, sc.max_concurrent_trials, ops=ops, metric=sc.metric)
    if isinstance(sc, AdaptiveASHASearcher):
        assert sc.max_trials is not None and sc.metric is not None  # validation requires both
        # max_length without max_time: Determined 0.37's promotion-based ASHA (searcher ops).
        promotion = sc.max_time is None and sc.max_length is not None
        return AdaptiveASHA(
            hps,
            seed,
            metric=sc.metric,
            smaller_is_better=sc.smaller_is_better,
            max_trials=sc.max_trials,
            # In 0.37 mode the rungs are measured in max_length units instead of time_metric units.
            max_time=int(sc.max_time or ops[0]),
            time_metric=sc.time_metric,
            divisor=sc.divisor,
            max_rungs_cfg=sc.max_rungs,
            mode=sc.mode,
            explicit_rungs=sc.bracket_rungs or None,
            max_concurrent=sc.max_concurrent_trials,
            promotion=promotion,
        )
    raise SearcherError(f"unknown searcher {sc!r}")
