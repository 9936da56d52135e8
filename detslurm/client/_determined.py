"""The SDK's entry point, ``Determined``, and the module-level functions sharing one of it."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Optional, Union

from detslurm.client._checkpoint import Checkpoint
from detslurm.client._enums import ExperimentSortBy, ExperimentState, OrderBy, _descending, _sorted_experiments, _state
from detslurm.client._experiment import Experiment
from detslurm.client._metrics import TrialMetrics, _trial_metrics
from detslurm.client._session import Session
from detslurm.client._trial import Trial
from detslurm.errors import DetSlurmError
from detslurm.identity import Scope

if TYPE_CHECKING:
    from detslurm.store import Store

log = logging.getLogger("detslurm.client")


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
        self._session = _session_for(master)

    def create_experiment(
        self,
        config: Union[str, pathlib.Path, dict[str, Any]],
        model_dir: Union[str, pathlib.Path, None] = None,
        includes: Optional[Iterable[Union[str, pathlib.Path]]] = None,
        project_id: Optional[int] = None,
        template: Optional[str] = None,
    ) -> Experiment:
        """Create an experiment from ``config`` (a YAML file's path, or the config as a dict) and
        the code in ``model_dir`` (plus ``includes``, each under its own name), as `det e create`
        does on Slurm, and return it; the user's daemon then runs it. Determined's projects and
        templates live on its master: ``project_id`` and ``template`` are refused."""
        if not isinstance(config, (str, pathlib.Path, dict)):
            raise ValueError("create_experiment(): config must be a dict or the path of a YAML file")
        if project_id is not None:
            raise ValueError("create_experiment(): detslurm has no projects; leave project_id out")
        if template is not None:
            raise ValueError(
                f"create_experiment(): template {template!r}: config templates live on Determined's master; "
                "merge the template into the config"
            )
        exp_id = self._session.create_experiment(config, model_dir, list(includes or ()))
        return Experiment(exp_id, self._session)

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
        rows = self._session.reads.experiments(self._session.owner, include_archived=True)
        configs = {d["id"]: config for d, config in rows}
        wanted = {ExperimentState(s).name for s in states} if states else None
        kept = [
            d
            for d, _ in rows
            if (experiment_ids is None or d["id"] in experiment_ids)
            and (labels is None or set(labels) & set(d["labels"] or []))
            and (users is None or d["owner"] in users)
            and (wanted is None or _state(ExperimentState, d["state"]).name in wanted)
            and (name is None or name in (d["name"] or ""))
        ]
        descending = order_by is not None and _descending(order_by)
        ordered = _sorted_experiments(kept, ExperimentSortBy.ID if sort_by is None else sort_by, descending)
        return [Experiment._of(self._session, d, configs[d["id"]]) for d in ordered]

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
        """End the session's SSH connection over ssh://; nothing to end on this machine's store."""
        self._session.close()


class Client(Determined):
    """The SDK over a given store and scope: the `det` commands' way in (root's --all-users
    scope included), and tests'."""

    def __init__(self, store: Store | None = None, scope: Scope | None = None) -> None:
        self._session = Session(store=store, scope=scope)


def _session_for(master: Optional[str]) -> Session:
    """This machine's store (``master`` None or a database URL), or a login node's (``ssh://``)."""
    if master is not None and master.startswith("ssh://"):
        from detslurm.client._remote import RemoteSession

        return RemoteSession(master)
    return Session(master)
