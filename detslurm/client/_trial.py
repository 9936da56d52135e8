"""Trials (Determined's ``client.Trial``): metrics, checkpoints, logs, kill."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional, Union

from detslurm.client._checkpoint import Checkpoint, CheckpointListing, _metric_name, _sorted_checkpoints
from detslurm.client._enums import CheckpointOrderBy, CheckpointSortBy, OrderBy, TrialState, _state
from detslurm.client._metrics import TrialMetrics, _trial_metrics
from detslurm.errors import NotFoundError

if TYPE_CHECKING:
    from detslurm.client._experiment import Experiment
    from detslurm.client._session import Session


class Trial:
    """A trial in the store (Determined's ``client.Trial``)."""

    def __init__(self, trial_id: int, session: Session) -> None:
        self.id = trial_id
        self._session = session
        self.reload()

    @classmethod
    def _of(cls, session: Session, info: dict[str, Any]) -> Trial:
        """One made from a listing's row, with no read of its own (over ssh:// a read is a call)."""
        trial = cls.__new__(cls)
        trial.id, trial._session = info["id"], session
        trial._load(info)
        return trial

    def reload(self) -> None:
        self._load(self._session.reads.trial(self.id, self._session.owner))

    def _load(self, info: dict[str, Any]) -> None:
        self.experiment_id: int = info["experiment_id"]
        self.hparams: dict[str, Any] = info["hparams"]
        self.state = _state(TrialState, info["state"])
        self.steps_completed: int = info["steps_completed"]
        self.searcher_metric: float | None = info["searcher_metric"]
        self.start_time: datetime | None = info["start_time"]
        self.end_time: datetime | None = info["end_time"]
        self.restarts: int = info["restarts"]

    def get_experiment(self) -> Experiment:
        # Imported here: an experiment lists its trials, so _experiment imports this module.
        from detslurm.client._experiment import Experiment

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

    def _checkpoints(self, sort_by: Union[str, CheckpointSortBy, None] = None) -> CheckpointListing:
        return self._session.checkpoint_listing(self.experiment_id, self.id, _metric_name(sort_by))

    def list_checkpoints(
        self,
        sort_by: Union[str, CheckpointSortBy, None] = None,
        order_by: Optional[OrderBy] = None,
        max_results: Optional[int] = None,
    ) -> list[Checkpoint]:
        """The trial's completed checkpoints, best first by the searcher metric unless sorted otherwise."""
        return _sorted_checkpoints(self._session, self._checkpoints(sort_by), sort_by, order_by, max_results)

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
        listing = self._checkpoints(sort_by)
        if latest:
            done = [i for i in listing.infos if i["state"] == "COMPLETED"]
            if not done:
                raise NotFoundError("completed checkpoint of trial", self.id)
            return Checkpoint._of(self._session, max(done, key=lambda i: i["steps_completed"]))
        # With sort_by, smaller_is_better (given with it) orders; without, the searcher's metric.
        order = CheckpointOrderBy.ASC if smaller_is_better else CheckpointOrderBy.DESC
        found = _sorted_checkpoints(self._session, listing, sort_by, order if sort_by else None, max_results=1)
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
        options = {
            "follow": follow,
            "head": head,
            "tail": tail,
            "container_ids": container_ids,
            "rank_ids": rank_ids,
            "stdtypes": stdtypes,
            # A LogLevel by its name: the options cross to the login node as JSON over ssh://.
            "min_level": getattr(min_level, "name", min_level),
            "timestamp_before": timestamp_before,
            "timestamp_after": timestamp_after,
            "sources": sources,
            "search_text": search_text,
        }
        return (line + "\n" for line in self._session.trial_log_lines(self.id, options))

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
        self._session.kill_trial(self.id)

    def __repr__(self) -> str:
        return f"Trial(id={self.id})"


class TrialReference(Trial):
    """Determined's older name for :class:`Trial`."""
