"""Determined's Python SDK (``determined.experimental.client``) over detslurm's own store.

from determined.experimental import client
exp = client.get_experiment(3)
best = exp.list_checkpoints(max_results=1)[0]
path = best.download()

There is no master: ``login()`` and ``Determined()`` open the store named by the user's settings
(or the database URL given as ``master``, or a login node's store for ``ssh://user@login``, see
``_remote``) and see only the calling user's experiments, as every `det` command does. Reads
go through the one read layer (``detslurm.store.reads``); a change runs the code of its `det`
command: pause, activate, cancel and kill are `det e pause` and friends (cli/state_change.py:
Slurm is told at once, activate starts the daemon), labels and the rest controller/edit.py's.
Importing this module opens nothing: the default session is made on first use.

One module per object (their names start with ``_``: this package is Determined's ``client``
module, whose public names are compared with Determined's); every name is exported here.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

from detslurm.client._checkpoint import DEFAULT_DOWNLOAD_DIR, Checkpoint, CheckpointTrainingMetadata
from detslurm.client._determined import Client, Determined
from detslurm.client._enums import (
    CheckpointOrderBy,
    CheckpointSortBy,
    CheckpointState,
    DownloadMode,
    ExperimentOrderBy,
    ExperimentSortBy,
    ExperimentState,
    OrderBy,
    TrialOrderBy,
    TrialSortBy,
    TrialState,
)
from detslurm.client._experiment import Experiment, ExperimentReference
from detslurm.client._metrics import TrainingMetrics, TrialMetrics, ValidationMetrics
from detslurm.client._session import Session
from detslurm.client._trial import Trial, TrialReference

__all__ = [
    "DEFAULT_DOWNLOAD_DIR",
    "Checkpoint",
    "CheckpointOrderBy",
    "CheckpointSortBy",
    "CheckpointState",
    "CheckpointTrainingMetadata",
    "Client",
    "Determined",
    "DownloadMode",
    "Experiment",
    "ExperimentOrderBy",
    "ExperimentReference",
    "ExperimentSortBy",
    "ExperimentState",
    "OrderBy",
    "Session",
    "TrainingMetrics",
    "Trial",
    "TrialMetrics",
    "TrialOrderBy",
    "TrialReference",
    "TrialSortBy",
    "TrialState",
    "ValidationMetrics",
    "create_experiment",
    "get_checkpoint",
    "get_experiment",
    "get_trial",
    "iter_trials_metrics",
    "list_experiments",
    "login",
    "logout",
    "stream_trials_metrics",
    "stream_trials_training_metrics",
    "stream_trials_validation_metrics",
]


# The module-level functions share one client, made by login() or on first use, as Determined's.
_default: Determined | None = None


def login(
    master: Optional[str] = None,
    user: Optional[str] = None,
    password: Optional[str] = None,
    cert_path: Optional[str] = None,
    cert_name: Optional[str] = None,
    noverify: bool = False,
) -> None:
    """Choose the store the module's functions read (see :class:`Determined`)."""
    global _default
    _default = Determined(master, user, password, cert_path, cert_name, noverify)


def logout() -> None:
    global _default
    _default = None


def _client() -> Determined:
    global _default
    if _default is None:
        _default = Determined()
    return _default


def create_experiment(
    config: Union[str, pathlib.Path, dict[str, Any]],
    model_dir: Optional[str] = None,
    includes: Optional[Iterable[Union[str, pathlib.Path]]] = None,
    project_id: Optional[int] = None,
    template: Optional[str] = None,
) -> Experiment:
    """Create an experiment (see :meth:`Determined.create_experiment`)."""
    return _client().create_experiment(config, model_dir, includes, project_id, template)


def get_experiment(experiment_id: int) -> Experiment:
    return _client().get_experiment(experiment_id)


def get_trial(trial_id: int) -> Trial:
    return _client().get_trial(trial_id)


def get_checkpoint(uuid: str) -> Checkpoint:
    return _client().get_checkpoint(uuid)


def list_experiments(
    sort_by: Any = None,
    order_by: Optional[OrderBy] = None,
    experiment_ids: Optional[list[int]] = None,
    labels: Optional[list[str]] = None,
    users: Optional[list[str]] = None,
    states: Optional[list[ExperimentState]] = None,
    name: Optional[str] = None,
    project_id: Optional[int] = None,
) -> list[Experiment]:
    return _client().list_experiments(sort_by, order_by, experiment_ids, labels, users, states, name, project_id)


def iter_trials_metrics(trial_ids: list[int], group: str) -> Iterator[TrialMetrics]:
    return _client().iter_trials_metrics(trial_ids, group)


def stream_trials_metrics(trial_ids: list[int], group: str) -> Iterator[TrialMetrics]:
    return _client().stream_trials_metrics(trial_ids, group)


def stream_trials_training_metrics(trial_ids: list[int]) -> Iterator[TrialMetrics]:
    return _client().stream_trials_training_metrics(trial_ids)


def stream_trials_validation_metrics(trial_ids: list[int]) -> Iterator[TrialMetrics]:
    return _client().stream_trials_validation_metrics(trial_ids)
