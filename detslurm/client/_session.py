"""The session: the store as one user sees it, which every SDK object reads and changes through.

The objects (Experiment, Trial, Checkpoint) hold a session and never the store: they read
through ``session.reads`` and change through the session's methods below, so the same objects
work on this machine's store (:class:`Session`) and on a login node's over ssh://
(``_remote.RemoteSession``, which runs these same methods there).
"""

from __future__ import annotations

import enum
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Union

import yaml

from detslurm import settings
from detslurm.cli.state_change import Verb, log_echo
from detslurm.client import _logs, _tensorboard
from detslurm.client._checkpoint import CheckpointListing, _smaller_is_better, copy_checkpoint
from detslurm.errors import ConfigError, NotFoundError, StateError
from detslurm.identity import Scope, os_user
from detslurm.protocol import ExpPaths
from detslurm.util import open_regular

if TYPE_CHECKING:
    from detslurm.cli.app import App
    from detslurm.client._checkpoint import Checkpoint
    from detslurm.store import Store
    from detslurm.store.reads import Reads

# A config as Determined's create_experiment takes it: a YAML file's path, or the config itself.
ConfigArg = Union[str, Path, dict[str, Any]]


class Edit(str, enum.Enum):
    """The experiment edits, each the controller/edit.py function of its `det e` command."""

    ARCHIVED = "set_archived"
    LABELS = "set_labels"
    DESCRIPTION = "set_description"
    NAME = "set_name"


class Session:
    """What the SDK's objects read and change through: the store (``db_url``, default the user's
    settings) limited to ``scope`` (default the calling user's own experiments)."""

    def __init__(self, db_url: str | None = None, scope: Scope | None = None, store: Store | None = None) -> None:
        self._url = db_url
        self._store = store
        self._reads: Reads | None = None
        self._app: App | None = None
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

    def close(self) -> None:
        """Nothing held here: the store's connections are the process's (kept for logout())."""

    @property
    def app(self) -> App:
        """The CLI's view of this session's store and scope, for the changes that are `det`
        commands' (cli/state_change.py): Slurm and the daemon are reached as they reach them."""
        if self._app is None:
            from detslurm.cli.app import App

            self._app = App(store=self.store, scope=self.scope)
        return self._app

    # -- experiments: the changes of the `det e` commands, through the same code ---------------
    def change_state(self, verb: Verb, exp_id: int) -> None:
        """`det e <verb>`: a kill cancels the jobs at once, a pause the queued ones, an activate
        starts the daemon; a local experiment is only marked active (`det e activate --detach`)."""
        from detslurm.cli import state_change

        state_change.change_state(self.app, Verb(verb), exp_id, detach=True, echo=_echo)

    def edit(self, change: Edit, exp_id: int, *args: Any) -> None:
        from detslurm.controller import edit

        getattr(edit, Edit(change).value)(self.store, exp_id, *args, scope=self.scope)

    def set_notes(self, exp_id: int, notes: str) -> None:
        """The experiment's notes (Determined's free text beside the description), replaced."""
        from detslurm.views import get_experiment

        if not isinstance(notes, str):
            raise TypeError(f"set_notes() takes a str, not {type(notes).__name__}")
        with self.store.tx() as s:
            get_experiment(s, exp_id, self.scope).notes = notes

    def delete_experiment(self, exp_id: int) -> None:
        from detslurm.controller import ops

        ops.delete(self.store, exp_id, self.scope)

    def delete_tensorboard_files(self, exp_id: int) -> None:
        """Remove the TensorBoard files of the experiment's trials (their `det tensorboard` dirs
        and each run's own); nothing else."""
        info, _ = self.reads.experiment(exp_id, self.owner)
        trials = self.reads.trial_dicts(exp_id, self.owner)
        runs = {t["id"]: [r["run_id"] for r in self.reads.run_dicts(t["id"])] for t in trials}
        _tensorboard.remove_files(Path(info["exp_dir"]), runs)

    def create_experiment(self, config: ConfigArg, model_dir: str | Path | None, includes: Iterable[str | Path]) -> int:
        """Create and submit an experiment as `det e create` does on Slurm (controller/create.py,
        placed by the CLI's Slurm backend), and start the daemon; its id. ``model_dir`` None: an
        empty context, as Determined sends no model definition then; ``includes`` are added to
        the context under their own names."""
        from detslurm import daemon
        from detslurm.cli.backend import SlurmBackend
        from detslurm.controller import create

        app = self.app
        with tempfile.TemporaryDirectory(prefix="detslurm-sdk-") as tmp:
            config_path = _config_file(config, Path(tmp))
            plan = create.plan_create(app.settings, config_path, _context_dir(model_dir, includes, Path(tmp)))
            exp_id = create.create(app.store, app.settings, SlurmBackend(app).place(), plan, _echo)
        assert exp_id is not None  # not a dry run
        daemon.start(app.settings)  # the daemon carries it on, as after `det e create`
        return exp_id

    def code_snapshot(self, exp_id: int) -> str:
        """Where the experiment's code snapshot lies, once checked to be a regular file."""
        with self._open_snapshot(exp_id)[0]:
            pass
        info, _ = self.reads.experiment(exp_id, self.owner)
        return str(ExpPaths(Path(info["exp_dir"])).context)

    def download_code(self, exp_id: int, dest: Path) -> None:
        """Copy the experiment's code snapshot (its context tarball) to ``dest``, replacing it."""
        f, _ = self._open_snapshot(exp_id)
        tmp = dest.with_name(f".{dest.name}.tmp")
        with f, open(tmp, "wb") as out:
            shutil.copyfileobj(f, out)
        tmp.replace(dest)

    def _open_snapshot(self, exp_id: int) -> tuple[BinaryIO, os.stat_result]:
        info, _ = self.reads.experiment(exp_id, self.owner)
        src = ExpPaths(Path(info["exp_dir"])).context
        try:
            # The snapshot lies in the experiment dir, which the trials can write: only a regular
            # file is opened, never what a link in its place names.
            opened = open_regular(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise NotFoundError("code snapshot of experiment", exp_id) from e
        if opened is None:
            raise NotFoundError("code snapshot of experiment", exp_id)
        return opened

    # -- listings: one read each, whatever their length (over ssh:// a read is a call) --------
    def checkpoint_listing(self, exp_id: int, trial_id: int | None, metric: str | None) -> CheckpointListing:
        """The experiment's checkpoints (``trial_id``: that trial's only), the searcher's
        direction, and with ``metric`` each completed one's value of that validation metric."""
        reads, owner = self.reads, self.owner
        infos = reads.checkpoint_dicts(exp_id, owner)  # NotFoundError for another user's
        if trial_id is not None:
            infos = [i for i in infos if i["trial_id"] == trial_id]
        smaller = _smaller_is_better(reads.experiment(exp_id, owner)[1])
        done = [i["uuid"] for i in infos if i["state"] == "COMPLETED"]
        values = {uuid: reads.validation_metric(uuid, metric) for uuid in done} if metric is not None else {}
        return CheckpointListing(infos, smaller, values)

    # -- trials ----------------------------------------------------------------------------
    def kill_trial(self, trial_id: int) -> None:
        """`det t kill`: the trial's live job is canceled at once."""
        from detslurm.cli import state_change

        state_change.kill_trial(self.app, trial_id, _echo)

    def trial_log_lines(self, trial_id: int, options: Mapping[str, Any]) -> Iterator[str]:
        return _logs.log_lines(self, trial_id, options)

    # -- checkpoints -----------------------------------------------------------------------
    def set_checkpoint_metadata(self, uuid: str, metadata: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's stored metadata replaced by ``metadata`` (its owner only); what was stored."""
        from detslurm.store.models import Trial as TrialRow
        from detslurm.views import get_checkpoint

        try:
            stored: dict[str, Any] = json.loads(json.dumps(metadata))
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint {uuid}: the metadata must be JSON-serializable ({e})") from None
        with self.store.tx() as s:
            ck = get_checkpoint(s, uuid, self.scope)
            trial = s.get(TrialRow, ck.trial_id)
            if trial is None or trial.experiment.owner != os_user():
                raise StateError(f"checkpoint {uuid} is not yours; only its owner can change its metadata")
            ck.metadata_ = stored
        return stored

    def delete_checkpoint(self, uuid: str) -> None:
        from detslurm.controller import ckpt_ops

        ckpt_ops.delete_checkpoints(self.store, [uuid], self.scope)

    def remove_checkpoint_files(self, uuid: str, globs: Sequence[str]) -> None:
        from detslurm.controller import ckpt_ops

        ckpt_ops.remove_files(self.store, [uuid], list(globs), self.scope)

    def download_checkpoint(self, checkpoint: Checkpoint, dst: Path | None) -> Path:
        """Copy the checkpoint's checked directory into ``dst`` (default ``./checkpoints/<uuid>``),
        a new or empty directory; the path written."""
        return copy_checkpoint(checkpoint, dst)


def _context_dir(model_dir: str | Path | None, includes: Iterable[str | Path], tmp: Path) -> Path:
    """The experiment's code: ``model_dir`` (None: an empty dir) with ``includes`` staged
    beside its files under their own names, as `det e create --include` stages them."""
    from detslurm.cli.context_include import stage_context

    if model_dir is None:
        context = tmp / "context"
        context.mkdir()
    else:
        context = Path(model_dir)
    extra = tuple(Path(i) for i in includes)
    return stage_context(context, extra, tmp / "staged" / context.resolve().name) if extra else context


def _config_file(config: ConfigArg, tmp: Path) -> Path:
    """The config as a file plan_create reads: a path as given, a dict written as YAML."""
    if not isinstance(config, dict):
        return Path(config)
    path = tmp / "config.yaml"
    try:
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    except yaml.YAMLError as e:
        raise ConfigError([f"the config dict cannot be written as YAML: {e}"]) from None
    return path


# What `det` would print (the create's lines, the jobs a kill canceled) goes to the log: the SDK
# prints nothing.
_echo = log_echo("detslurm.client")
