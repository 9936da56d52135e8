"""Experiments (Determined's ``client.Experiment``): trials, checkpoints, waiting, state changes."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from detslurm.cli.state_change import Verb
from detslurm.client._checkpoint import Checkpoint, _metric_name, _sorted_checkpoints
from detslurm.client._enums import (
    CheckpointOrderBy,
    CheckpointSortBy,
    ExperimentState,
    OrderBy,
    TrialOrderBy,
    TrialSortBy,
    _descending,
    _state,
)
from detslurm.client._session import Edit
from detslurm.client._trial import Trial
from detslurm.errors import NotFoundError

if TYPE_CHECKING:
    from detslurm.client._session import Session


class Experiment:
    """An experiment in the store (Determined's ``client.Experiment``)."""

    def __init__(self, experiment_id: int, session: Session) -> None:
        self._id = experiment_id
        self._session = session
        self.reload()

    @classmethod
    def _of(cls, session: Session, info: dict[str, Any], config: dict[str, Any]) -> Experiment:
        """One made from a listing's row, with no read of its own (over ssh:// a read is a call)."""
        exp = cls.__new__(cls)
        exp._id, exp._session = info["id"], session
        exp._load(info, config)
        return exp

    @property
    def id(self) -> int:
        return self._id

    def reload(self) -> None:
        self._load(*self._session.reads.experiment(self._id, self._session.owner))

    def _load(self, info: dict[str, Any], config: dict[str, Any]) -> None:
        self.name: str = info["name"]
        self.state = _state(ExperimentState, info["state"])
        self.progress: float = info["progress"]
        self.description: str | None = info["description"]
        self.notes: str | None = info["notes"]
        self.archived: bool = info["archived"]
        self.labels: list[str] = list(info["labels"] or [])
        self.config = config
        self.start_time: datetime | None = info["start_time"]
        self.end_time: datetime | None = info["end_time"]

    def download_code(self, output_dir: Optional[str] = None) -> str:
        """The experiment's code as submitted (the context snapshot taken at create) saved as
        ``exp-<id>_model_def.tar.gz`` in ``output_dir`` (created if missing; default the current
        dir), replacing a file of that name; the path written. Over ssh:// it is copied from the
        login node."""
        out_dir = Path(output_dir).expanduser() if output_dir else Path()
        out_dir.mkdir(parents=True, exist_ok=True)
        dest = out_dir / f"exp-{self._id}_model_def.tar.gz"
        self._session.download_code(self._id, dest)
        return str(dest)

    # -- reading (a listing is one read, whatever its length) ---------------------------------
    def iter_trials(
        self,
        sort_by: TrialSortBy = TrialSortBy.ID,
        order_by: Union[OrderBy, TrialOrderBy] = OrderBy.ASCENDING,
        limit: Optional[int] = None,
    ) -> Iterator[Trial]:
        infos = self._session.reads.trial_dicts(self._id, self._session.owner)
        trials = [Trial._of(self._session, info) for info in infos]
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
        listing = self._session.checkpoint_listing(self._id, None, _metric_name(sort_by))
        return _sorted_checkpoints(self._session, listing, sort_by, order_by, max_results)

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
    def _change(self, verb: Verb) -> None:
        self._session.change_state(verb, self._id)
        self.reload()

    def activate(self) -> None:
        self._change(Verb.ACTIVATE)

    def pause(self) -> None:
        self._change(Verb.PAUSE)

    def cancel(self) -> None:
        self._change(Verb.CANCEL)

    def kill(self) -> None:
        self._change(Verb.KILL)

    def delete(self) -> None:
        """Delete the ended experiment, its checkpoints and its dir (as `det e delete`)."""
        self._session.delete_experiment(self._id)

    def _edit(self, change: Edit, *args: Any) -> None:
        self._session.edit(change, self._id, *args)
        self.reload()

    def archive(self) -> None:
        self._edit(Edit.ARCHIVED, True)

    def unarchive(self) -> None:
        self._edit(Edit.ARCHIVED, False)

    def add_label(self, label: str) -> None:
        self._edit(Edit.LABELS, label, True)

    def remove_label(self, label: str) -> None:
        self._edit(Edit.LABELS, label, False)

    def set_labels(self, labels: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(labels))
        for label in [x for x in self.labels if x not in wanted]:
            self.remove_label(label)
        for label in [x for x in wanted if x not in self.labels]:
            self.add_label(label)

    def set_description(self, description: str) -> None:
        self._edit(Edit.DESCRIPTION, description)

    def set_name(self, name: str) -> None:
        self._edit(Edit.NAME, name)

    def set_notes(self, notes: str) -> None:
        """Replace the experiment's notes (shown by `det e describe`)."""
        self._session.set_notes(self._id, notes)
        self.reload()

    def delete_tensorboard_files(self) -> None:
        """Delete the TensorBoard files of the experiment's trials (what `det tensorboard` shows);
        its metrics stay in the store, so later reports start new event files."""
        self._session.delete_tensorboard_files(self._id)

    def __repr__(self) -> str:
        return f"Experiment(id={self._id})"


class ExperimentReference(Experiment):
    """Determined's older name for :class:`Experiment`."""


_TERMINAL = frozenset({"COMPLETED", "CANCELED", "ERROR", "DELETED"})
