"""Determined's Python SDK (``determined.experimental.client``) over detslurm's own store.

from determined.experimental import client
exp = client.get_experiment(3)
best = exp.list_checkpoints(max_results=1)[0]
path = best.download()

There is no master: ``login()`` and ``Determined()`` open the store named by the user's settings
(or the database URL given as ``master``) and see only the calling user's experiments, as every
`det` command does. Reads go through the one read layer (``detslurm.store.reads``); a state
change (pause, kill, labels...) changes the experiment's row through the same controller
operations as `det e pause` and friends, and the owner's daemon (or local driver) carries it out.
Importing this module opens nothing: the default session is made on first use.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from detslurm import settings
from detslurm.errors import DetSlurmError, NotFoundError, StateError
from detslurm.expconf.view import ConfigView
from detslurm.identity import Scope

if TYPE_CHECKING:
    from detslurm.store import Store
    from detslurm.store.reads import Reads

log = logging.getLogger("detslurm.client")

# Where `download()` puts a checkpoint when no path is given: ./checkpoints/<uuid>.
DEFAULT_DOWNLOAD_DIR = Path("checkpoints")


# -- Determined's enums (its values, so code that stores or compares them keeps working) ----------
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


# -- metrics ----------------------------------------------------------------------------------
@dataclasses.dataclass
class TrialMetrics:
    """One metrics report of a trial, as Determined's SDK returns it."""

    trial_id: int
    trial_run_id: int
    steps_completed: int
    end_time: Optional[datetime]
    metrics: dict[str, Any]
    group: str
    batch_metrics: Optional[list[dict[str, Any]]] = None

    @property
    def total_batches(self) -> int:  # Determined's older name for steps_completed
        return self.steps_completed


class TrainingMetrics(TrialMetrics):
    """Deprecated in Determined (``TrialMetrics`` with group "training"); kept for old code."""

    def __init__(self, total_batches: Optional[int] = None, **kwargs: Any) -> None:
        kwargs.setdefault("steps_completed", total_batches)
        super().__init__(**{"group": "training", **kwargs})


class ValidationMetrics(TrialMetrics):
    """Deprecated in Determined (``TrialMetrics`` with group "validation"); kept for old code."""

    def __init__(self, total_batches: Optional[int] = None, **kwargs: Any) -> None:
        kwargs.setdefault("steps_completed", total_batches)
        super().__init__(**{"group": "validation", **kwargs})


# -- the session: the store as one user sees it ------------------------------------------------
class Session:
    """What the SDK's objects read and change through: the store (``db_url``, default the user's
    settings) limited to ``scope`` (default the calling user's own experiments)."""

    def __init__(self, db_url: str | None = None, scope: Scope | None = None, store: Store | None = None) -> None:
        self._url = db_url
        self._store = store
        self._reads: Reads | None = None
        self.scope = scope or Scope.mine()

    @property
    def owner(self) -> str | None:
        return self.scope.owner

    @property
    def store(self) -> Store:
        """The ORM store, for state changes (created or migrated on first use)."""
        if self._store is None:
            from detslurm.store import open_store

            self._store = open_store(self._url or settings.load().db_url)
        return self._store

    @property
    def reads(self) -> Reads:
        if self._reads is None:
            from detslurm.store.reads import Reads

            if self._store is not None:
                self._reads = Reads.of_store(self._store)
            else:
                url = self._url or settings.load().db_url
                self._reads = Reads.open_sqlite(url) or Reads.of_store(self.store)
        return self._reads


# -- checkpoints --------------------------------------------------------------------------------
class CheckpointTrainingMetadata:
    """Where a checkpoint came from (Determined's ``checkpoint.training``)."""

    def __init__(self, info: dict[str, Any], hparams: dict[str, Any], validation: dict[str, Any] | None) -> None:
        self.experiment_id: int = info["experiment_id"]
        self.trial_id: int = info["trial_id"]
        self.hparams = hparams
        self.validation_metrics = {"avgMetrics": validation or {}}
        self.searcher_metric: float | None = info.get("validation_metric")


class Checkpoint:
    """A checkpoint in the store; its files are ``<storage base>/<uuid>`` on the shared filesystem."""

    def __init__(self, session: Session, uuid: str) -> None:
        self._session = session
        self.uuid = uuid
        self.reload()

    def reload(self) -> None:
        info = self._session.reads.checkpoint(self.uuid, self._session.owner)
        # The store's dict of it, as `det c list` shows it (the CLI prints its row from this).
        self.info = info
        self.metadata: dict[str, Any] = info["metadata"]
        self.state = _state(CheckpointState, info["state"])
        self.resources: dict[str, int] = info["resources"]
        self.report_time: datetime | None = info["report_time"]
        self.steps_completed: int = info["steps_completed"]
        self.trial_id: int = info["trial_id"]
        self.experiment_id: int = info["experiment_id"]
        self.searcher_metric: float | None = info["validation_metric"]

    @property
    def training(self) -> CheckpointTrainingMetadata:
        trial = self._session.reads.trial(self.trial_id, self._session.owner)
        validation = next(
            (
                m["metrics"]
                for m in self._session.reads.metrics(self.trial_id)
                if m["group"] == "validation" and m["steps_completed"] == self.steps_completed
            ),
            None,
        )
        return CheckpointTrainingMetadata(self.info, trial["hparams"], validation)

    def _source(self) -> Path | None:
        """``<storage base>/<uuid>``, from the experiment's stored config: the path the trial
        reported is never copied from (it could name any directory of the user's)."""
        from detslurm.controller.gc import valid_checkpoint_uuid
        from detslurm.expconf import from_stored

        if not valid_checkpoint_uuid(self.uuid):
            return None
        _, config = self._session.reads.experiment(self.experiment_id, self._session.owner)
        base = from_stored(config, f"<experiment {self.experiment_id}>").storage_base
        return Path(base).resolve() / self.uuid

    def download(self, path: Union[str, Path, None] = None, mode: DownloadMode = DownloadMode.AUTO) -> str:
        """Copy the checkpoint to ``path`` (default ``./checkpoints/<uuid>``), a new or empty
        directory; the path written. Every ``mode`` is a plain copy: the files are on a shared
        filesystem."""
        from detslurm.download_dir import fresh_download_dir

        DownloadMode(mode)
        src = self.checked_source()
        dst = Path(path) if path is not None else _default_destination(self.uuid)
        # symlinks=True: a link the trial left in its checkpoint is copied as a link, never
        # followed to read (and copy out) whatever file it names. A fresh dir: never through a
        # link an earlier download left.
        with fresh_download_dir(dst) as tmp:
            shutil.copytree(src, tmp, symlinks=True, dirs_exist_ok=True, ignore=_without_mark(src))
        return str(dst)

    def checked_source(self) -> Path:
        """The checkpoint's own directory, ``<storage base>/<uuid>``, once checked: a COMPLETED
        checkpoint, a valid uuid, a real directory (no link in its place). What a download, here
        or on a laptop over SSH, copies from."""
        from detslurm.controller.gc import valid_checkpoint_uuid

        # The uuid is a value the trial reported: checked again because it becomes a directory
        # name on the caller's machine (a "../x" uuid would write outside checkpoints/).
        if not valid_checkpoint_uuid(self.uuid):
            raise DetSlurmError(
                f"checkpoint uuid {self.uuid!r} is not a valid checkpoint id (letters, digits, '.', '_', '-'; "
                "no path separators); refusing to use it as a directory name"
            )
        # A partial or deleted checkpoint's files are missing or half written.
        if self.state != CheckpointState.COMPLETED:
            raise StateError(
                f"checkpoint {self.uuid} is {self.state.name}; only COMPLETED checkpoints can be downloaded"
            )
        src = self._source()
        # is_symlink: a link in the checkpoint's place (to another experiment's, say) is not it.
        if src is None or src.is_symlink() or not src.is_dir():
            raise NotFoundError("checkpoint files for", self.uuid)
        return src

    def get_metrics(self, group: Optional[str] = None) -> Iterator[TrialMetrics]:
        """The metrics its trial reported up to this checkpoint's step (``group`` only, if given)."""
        for m in _trial_metrics(self._session, self.trial_id, group):
            if m.steps_completed <= self.steps_completed:
                yield m

    # -- changing (the owner's, as `det checkpoint delete` / `rm`) -----------------------------
    def add_metadata(self, metadata: dict[str, Any]) -> None:
        """Top-level keys of ``metadata`` set in the stored checkpoint's metadata (replacing
        those already there). As in Determined, the checkpoint's files are not changed."""
        if not isinstance(metadata, dict):
            raise TypeError(f"add_metadata() takes a dict, not {type(metadata).__name__}")
        self._set_metadata({**self.metadata, **metadata})

    def remove_metadata(self, keys: list[str]) -> None:
        """These top-level keys removed from the stored checkpoint's metadata (absent ones are
        ignored). As in Determined, the checkpoint's files are not changed."""
        if isinstance(keys, str):
            raise TypeError("remove_metadata() takes a list of keys, not one string")
        self._set_metadata({k: v for k, v in self.metadata.items() if k not in set(keys)})

    def _set_metadata(self, metadata: dict[str, Any]) -> None:
        import json

        from detslurm.identity import os_user
        from detslurm.store.models import Trial as TrialRow
        from detslurm.views import get_checkpoint

        try:
            stored = json.loads(json.dumps(metadata))
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint {self.uuid}: the metadata must be JSON-serializable ({e})") from None
        with self._session.store.tx() as s:
            ck = get_checkpoint(s, self.uuid, self._session.scope)
            trial = s.get(TrialRow, ck.trial_id)
            if trial is None or trial.experiment.owner != os_user():
                raise StateError(f"checkpoint {self.uuid} is not yours; only its owner can change its metadata")
            ck.metadata_ = stored
        self.metadata = stored

    def delete(self) -> None:
        """Delete the checkpoint's files; its row stays, DELETED (as `det checkpoint delete`)."""
        from detslurm.controller import ckpt_ops

        ckpt_ops.delete_checkpoints(self._session.store, [self.uuid], self._session.scope)
        self.reload()

    def remove_files(self, globs: list[str]) -> None:
        """Remove the checkpoint's files matching any of ``globs`` (relative to its top); it is
        then PARTIALLY_DELETED, or DELETED when nothing is left (as `det checkpoint rm`)."""
        from detslurm.controller import ckpt_ops

        if isinstance(globs, str):
            raise TypeError("remove_files() takes a list of glob patterns, not one string")
        ckpt_ops.remove_files(self._session.store, [self.uuid], list(globs), self._session.scope)
        self.reload()

    def write_metadata_file(self, path: str) -> None:
        """The checkpoint's metadata as JSON in the file ``path``."""
        import json

        Path(path).write_text(json.dumps(self.metadata, indent=2, sort_keys=True))

    def __repr__(self) -> str:
        return f"Checkpoint(uuid={self.uuid})"


def _without_mark(top: Path) -> Callable[[str, list[str]], list[str]]:
    """A copytree ``ignore`` leaving out the delete mark at the checkpoint's top
    (protocol/ckmark.py): it is the run's, not one of the checkpoint's files."""
    from detslurm.protocol.ckmark import MARKER_NAME

    return lambda d, names: [MARKER_NAME] if Path(d) == top and MARKER_NAME in names else []


def _default_destination(uuid: str) -> Path:
    """``./checkpoints/<uuid>``, checked to stay directly under ./checkpoints."""
    base = DEFAULT_DOWNLOAD_DIR.resolve()
    # resolve() so that a checkpoints/<uuid> symlink pointing elsewhere is caught too.
    if (base / uuid).resolve().parent != base:
        raise DetSlurmError(f"checkpoint uuid {uuid!r} would be written outside {base}; refusing to download it")
    return DEFAULT_DOWNLOAD_DIR / uuid


def _sorted_checkpoints(
    session: Session,
    infos: list[dict[str, Any]],
    smaller_is_better: bool,
    sort_by: Union[str, CheckpointSortBy, None],
    order_by: Union[CheckpointOrderBy, OrderBy, None],
    max_results: Optional[int],
) -> list[Checkpoint]:
    """Determined's checkpoint listing: both of sort_by and order_by, or neither (then by the
    searcher metric, best first); a str sort_by is a validation metric's name. Only completed
    checkpoints are listed."""
    if (sort_by is None) != (order_by is None):
        raise ValueError("sort_by and order_by must be given together, or neither")
    done = [i for i in infos if i["state"] == "COMPLETED"]
    if sort_by is None or sort_by == CheckpointSortBy.SEARCHER_METRIC:
        descending = not smaller_is_better if order_by is None else _descending(order_by)
        key: Any = lambda i: i["validation_metric"]  # noqa: E731
    elif isinstance(sort_by, str):
        metric = sort_by
        descending = _descending(order_by)
        values = {i["uuid"]: session.reads.validation_metric(i["uuid"], metric) for i in done}
        key = lambda i: values[i["uuid"]]  # noqa: E731
    else:
        field = {
            CheckpointSortBy.UUID: "uuid",
            CheckpointSortBy.TRIAL_ID: "trial_id",
            CheckpointSortBy.BATCH_NUMBER: "steps_completed",
            CheckpointSortBy.END_TIME: "report_time",
            CheckpointSortBy.STATE: "state",
        }[CheckpointSortBy(sort_by)]
        descending = _descending(order_by)
        key = lambda i: i[field]  # noqa: E731
    # Checkpoints without a value last, whatever the order (as Determined lists them).
    known = sorted((i for i in done if key(i) is not None), key=key, reverse=descending)
    ordered = known + [i for i in done if key(i) is None]
    chosen = ordered if max_results is None else ordered[:max_results]
    return [Checkpoint(session, i["uuid"]) for i in chosen]


def _descending(order_by: Any) -> bool:
    return str(getattr(order_by, "value", order_by)) == "ORDER_BY_DESC"


def _smaller_is_better(config: dict[str, Any]) -> bool:
    return ConfigView(config).searcher.smaller_is_better


# -- trials -----------------------------------------------------------------------------------
def _trial_metrics(session: Session, trial_id: int, group: Optional[str]) -> Iterator[TrialMetrics]:
    session.reads.trial(trial_id, session.owner)  # the scope check: another user's is "not found"
    for m in session.reads.metrics(trial_id):
        if group is None or m["group"] == group:
            yield TrialMetrics(trial_id, m["run_id"], m["steps_completed"], m["report_time"], m["metrics"], m["group"])


def _log_time(value: Union[str, int, None], what: str) -> Optional[datetime]:
    from detslurm.cli.log_filter import parse_time

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{what} must be an RFC 3339 string or epoch seconds (int), not {type(value).__name__}")
    if isinstance(value, int):
        return datetime.fromtimestamp(value, tz=timezone.utc)
    return parse_time(value, what)


def _log_filter(
    follow: bool,
    head: Optional[int],
    tail: Optional[int],
    container_ids: Optional[list[str]],
    rank_ids: Optional[list[int]],
    stdtypes: Optional[list[str]],
    min_level: Any,
    timestamp_before: Union[str, int, None],
    timestamp_after: Union[str, int, None],
    sources: Optional[list[str]],
) -> Any:
    """Trial.iter_logs' arguments checked, as the filter of `det trial logs`."""
    from detslurm.cli.log_filter import LEVELS, LogFilter

    if follow:
        raise DetSlurmError("iter_logs(follow=True) is not built in the SDK: `det trial logs -f` follows a trial")
    if head is not None and tail is not None:
        raise ValueError("iter_logs(): head and tail are mutually exclusive")
    for name, n in (("head", head), ("tail", tail)):
        if n is not None and n < 0:
            raise ValueError(f"iter_logs(): {name} must be non-negative, got {n}")
    # One output file per run holds stdout and stderr of every rank on every node.
    if container_ids or sources or (stdtypes and not {"stdout", "stderr"} <= set(stdtypes)):
        raise ValueError(
            "iter_logs(): container_ids, sources and stdtypes do not apply here (a run's stdout and stderr "
            "are one file); filter by rank_ids, min_level or the timestamps"
        )
    level = getattr(min_level, "name", min_level)
    if level is not None and level not in LEVELS:
        raise ValueError(f"iter_logs(): min_level must be one of {', '.join(LEVELS)} (got {min_level!r})")
    # A filter with a time always set: the reader then prints no "=== run" header lines, which
    # are not lines of the trial's log.
    since = _log_time(timestamp_after, "timestamp_after") or datetime.min.replace(tzinfo=timezone.utc)
    until = _log_time(timestamp_before, "timestamp_before")
    return LogFilter(ranks=tuple(rank_ids or ()), min_level=level, since=since, until=until)


class Trial:
    """A trial in the store (Determined's ``client.Trial``)."""

    def __init__(self, trial_id: int, session: Session) -> None:
        self.id = trial_id
        self._session = session
        self.reload()

    def reload(self) -> None:
        info = self._session.reads.trial(self.id, self._session.owner)
        self.experiment_id: int = info["experiment_id"]
        self.hparams: dict[str, Any] = info["hparams"]
        self.state = _state(TrialState, info["state"])
        self.steps_completed: int = info["steps_completed"]
        self.searcher_metric: float | None = info["searcher_metric"]
        self.start_time: datetime | None = info["start_time"]
        self.end_time: datetime | None = info["end_time"]
        self.restarts: int = info["restarts"]

    def get_experiment(self) -> Experiment:
        return Experiment(self.experiment_id, self._session)

    def iter_metrics(self, group: str) -> Iterator[TrialMetrics]:
        """Every metrics report of ``group`` ("training", "validation" or the trial's own), by step."""
        return _trial_metrics(self._session, self.id, group)

    def stream_metrics(self, group: str) -> Iterator[TrialMetrics]:
        return self.iter_metrics(group)

    def stream_training_metrics(self) -> Iterator[TrialMetrics]:
        return self.iter_metrics("training")

    def stream_validation_metrics(self) -> Iterator[TrialMetrics]:
        return self.iter_metrics("validation")

    def _checkpoint_infos(self) -> list[dict[str, Any]]:
        reads = self._session.reads
        return [c for c in reads.checkpoint_dicts(self.experiment_id, self._session.owner) if c["trial_id"] == self.id]

    def _smaller(self) -> bool:
        return _smaller_is_better(self._session.reads.experiment(self.experiment_id, self._session.owner)[1])

    def list_checkpoints(
        self,
        sort_by: Union[str, CheckpointSortBy, None] = None,
        order_by: Optional[OrderBy] = None,
        max_results: Optional[int] = None,
    ) -> list[Checkpoint]:
        """The trial's completed checkpoints, best first by the searcher metric unless sorted otherwise."""
        infos = self._checkpoint_infos()
        return _sorted_checkpoints(self._session, infos, self._smaller(), sort_by, order_by, max_results)

    def get_checkpoints(
        self, sort_by: Union[str, CheckpointSortBy, None] = None, order_by: Optional[OrderBy] = None
    ) -> list[Checkpoint]:
        return self.list_checkpoints(sort_by, order_by)

    def top_checkpoint(self, sort_by: Optional[str] = None, smaller_is_better: Optional[bool] = None) -> Checkpoint:
        return self.select_checkpoint(best=True, sort_by=sort_by, smaller_is_better=smaller_is_better)

    def select_checkpoint(
        self,
        latest: bool = False,
        best: bool = False,
        uuid: Optional[str] = None,
        sort_by: Optional[str] = None,
        smaller_is_better: Optional[bool] = None,
    ) -> Checkpoint:
        """Exactly one of ``latest`` (the most steps), ``best`` (by the searcher metric, or by
        the validation metric ``sort_by`` with ``smaller_is_better``) or ``uuid``."""
        if sum([int(latest), int(best), int(uuid is not None)]) != 1:
            raise ValueError("select_checkpoint(): give exactly one of latest, best or uuid")
        if (sort_by is None) != (smaller_is_better is None):
            raise ValueError("select_checkpoint(): sort_by and smaller_is_better go together")
        if sort_by is not None and not best:
            raise ValueError("select_checkpoint(): sort_by and smaller_is_better are for best=True")
        if uuid is not None:
            return Checkpoint(self._session, uuid)
        infos = self._checkpoint_infos()
        if latest:
            done = [i for i in infos if i["state"] == "COMPLETED"]
            if not done:
                raise NotFoundError("completed checkpoint of trial", self.id)
            return Checkpoint(self._session, max(done, key=lambda i: i["steps_completed"])["uuid"])
        smaller = self._smaller() if smaller_is_better is None else smaller_is_better
        order = CheckpointOrderBy.ASC if smaller else CheckpointOrderBy.DESC
        found = _sorted_checkpoints(self._session, infos, smaller, sort_by, order if sort_by else None, max_results=1)
        if not found:
            raise NotFoundError("completed checkpoint of trial", self.id)
        return found[0]

    def iter_logs(
        self,
        follow: bool = False,
        *,
        head: Optional[int] = None,
        tail: Optional[int] = None,
        container_ids: Optional[list[str]] = None,
        rank_ids: Optional[list[int]] = None,
        stdtypes: Optional[list[str]] = None,
        min_level: Any = None,
        timestamp_before: Optional[Union[str, int]] = None,
        timestamp_after: Optional[Union[str, int]] = None,
        sources: Optional[list[str]] = None,
        search_text: Optional[str] = None,
    ) -> Iterator[str]:
        """The trial's log lines (each ending in a newline, as Determined's): every run's output,
        then detslurm's notes, read as `det trial logs` reads them. ``rank_ids``, ``min_level``
        (a LogLevel or its name) and the timestamps (RFC 3339 or epoch seconds) filter as its
        options do; ``search_text`` keeps the lines that contain it."""
        from detslurm.cli import logs as reader

        flt = _log_filter(
            follow, head, tail, container_ids, rank_ids, stdtypes, min_level, timestamp_before, timestamp_after, sources
        )
        # The reader takes the CLI's app; a session has what it reads (reads, scope).
        app: Any = self._session
        if tail is not None and not search_text:
            found: Iterable[str] = reader.tail(app, self.id, tail, flt)
        else:
            found = (line for line in reader.lines(app, self.id, flt) if not search_text or search_text in line)
            if tail is not None:
                found = collections.deque(found, maxlen=tail)
            elif head is not None:
                found = itertools.islice(found, head)
        return (line + "\n" for line in found)

    def logs(
        self,
        follow: bool = False,
        *,
        head: Optional[int] = None,
        tail: Optional[int] = None,
        container_ids: Optional[list[str]] = None,
        rank_ids: Optional[list[int]] = None,
        stdtypes: Optional[list[str]] = None,
        min_level: Any = None,
        timestamp_before: Optional[Union[str, int]] = None,
        timestamp_after: Optional[Union[str, int]] = None,
        sources: Optional[list[str]] = None,
        search_text: Optional[str] = None,
    ) -> Iterator[str]:
        """Deprecated in Determined: :meth:`iter_logs`."""
        warnings.warn("Trial.logs() is deprecated: call Trial.iter_logs()", FutureWarning, stacklevel=2)
        return self.iter_logs(
            follow,
            head=head,
            tail=tail,
            container_ids=container_ids,
            rank_ids=rank_ids,
            stdtypes=stdtypes,
            min_level=min_level,
            timestamp_before=timestamp_before,
            timestamp_after=timestamp_after,
            sources=sources,
            search_text=search_text,
        )

    def kill(self) -> None:
        """Stop the trial now (as `det trial kill`); the searcher sees it as ended early."""
        from detslurm.controller import ops

        ops.kill_trial(self._session.store, self.id, self._session.scope)

    def __repr__(self) -> str:
        return f"Trial(id={self.id})"


class TrialReference(Trial):
    """Determined's older name for :class:`Trial`."""


# -- experiments ------------------------------------------------------------------------------
class Experiment:
    """An experiment in the store (Determined's ``client.Experiment``)."""

    def __init__(self, experiment_id: int, session: Session) -> None:
        self._id = experiment_id
        self._session = session
        self.reload()

    @property
    def id(self) -> int:
        return self._id

    def reload(self) -> None:
        info, config = self._session.reads.experiment(self._id, self._session.owner)
        self.name: str = info["name"]
        self.state = _state(ExperimentState, info["state"])
        self.progress: float = info["progress"]
        self.description: str | None = info["description"]
        self.archived: bool = info["archived"]
        self.labels: list[str] = list(info["labels"] or [])
        self.config = config
        self.start_time: datetime | None = info["start_time"]
        self.end_time: datetime | None = info["end_time"]

    def download_code(self, output_dir: Optional[str] = None) -> str:
        """The experiment's code as submitted (the context snapshot taken at create) saved as
        ``exp-<id>_model_def.tar.gz`` in ``output_dir`` (created if missing; default the current
        dir), replacing a file of that name; the path written."""
        from detslurm.protocol import ExpPaths
        from detslurm.util import open_regular

        info, _ = self._session.reads.experiment(self._id, self._session.owner)
        src = ExpPaths(Path(info["exp_dir"])).context
        out_dir = Path(output_dir).expanduser() if output_dir else Path()
        out_dir.mkdir(parents=True, exist_ok=True)
        dest = out_dir / f"exp-{self._id}_model_def.tar.gz"
        try:
            # The snapshot lies in the experiment dir, which the trials can write: only a regular
            # file is copied, never what a link in its place names.
            opened = open_regular(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise NotFoundError("code snapshot of experiment", self._id) from e
        if opened is None:
            raise NotFoundError("code snapshot of experiment", self._id)
        tmp = dest.with_name(f".{dest.name}.tmp")
        with opened[0] as f, open(tmp, "wb") as out:
            shutil.copyfileobj(f, out)
        tmp.replace(dest)
        return str(dest)

    # -- reading ---------------------------------------------------------------------------
    def _trial_ids(self) -> list[int]:
        return [t["id"] for t in self._session.reads.trial_dicts(self._id, self._session.owner)]

    def iter_trials(
        self,
        sort_by: TrialSortBy = TrialSortBy.ID,
        order_by: Union[OrderBy, TrialOrderBy] = OrderBy.ASCENDING,
        limit: Optional[int] = None,
    ) -> Iterator[Trial]:
        trials = [Trial(i, self._session) for i in self._trial_ids()]
        key = {
            TrialSortBy.ID: lambda t: t.id,
            TrialSortBy.START_TIME: lambda t: t.start_time or datetime.min,
            TrialSortBy.END_TIME: lambda t: t.end_time or datetime.max,
            TrialSortBy.STATE: lambda t: t.state.value,
            TrialSortBy.BATCHES_PROCESSED: lambda t: t.steps_completed,
            TrialSortBy.RESTARTS: lambda t: t.restarts,
        }.get(TrialSortBy(sort_by))
        if key is None:
            raise ValueError(f"iter_trials(): sorting by {TrialSortBy(sort_by).name} is not supported by detslurm")
        trials.sort(key=key, reverse=_descending(order_by))
        yield from trials if limit is None else trials[:limit]

    def list_trials(
        self, sort_by: TrialSortBy = TrialSortBy.ID, order_by: Union[OrderBy, TrialOrderBy] = OrderBy.ASCENDING
    ) -> list[Trial]:
        return list(self.iter_trials(sort_by, order_by))

    def get_trials(
        self, sort_by: TrialSortBy = TrialSortBy.ID, order_by: Union[OrderBy, TrialOrderBy] = OrderBy.ASCENDING
    ) -> list[Trial]:
        return self.list_trials(sort_by, order_by)

    def await_first_trial(self, interval: float = 0.1) -> Trial:
        """The experiment's first trial, waiting until its searcher made one."""
        while True:
            first = self._session.reads.first_trial_id(self._id, self._session.owner)
            if first is not None:
                return Trial(first, self._session)
            time.sleep(interval)

    def wait(self, interval: float = 5.0) -> ExperimentState:
        """Poll until the experiment ends; its final state."""
        while True:
            self.reload()
            if self.state.name in _TERMINAL:
                return self.state  # type: ignore[no-any-return]
            time.sleep(interval)

    def list_checkpoints(
        self,
        sort_by: Union[str, CheckpointSortBy, None] = None,
        order_by: Optional[OrderBy] = None,
        max_results: Optional[int] = None,
    ) -> list[Checkpoint]:
        """Completed checkpoints of every trial, best first by the searcher metric unless
        ``sort_by`` (a CheckpointSortBy or a validation metric's name) and ``order_by`` say otherwise."""
        infos = self._session.reads.checkpoint_dicts(self._id, self._session.owner)
        smaller = _smaller_is_better(self.config)
        return _sorted_checkpoints(self._session, infos, smaller, sort_by, order_by, max_results)

    def top_n_checkpoints(
        self, limit: int, sort_by: Optional[str] = None, smaller_is_better: Optional[bool] = None
    ) -> list[Checkpoint]:
        if (sort_by is None) != (smaller_is_better is None):
            raise ValueError("top_n_checkpoints(): sort_by and smaller_is_better go together")
        order = None if sort_by is None else (CheckpointOrderBy.ASC if smaller_is_better else CheckpointOrderBy.DESC)
        return self.list_checkpoints(sort_by, order, max_results=limit)  # type: ignore[arg-type]

    def top_checkpoint(self, sort_by: Optional[str] = None, smaller_is_better: Optional[bool] = None) -> Checkpoint:
        found = self.top_n_checkpoints(1, sort_by, smaller_is_better)
        if not found:
            raise NotFoundError("completed checkpoint of experiment", self._id)
        return found[0]

    # -- changing (row changes the owner's daemon carries out, as the `det e` commands) -------------
    def _op(self, name: str) -> None:
        from detslurm.controller import ops

        getattr(ops, name)(self._session.store, self._id, self._session.scope)
        self.reload()

    def activate(self) -> None:
        self._op("activate")

    def pause(self) -> None:
        self._op("pause")

    def cancel(self) -> None:
        self._op("cancel")

    def kill(self) -> None:
        self._op("kill")

    def delete(self) -> None:
        """Delete the ended experiment, its checkpoints and its dir (as `det e delete`)."""
        from detslurm.controller import ops

        ops.delete(self._session.store, self._id, self._session.scope)

    def _edit(self, name: str, *args: Any) -> None:
        from detslurm.controller import edit

        getattr(edit, name)(self._session.store, self._id, *args, scope=self._session.scope)
        self.reload()

    def archive(self) -> None:
        self._edit("set_archived", True)

    def unarchive(self) -> None:
        self._edit("set_archived", False)

    def add_label(self, label: str) -> None:
        self._edit("set_labels", label, True)

    def remove_label(self, label: str) -> None:
        self._edit("set_labels", label, False)

    def set_labels(self, labels: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(labels))
        for label in [x for x in self.labels if x not in wanted]:
            self.remove_label(label)
        for label in [x for x in wanted if x not in self.labels]:
            self.add_label(label)

    def set_description(self, description: str) -> None:
        self._edit("set_description", description)

    def set_name(self, name: str) -> None:
        self._edit("set_name", name)

    def __repr__(self) -> str:
        return f"Experiment(id={self._id})"


class ExperimentReference(Experiment):
    """Determined's older name for :class:`Experiment`."""


_TERMINAL = frozenset({"COMPLETED", "CANCELED", "ERROR", "DELETED"})


# -- the client -------------------------------------------------------------------------------
class Determined:
    """The SDK's entry point. ``master`` is None (the store of the user's settings) or a
    database URL (``sqlite:///...``, ``postgresql://...``); there is no master server, so an
    ``http(s)://`` address is refused and user, password and certificates are not used."""

    def __init__(
        self,
        master: Optional[str] = None,
        user: Optional[str] = None,
        password: Optional[str] = None,
        cert_path: Optional[str] = None,
        cert_name: Optional[str] = None,
        noverify: bool = False,
    ) -> None:
        if master is not None and master.startswith(("http://", "https://")):
            raise DetSlurmError(
                f"client: {master} is a Determined master's address; detslurm has no master and reads its own store "
                "(login() with no master, or master='sqlite:///...' / 'postgresql://...' for another store)"
            )
        if user or password or cert_path or cert_name:
            log.info("client: user, password and certificates are not used (the store belongs to the Unix user)")
        self._session = Session(master)

    def get_experiment(self, experiment_id: int) -> Experiment:
        return Experiment(experiment_id, self._session)

    def get_trial(self, trial_id: int) -> Trial:
        return Trial(trial_id, self._session)

    def get_checkpoint(self, uuid: str) -> Checkpoint:
        return Checkpoint(self._session, uuid)

    def list_experiments(
        self,
        sort_by: Any = None,
        order_by: Optional[OrderBy] = None,
        experiment_ids: Optional[list[int]] = None,
        labels: Optional[list[str]] = None,
        users: Optional[list[str]] = None,
        states: Optional[list[ExperimentState]] = None,
        name: Optional[str] = None,
        project_id: Optional[int] = None,
    ) -> list[Experiment]:
        """The caller's experiments (archived ones too), filtered as given, by ``sort_by``
        (an ExperimentSortBy; default ID) in ``order_by``'s order (default ascending)."""
        if project_id is not None:
            raise ValueError("list_experiments(): detslurm has no projects; leave project_id out")
        rows = self._session.reads.experiment_dicts(self._session.owner, include_archived=True)
        wanted = {ExperimentState(s).name for s in states} if states else None
        kept = [
            d
            for d in rows
            if (experiment_ids is None or d["id"] in experiment_ids)
            and (labels is None or set(labels) & set(d["labels"] or []))
            and (users is None or d["owner"] in users)
            and (wanted is None or _state(ExperimentState, d["state"]).name in wanted)
            and (name is None or name in (d["name"] or ""))
        ]
        descending = order_by is not None and _descending(order_by)
        ordered = _sorted_experiments(kept, ExperimentSortBy.ID if sort_by is None else sort_by, descending)
        return [Experiment(d["id"], self._session) for d in ordered]

    def iter_trials_metrics(self, trial_ids: list[int], group: str) -> Iterator[TrialMetrics]:
        for trial_id in trial_ids:
            yield from _trial_metrics(self._session, trial_id, group)

    def stream_trials_metrics(self, trial_ids: list[int], group: str) -> Iterator[TrialMetrics]:
        return self.iter_trials_metrics(trial_ids, group)

    def stream_trials_training_metrics(self, trial_ids: list[int]) -> Iterator[TrialMetrics]:
        return self.iter_trials_metrics(trial_ids, "training")

    def stream_trials_validation_metrics(self, trial_ids: list[int]) -> Iterator[TrialMetrics]:
        return self.iter_trials_metrics(trial_ids, "validation")

    def logout(self) -> None:
        """Nothing to end: the store needs no session (kept for Determined's scripts)."""


class Client(Determined):
    """The SDK over a given store and scope: the `det` commands' way in (root's --all-users
    scope included), and tests'."""

    def __init__(self, store: Store | None = None, scope: Scope | None = None) -> None:
        self._session = Session(store=store, scope=scope)


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
