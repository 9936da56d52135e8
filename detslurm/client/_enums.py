"""Determined's enums, with its values (code that stores or compares them keeps working), and
the orderings of the SDK's listings."""

from __future__ import annotations

import enum
from typing import Any


class OrderBy(enum.Enum):
    ASCENDING = "ORDER_BY_ASC"
    DESCENDING = "ORDER_BY_DESC"


class TrialOrderBy(enum.Enum):
    ASCENDING = "ORDER_BY_ASC"
    DESCENDING = "ORDER_BY_DESC"


class ExperimentOrderBy(enum.Enum):
    ASCENDING = "ORDER_BY_ASC"
    DESCENDING = "ORDER_BY_DESC"


class CheckpointOrderBy(enum.Enum):
    ASC = "ORDER_BY_ASC"
    DESC = "ORDER_BY_DESC"


class CheckpointSortBy(enum.Enum):
    UUID = "SORT_BY_UUID"
    TRIAL_ID = "SORT_BY_TRIAL_ID"
    BATCH_NUMBER = "SORT_BY_BATCH_NUMBER"
    END_TIME = "SORT_BY_END_TIME"
    STATE = "SORT_BY_STATE"
    SEARCHER_METRIC = "SORT_BY_SEARCHER_METRIC"


class TrialSortBy(enum.Enum):
    ID = "SORT_BY_ID"
    START_TIME = "SORT_BY_START_TIME"
    END_TIME = "SORT_BY_END_TIME"
    STATE = "SORT_BY_STATE"
    BEST_VALIDATION_METRIC = "SORT_BY_BEST_VALIDATION_METRIC"
    LATEST_VALIDATION_METRIC = "SORT_BY_LATEST_VALIDATION_METRIC"
    BATCHES_PROCESSED = "SORT_BY_BATCHES_PROCESSED"
    DURATION = "SORT_BY_DURATION"
    RESTARTS = "SORT_BY_RESTARTS"
    CHECKPOINT_SIZE = "SORT_BY_CHECKPOINT_SIZE"
    LOG_RETENTION_DAYS = "SORT_BY_LOG_RETENTION_DAYS"


# Determined's values are members of its API's enum: one of the same name and members keeps
# them equal for code that compares or prints them.
class _SortField(enum.Enum):
    ID = "SORT_BY_ID"
    DESCRIPTION = "SORT_BY_DESCRIPTION"
    START_TIME = "SORT_BY_START_TIME"
    END_TIME = "SORT_BY_END_TIME"
    STATE = "SORT_BY_STATE"
    NUM_TRIALS = "SORT_BY_NUM_TRIALS"
    PROGRESS = "SORT_BY_PROGRESS"
    USER = "SORT_BY_USER"
    NAME = "SORT_BY_NAME"
    FORKED_FROM = "SORT_BY_FORKED_FROM"
    RESOURCE_POOL = "SORT_BY_RESOURCE_POOL"
    PROJECT_ID = "SORT_BY_PROJECT_ID"
    CHECKPOINT_SIZE = "SORT_BY_CHECKPOINT_SIZE"
    CHECKPOINT_COUNT = "SORT_BY_CHECKPOINT_COUNT"
    SEARCHER_METRIC_VAL = "SORT_BY_SEARCHER_METRIC_VAL"


_SortField.__name__ = _SortField.__qualname__ = "v1GetExperimentsRequestSortBy"


class ExperimentSortBy(enum.Enum):
    ID = _SortField.ID
    DESCRIPTION = _SortField.DESCRIPTION
    START_TIME = _SortField.START_TIME
    END_TIME = _SortField.END_TIME
    STATE = _SortField.STATE
    NUM_TRIALS = _SortField.NUM_TRIALS
    PROGRESS = _SortField.PROGRESS
    USER = _SortField.USER
    NAME = _SortField.NAME
    FORKED_FROM = _SortField.FORKED_FROM
    RESOURCE_POOL = _SortField.RESOURCE_POOL
    PROJECT_ID = _SortField.PROJECT_ID
    CHECKPOINT_SIZE = _SortField.CHECKPOINT_SIZE
    CHECKPOINT_COUNT = _SortField.CHECKPOINT_COUNT
    SEARCHER_METRIC_VAL = _SortField.SEARCHER_METRIC_VAL


# The experiment dict's field each sortable ExperimentSortBy reads (Determined's server sorts
# by the others, which the store does not keep per experiment).
_EXPERIMENT_SORT_FIELD = {
    ExperimentSortBy.ID: "id",
    ExperimentSortBy.DESCRIPTION: "description",
    ExperimentSortBy.START_TIME: "start_time",
    ExperimentSortBy.END_TIME: "end_time",
    ExperimentSortBy.STATE: "state",
    ExperimentSortBy.PROGRESS: "progress",
    ExperimentSortBy.USER: "owner",
    ExperimentSortBy.NAME: "name",
    ExperimentSortBy.FORKED_FROM: "parent_id",
    ExperimentSortBy.RESOURCE_POOL: "resource_pool",
}


def _sorted_experiments(rows: list[dict[str, Any]], sort_by: Any, descending: bool) -> list[dict[str, Any]]:
    """``rows`` ordered by ``sort_by`` (ties by id); a missing value (an experiment not ended
    yet) after all others either way, as Determined lists experiments without an end time."""
    try:
        field = _EXPERIMENT_SORT_FIELD[ExperimentSortBy(sort_by)]
    except (ValueError, KeyError):
        sortable = ", ".join(k.name for k in _EXPERIMENT_SORT_FIELD)
        raise ValueError(
            f"list_experiments(): cannot sort by {sort_by!r} here; sort_by may be one of {sortable}"
        ) from None

    def key(d: dict[str, Any]) -> tuple[Any, int]:
        return getattr(d[field], "value", d[field]), d["id"]

    present = sorted((d for d in rows if d[field] is not None), key=key, reverse=descending)
    return present + [d for d in rows if d[field] is None]


class CheckpointState(enum.Enum):
    ACTIVE = "STATE_ACTIVE"
    COMPLETED = "STATE_COMPLETED"
    ERROR = "STATE_ERROR"
    DELETED = "STATE_DELETED"
    PARTIALLY_DELETED = "STATE_PARTIALLY_DELETED"


class ExperimentState(enum.Enum):
    ACTIVE = "STATE_ACTIVE"
    PAUSED = "STATE_PAUSED"
    STOPPING_COMPLETED = "STATE_STOPPING_COMPLETED"
    STOPPING_CANCELED = "STATE_STOPPING_CANCELED"
    STOPPING_ERROR = "STATE_STOPPING_ERROR"
    COMPLETED = "STATE_COMPLETED"
    CANCELED = "STATE_CANCELED"
    ERROR = "STATE_ERROR"
    DELETED = "STATE_DELETED"
    DELETING = "STATE_DELETING"
    DELETE_FAILED = "STATE_DELETE_FAILED"
    STOPPING_KILLED = "STATE_STOPPING_KILLED"
    QUEUED = "STATE_QUEUED"
    PULLING = "STATE_PULLING"
    STARTING = "STATE_STARTING"
    RUNNING = "STATE_RUNNING"


class TrialState(enum.Enum):
    ACTIVE = "STATE_ACTIVE"
    PAUSED = "STATE_PAUSED"
    STOPPING_CANCELED = "STATE_STOPPING_CANCELED"
    STOPPING_KILLED = "STATE_STOPPING_KILLED"
    STOPPING_COMPLETED = "STATE_STOPPING_COMPLETED"
    STOPPING_ERROR = "STATE_STOPPING_ERROR"
    CANCELED = "STATE_CANCELED"
    COMPLETED = "STATE_COMPLETED"
    ERROR = "STATE_ERROR"
    QUEUED = "STATE_QUEUED"
    PULLING = "STATE_PULLING"
    STARTING = "STATE_STARTING"
    RUNNING = "STATE_RUNNING"


class DownloadMode(enum.Enum):
    # Determined's choices of route to the files; on a shared filesystem there is one: a copy.
    AUTO = "auto"
    DIRECT = "direct"
    MASTER = "master"


def _state(enum_cls: type[enum.Enum], stored: Any) -> Any:
    """The store's state (``ACTIVE``...) as Determined's enum member (``STATE_ACTIVE``)."""
    return enum_cls(f"STATE_{getattr(stored, 'value', stored)}")


def _descending(order_by: Any) -> bool:
    return str(getattr(order_by, "value", order_by)) == "ORDER_BY_DESC"
