"""A small Python client over the store, in the shape of Determined's experimental client.

from detslurm import client
ckpt = client.get_checkpoint(uuid)
path = ckpt.download()
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from detslurm import settings, views
from detslurm.errors import NotFoundError, StateError
from detslurm.store import Store, open_store
from detslurm.store.models import Checkpoint as CheckpointRow


class Checkpoint:
    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        self.uuid: str = info["uuid"]
        self.metadata: dict[str, Any] = info["metadata"]
        self.state: str = info["state"]

    def download(self, path: Path | None = None) -> Path:
        if self.state != "COMPLETED":
            raise StateError(f"checkpoint {self.uuid} is {self.state}; only COMPLETED checkpoints can be downloaded")
        dst = Path(path) if path is not None else Path("checkpoints") / self.uuid
        src = Path(self.info["storage_path"])
        if not src.is_dir():
            raise NotFoundError("checkpoint files for", self.uuid)
        shutil.copytree(src, dst, dirs_exist_ok=True)
        return dst


class Trial:
    def __init__(self, client: Client, info: dict[str, Any]) -> None:
        self._client = client
        self.info = info
        self.id: int = info["id"]
        self.hparams: dict[str, Any] = info["hparams"]

    def list_checkpoints(self) -> list[Checkpoint]:
        with self._client.store.tx() as s:
            rows = (
                s.query(CheckpointRow)
                .filter(CheckpointRow.trial_id == self.id)
                .order_by(CheckpointRow.steps_completed)
                .all()
            )
            return [Checkpoint(views.checkpoint_dict(s, r)) for r in rows]

    def latest_checkpoint(self) -> Checkpoint | None:
        done = [c for c in self.list_checkpoints() if c.state == "COMPLETED"]
        return done[-1] if done else None


class Client:
    def __init__(self, store: Store | None = None) -> None:
        self.store = store or open_store(settings.load().db_url)

    def get_checkpoint(self, uuid: str) -> Checkpoint:
        with self.store.tx() as s:
            row = s.get(CheckpointRow, uuid)
            if row is None:
                raise NotFoundError("checkpoint", uuid)
            return Checkpoint(views.checkpoint_dict(s, row))

    def get_trial(self, trial_id: int) -> Trial:
        with self.store.tx() as s:
            return Trial(self, views.trial_dict(s, views.get_trial(s, trial_id)))

    def get_experiment_trials(self, exp_id: int) -> list[Trial]:
        with self.store.tx() as s:
            return [Trial(self, views.trial_dict(s, t)) for t in views.get_experiment(s, exp_id).trials]


_default: Client | None = None


def _client() -> Client:
    global _default
    if _default is None:
        _default = Client()
    return _default


def get_checkpoint(uuid: str) -> Checkpoint:
    return _client().get_checkpoint(uuid)


def get_trial(trial_id: int) -> Trial:
    return _client().get_trial(trial_id)
