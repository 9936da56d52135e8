"""Checkpoints (Determined's ``client.Checkpoint``): reading, downloading, metadata, deletion."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Union

from detslurm.client._enums import (
    CheckpointOrderBy,
    CheckpointSortBy,
    CheckpointState,
    DownloadMode,
    OrderBy,
    _descending,
    _state,
)
from detslurm.client._metrics import TrialMetrics, _trial_metrics
from detslurm.errors import DetSlurmError, NotFoundError, StateError
from detslurm.expconf.view import ConfigView

if TYPE_CHECKING:
    from detslurm.client._session import Session

# Where `download()` puts a checkpoint when no path is given: ./checkpoints/<uuid>.
DEFAULT_DOWNLOAD_DIR = Path("checkpoints")


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

    @classmethod
    def _of(cls, session: Session, info: dict[str, Any]) -> Checkpoint:
        """One made from a listing's row, with no read of its own (over ssh:// a read is a call)."""
        ck = cls.__new__(cls)
        ck._session, ck.uuid = session, info["uuid"]
        ck._load(info)
        return ck

    def reload(self) -> None:
        self._load(self._session.reads.checkpoint(self.uuid, self._session.owner))

    def _load(self, info: dict[str, Any]) -> None:
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
        DownloadMode(mode)
        return str(self._session.download_checkpoint(self, Path(path) if path is not None else None))

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
        self.metadata = self._session.set_checkpoint_metadata(self.uuid, metadata)

    def delete(self) -> None:
        """Delete the checkpoint's files; its row stays, DELETED (as `det checkpoint delete`)."""
        self._session.delete_checkpoint(self.uuid)
        self.reload()

    def remove_files(self, globs: list[str]) -> None:
        """Remove the checkpoint's files matching any of ``globs`` (relative to its top); it is
        then PARTIALLY_DELETED, or DELETED when nothing is left (as `det checkpoint rm`)."""
        if isinstance(globs, str):
            raise TypeError("remove_files() takes a list of glob patterns, not one string")
        self._session.remove_checkpoint_files(self.uuid, list(globs))
        self.reload()

    def write_metadata_file(self, path: str) -> None:
        """The checkpoint's metadata as JSON in the file ``path``."""
        import json

        Path(path).write_text(json.dumps(self.metadata, indent=2, sort_keys=True))

    def __add__(self, other: object) -> str:
        """``client.get_checkpoint(uuid) + "/code/"``, as Determined's PyTorch Trainer guide
        writes its step "Loading Checkpoints" (under Determined a TypeError: the guide means the
        downloaded checkpoint): the path :meth:`download` wrote, downloaded on first use, with
        ``other`` appended."""
        if not isinstance(other, str):
            return NotImplemented
        downloaded: str | None = getattr(self, "_downloaded", None)
        if downloaded is None:
            downloaded = self._downloaded = self.download()
        return downloaded + other

    def __repr__(self) -> str:
        return f"Checkpoint(uuid={self.uuid})"


def copy_checkpoint(checkpoint: Checkpoint, dst: Path | None) -> Path:
    """Copy the checkpoint's checked directory into ``dst`` (default ``./checkpoints/<uuid>``),
    a new or empty directory; the path written."""
    from detslurm.download_dir import fresh_download_dir

    src = checkpoint.checked_source()
    dst = dst if dst is not None else default_destination(checkpoint.uuid)
    # symlinks=True: a link the trial left in its checkpoint is copied as a link, never
    # followed to read (and copy out) whatever file it names. A fresh dir: never through a
    # link an earlier download left.
    with fresh_download_dir(dst) as tmp:
        shutil.copytree(src, tmp, symlinks=True, dirs_exist_ok=True, ignore=_without_mark(src))
    return dst


def _without_mark(top: Path) -> Callable[[str, list[str]], list[str]]:
    """A copytree ``ignore`` leaving out the delete mark at the checkpoint's top
    (protocol/ckmark.py): it is the run's, not one of the checkpoint's files."""
    from detslurm.protocol.ckmark import MARKER_NAME

    return lambda d, names: [MARKER_NAME] if Path(d) == top and MARKER_NAME in names else []


def default_destination(uuid: str) -> Path:
    """``./checkpoints/<uuid>``, checked to stay directly under ./checkpoints."""
    base = DEFAULT_DOWNLOAD_DIR.resolve()
    # resolve() so that a checkpoints/<uuid> symlink pointing elsewhere is caught too.
    if (base / uuid).resolve().parent != base:
        raise DetSlurmError(f"checkpoint uuid {uuid!r} would be written outside {base}; refusing to download it")
    return DEFAULT_DOWNLOAD_DIR / uuid


class CheckpointListing(NamedTuple):
    """An experiment's checkpoints (or one trial's) as a listing sorts them, read at once."""

    infos: list[dict[str, Any]]
    smaller_is_better: bool  # the searcher's metric's direction
    # Each completed checkpoint's value of the validation metric a listing sorts by (by uuid;
    # empty when it sorts by no metric name).
    metric: dict[str, Optional[float]]


def _metric_name(sort_by: Union[str, CheckpointSortBy, None]) -> Optional[str]:
    """The validation metric a listing sorts by: a str ``sort_by`` (None for the others)."""
    return sort_by if isinstance(sort_by, str) else None


def _sorted_checkpoints(
    session: Session,
    listing: CheckpointListing,
    sort_by: Union[str, CheckpointSortBy, None],
    order_by: Union[CheckpointOrderBy, OrderBy, None],
    max_results: Optional[int],
) -> list[Checkpoint]:
    """Determined's checkpoint listing: both of sort_by and order_by, or neither (then by the
    searcher metric, best first); a str sort_by is a validation metric's name. Only completed
    checkpoints are listed."""
    if (sort_by is None) != (order_by is None):
        raise ValueError("sort_by and order_by must be given together, or neither")
    done = [i for i in listing.infos if i["state"] == "COMPLETED"]
    if sort_by is None or sort_by == CheckpointSortBy.SEARCHER_METRIC:
        descending = not listing.smaller_is_better if order_by is None else _descending(order_by)
        key: Any = lambda i: i["validation_metric"]  # noqa: E731
    elif isinstance(sort_by, str):
        descending = _descending(order_by)
        key = lambda i: listing.metric.get(i["uuid"])  # noqa: E731
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
    return [Checkpoint._of(session, i) for i in chosen]


def _smaller_is_better(config: dict[str, Any]) -> bool:
    return ConfigView(config).searcher.smaller_is_better
