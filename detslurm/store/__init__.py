"""The state store: experiments, trials, runs, metrics, checkpoints, searcher state.

The names below are loaded on first use (PEP 562): importing a light submodule such as
``detslurm.store.reads`` must not import SQLAlchemy (about 0.25 s), which the read commands
never need on a current SQLite store.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detslurm.store.db import Store as Store
    from detslurm.store.db import open_store as open_store
    from detslurm.store.models import Checkpoint as Checkpoint
    from detslurm.store.models import Experiment as Experiment
    from detslurm.store.models import ExperimentState as ExperimentState
    from detslurm.store.models import IngestOffset as IngestOffset
    from detslurm.store.models import LogEntry as LogEntry
    from detslurm.store.models import Metric as Metric
    from detslurm.store.models import MetricPoint as MetricPoint
    from detslurm.store.models import RunState as RunState
    from detslurm.store.models import Trial as Trial
    from detslurm.store.models import TrialRun as TrialRun
    from detslurm.store.models import TrialState as TrialState

# name -> the submodule that defines it
_HOMES = {"Store": "db", "open_store": "db"} | {
    name: "models"
    for name in (
        "Checkpoint",
        "Experiment",
        "ExperimentState",
        "IngestOffset",
        "LogEntry",
        "Metric",
        "MetricPoint",
        "RunState",
        "Trial",
        "TrialRun",
        "TrialState",
    )
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'detslurm.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"detslurm.store.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
