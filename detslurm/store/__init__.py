"""The state store: experiments, trials, runs, metrics, checkpoints, searcher state."""

from detslurm.store.db import Store, open_store
from detslurm.store.models import (
    Checkpoint,
    Experiment,
    ExperimentState,
    IngestOffset,
    LogEntry,
    Metric,
    MetricPoint,
    RunState,
    Trial,
    TrialRun,
    TrialState,
)

__all__ = [
    "Checkpoint",
    "Experiment",
    "ExperimentState",
    "IngestOffset",
    "LogEntry",
    "Metric",
    "MetricPoint",
    "RunState",
    "Store",
    "Trial",
    "TrialRun",
    "TrialState",
    "open_store",
]
