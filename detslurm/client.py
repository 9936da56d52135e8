"""A small Python client over the store, in the shape of Determined's experimental client.

from detslurm import client
ckpt = client.get_checkpoint(uuid)
path = ckpt.download()

It sees only the calling user's experiments (a shared store holds other users' too).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from detslurm import settings, views
from detslurm.controller.gc import checkpoint_dir, valid_checkpoint_uuid
from detslurm.errors import DetSlurmError, NotFoundError, StateError
from detslurm.identity import Scope
from detslurm.store import Store, open_store

# Where `download()` puts a checkpoint when no path is given: ./checkpoints/<uuid>.
DEFAULT_DOWNLOAD_DIR = Path("checkpoints")


class Checkpoint:
    def __init__(self, info: dict[str, Any], source: Path | None) -> None:
        self.info = info
        self.uuid: str = info["uuid"]
        self.metadata: dict[str, Any] = info["metadata"]
        self.state: str = info["state"]
        # <storage base>/<uuid>, checked to lie under the base; None when the uuid cannot name
        # a directory there. The storage_path the trial reported is never copied from.
        self._source = source

    def download(self, path: Path | None = None) -> Path:
        """Copy the checkpoint to ``path`` (default ``./checkpoints/<uuid>``); the path written."""
        # The uuid is a store value the trial reported: checked again here because it becomes a
        # directory name on the caller's machine (a "../x" uuid would write outside checkpoints/).
        if not valid_checkpoint_uuid(self.uuid):
            raise DetSlurmError(
                f"checkpoint uuid {self.uuid!r} is not a valid checkpoint id (letters, digits, '.', '_', '-'; "
                "no path separators); refusing to use it as a directory name"
            )
        # A partial or deleted checkpoint's files are missing or half written; restoring from
        # them would fail later and far from the cause.
        if self.state != "COMPLETED":
            raise StateError(f"checkpoint {self.uuid} is {self.state}; only COMPLETED checkpoints can be downloaded")
        dst = Path(path) if path is not None else _default_destination(self.uuid)
        src = self._source
        # is_symlink: a link in the checkpoint's place (to another experiment's, say) is not it.
        if src is None or src.is_symlink() or not src.is_dir():
            raise NotFoundError("checkpoint files for", self.uuid)
        # symlinks=True: a link the trial left in its checkpoint is copied as a link, never followed
        # to read (and copy out) whatever file it names.
        shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
        return dst


def _default_destination(uuid: str) -> Path:
    """``./checkpoints/<uuid>``, checked to stay directly under ./checkpoints."""
    base = DEFAULT_DOWNLOAD_DIR.resolve()
    # resolve() so that a checkpoints/<uuid> symlink pointing elsewhere is caught too.
    dst = (base / uuid).resolve()
    if dst.parent != base:
        raise DetSlurmError(f"checkpoint uuid {uuid!r} would be written outside {base}; refusing to download it")
    return DEFAULT_DOWNLOAD_DIR / uuid


def _source(s: Session, trial_id: int, uuid: str, scope: Scope) -> Path | None:
    # Through get_trial so the scope check applies: a uuid alone must not reach another user's files.
    return checkpoint_dir(views.get_trial(s, trial_id, scope).experiment, uuid)


class Trial:
    def __init__(self, client: Client, info: dict[str, Any]) -> None:
        self._client = client
        self.info = info
        self.id: int = info["id"]
        self.hparams: dict[str, Any] = info["hparams"]

    def list_checkpoints(self) -> list[Checkpoint]:
        with self._client.store.read() as s:
            rows = views.trial_checkpoints(s, self.id, self._client.scope)
            return [
                Checkpoint(views.checkpoint_dict(s, r), _source(s, r.trial_id, r.uuid, self._client.scope))
                for r in rows
            ]

    def latest_checkpoint(self) -> Checkpoint | None:
        # list_checkpoints is ordered by steps_completed, so the last completed one is the latest.
        done = [c for c in self.list_checkpoints() if c.state == "COMPLETED"]
        return done[-1] if done else None


class Client:
    """The store as one user sees it (``scope`` default: the calling user's own experiments)."""

    def __init__(self, store: Store | None = None, scope: Scope | None = None) -> None:
        # Opened from the user's settings when not given: Determined's client finds its master the
        # same way (config, not arguments), so user scripts need no setup.
        self.store = store or open_store(settings.load().db_url)
        self.scope = scope or Scope.mine()

    def get_checkpoint(self, uuid: str) -> Checkpoint:
        with self.store.read() as s:
            row = views.get_checkpoint(s, uuid, self.scope)
            return Checkpoint(views.checkpoint_dict(s, row), _source(s, row.trial_id, row.uuid, self.scope))

    def get_trial(self, trial_id: int) -> Trial:
        with self.store.read() as s:
            return Trial(self, views.trial_dict(s, views.get_trial(s, trial_id, self.scope)))

    def get_experiment_trials(self, exp_id: int) -> list[Trial]:
        with self.store.read() as s:
            return [Trial(self, views.trial_dict(s, t)) for t in views.get_experiment(s, exp_id, self.scope).trials]


# The module-level functions share one client, made on first call, like Determined's
# `client.get_checkpoint` after `client.login()`; importing this module opens nothing.
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
