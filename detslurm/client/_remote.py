"""The SDK over ssh:// : ``Determined(master="ssh://user@login")`` reads and changes the login
node's store through remote mode's connection (cli/remote: the same URL, ~/.ssh/config,
host-key checks and connection holder as `det -m ssh://...`).

Each read and each change is one call of the hidden `det sdk-call` on the login node (a JSON
request on its stdin, a JSON answer on its stdout), which runs it there with a local
:class:`~detslurm.client._session.Session` of the ssh user: the objects and their checks are the
same on both sides, and the scope is always the login node's own user, whatever the request says.
A listing is one call whatever its length (the objects are made from its rows). A checkpoint's
files and an experiment's code snapshot come back over SFTP, and create_experiment's code goes
up, as `det -m ssh://...` copies them (cli/remote/transfer.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detslurm.cli.state_change import Verb
from detslurm.client._checkpoint import CheckpointListing
from detslurm.client._session import ConfigArg, Edit, Session, _config_file, _context_dir
from detslurm.errors import ConfigError, DetSlurmError, NotFoundError, StateError

if TYPE_CHECKING:
    from detslurm.client._checkpoint import Checkpoint
    from detslurm.store import Store

# The hidden `det` command that answers (cli/sdk.py); `det -m ssh://... sdk-call` would reach it too.
COMMAND = "sdk-call"


# -- the wire: JSON with datetimes, enums as their values, errors by kind -------------------------
def encode(value: Any) -> Any:
    if isinstance(value, datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return getattr(value, "value", value)  # an enum (the store's states) as its value


def decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$datetime"}:
            return datetime.fromisoformat(value["$datetime"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def error_answer(e: Exception) -> dict[str, Any]:
    """An error the caller's side raises again as the same kind, with the same message."""
    if isinstance(e, NotFoundError):
        return {"error": "not_found", "kind": e.kind, "ident": encode(e.ident)}
    if isinstance(e, ConfigError):
        return {"error": "config", "errors": e.errors, "source": e.source}
    kinds = ((StateError, "state"), (DetSlurmError, "detslurm"), (ValueError, "value"), (TypeError, "type"))
    return {"error": next(k for cls, k in kinds if isinstance(e, cls)), "message": str(e)}


ANSWERED = (DetSlurmError, ValueError, TypeError)


def raise_error(answer: Mapping[str, Any]) -> None:
    kind = answer["error"]
    if kind == "not_found":
        raise NotFoundError(answer["kind"], answer["ident"])
    if kind == "config":
        raise ConfigError(answer["errors"], answer["source"])
    cls: type[Exception] = {"state": StateError, "value": ValueError, "type": TypeError}.get(kind, DetSlurmError)
    raise cls(answer["message"])


# -- the login node's side -----------------------------------------------------------------------
def _reads_call(name: str) -> Callable[..., Any]:
    """A read of ``Reads`` with the owner filled in from the login node's session."""

    def call(session: Session, *args: Any) -> Any:
        reads, owner = session.reads, session.owner
        if name == "metrics":
            reads.trial(args[0], owner)  # the scope check: another user's trial is "not found"
            return reads.metrics(args[0])
        if name == "experiments":
            return reads.experiments(owner, *args)
        return getattr(reads, name)(*args, owner)

    return call


def _location(session: Session, uuid: str) -> str:
    """`det checkpoint locate-for-download`'s answer: the checked directory a download copies."""
    from detslurm.client._checkpoint import Checkpoint

    ck = Checkpoint(session, uuid)
    return json.dumps({"uuid": ck.uuid, "directory": str(ck.checked_source())})


# Every call a request may name: the reads the SDK's objects make, and the session's changes.
CALLS: dict[str, Callable[..., Any]] = {
    **{
        f"reads.{name}": _reads_call(name)
        for name in ("experiment", "experiments", "trial", "trial_dicts", "first_trial_id", "metrics", "checkpoint")
    },
    "checkpoint_listing": Session.checkpoint_listing,
    "change_state": lambda s, verb, exp_id: s.change_state(Verb(verb), exp_id),
    "edit": lambda s, change, exp_id, *args: s.edit(Edit(change), exp_id, *args),
    "set_notes": Session.set_notes,
    "delete_experiment": Session.delete_experiment,
    "delete_tensorboard_files": Session.delete_tensorboard_files,
    "code_snapshot": Session.code_snapshot,
    "create_experiment": Session.create_experiment,
    "kill_trial": Session.kill_trial,
    "trial_log_lines": lambda s, trial_id, options: list(s.trial_log_lines(trial_id, options)),
    "set_checkpoint_metadata": Session.set_checkpoint_metadata,
    "delete_checkpoint": Session.delete_checkpoint,
    "remove_checkpoint_files": Session.remove_checkpoint_files,
    "checkpoint_location": _location,
}


def serve(request_text: str, session: Session) -> str:
    """The answer to one request, as JSON: ``{"ok": value}`` or an error of a known kind."""
    try:
        request = json.loads(request_text)
        if not isinstance(request, dict):
            request = {}
        call, args = CALLS.get(str(request.get("call"))), request.get("args")
        if call is None or not isinstance(args, list):
            raise DetSlurmError(f"{COMMAND}: not a request this detslurm answers: {request_text[:200]!r}")
        return json.dumps({"ok": encode(call(session, *decode(args)))})
    except ANSWERED as e:  # bad JSON too (a ValueError)
        return json.dumps(error_answer(e))


# -- the caller's side ---------------------------------------------------------------------------
class RemoteReads:
    """The reads of ``Reads`` the SDK's objects make, answered by the login node (the ``owner``
    arguments are ignored: the login node's session has its own)."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call

    def experiment(self, exp_id: int, owner: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        info, config = self._call("reads.experiment", exp_id)
        return info, config

    def experiments(
        self, owner: str | None, include_archived: bool = False
    ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return [(info, config) for info, config in self._call("reads.experiments", include_archived)]

    def trial(self, trial_id: int, owner: str | None) -> dict[str, Any]:
        return dict(self._call("reads.trial", trial_id))

    def trial_dicts(self, exp_id: int, owner: str | None) -> list[dict[str, Any]]:
        return list(self._call("reads.trial_dicts", exp_id))

    def first_trial_id(self, exp_id: int, owner: str | None) -> int | None:
        found = self._call("reads.first_trial_id", exp_id)
        return None if found is None else int(found)

    def metrics(self, trial_id: int) -> list[dict[str, Any]]:
        return list(self._call("reads.metrics", trial_id))

    def checkpoint(self, uuid: str, owner: str | None) -> dict[str, Any]:
        return dict(self._call("reads.checkpoint", uuid))


class RemoteSession(Session):
    """A session whose store is the login node's, reached over ssh:// (see the module docstring)."""

    def __init__(self, url: str) -> None:
        from detslurm.cli.remote.target import load_remote_settings, parse_url

        super().__init__()
        self.url = url
        self._target = parse_url(url)  # a bad URL fails here, at login()
        self._rs = load_remote_settings(os.environ)
        self._conn: Any = None
        self._remote_reads = RemoteReads(self._call)

    @property
    def store(self) -> Store:
        raise DetSlurmError(f"client: the store of {self.url} is on the login node; this session has none here")

    @property
    def reads(self) -> Any:
        return self._remote_reads

    def close(self) -> None:
        """End the SSH connection (a held one stays for later commands, as `det -m` leaves it)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self) -> Any:
        from detslurm.cli.remote import holder

        if self._conn is None:
            self._conn = holder.connection(self._target, self._rs)
        return self._conn

    def _call(self, name: str, *args: Any) -> Any:
        from detslurm.cli.remote.channel import collect
        from detslurm.cli.remote.command import remote_command
        from detslurm.cli.remote.target import RemoteError

        request = json.dumps({"call": name, "args": encode(list(args))})
        try:
            chan = self._connection().open_exec(remote_command(self._target, self._rs, [COMMAND]))
            chan.sendall(request.encode())
            chan.shutdown_write()
            code, out, err = collect(chan)
        except (OSError, EOFError) as e:
            raise RemoteError(f"client ({self.url}): {e}") from None
        try:
            answer = json.loads(out) if code == 0 else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise RemoteError(f"client ({self.url}): `det {COMMAND}` on the login node failed: {(err or out).strip()}")
        if "error" in answer:
            raise_error(answer)
        return decode(answer.get("ok"))

    # -- changes: the same session methods, run on the login node -------------------------
    def change_state(self, verb: Verb, exp_id: int) -> None:
        self._call("change_state", Verb(verb).value, exp_id)

    def edit(self, change: Edit, exp_id: int, *args: Any) -> None:
        self._call("edit", Edit(change).value, exp_id, *args)

    def set_notes(self, exp_id: int, notes: str) -> None:
        self._call("set_notes", exp_id, notes)

    def delete_experiment(self, exp_id: int) -> None:
        self._call("delete_experiment", exp_id)

    def delete_tensorboard_files(self, exp_id: int) -> None:
        self._call("delete_tensorboard_files", exp_id)

    def download_code(self, exp_id: int, dest: Path) -> None:
        """The login node checks the snapshot and names it; it comes back over SFTP, checked
        again here (cli/remote/transfer.py)."""
        import detslurm.cli.remote.transfer as transfer

        transfer.fetch_file(self._connection(), str(self._call("code_snapshot", exp_id)), dest)

    def create_experiment(self, config: ConfigArg, model_dir: str | Path | None, includes: Iterable[str | Path]) -> int:
        """As `det -m ssh://... e create`: the code and the config go to the login node's upload
        cache (only the files it lacks, cli/remote/transfer.py), and the login node creates the
        experiment from them as its own `det e create` would."""
        import detslurm.cli.remote.transfer as transfer
        from detslurm import context

        conn = self._connection()
        with tempfile.TemporaryDirectory(prefix="detslurm-sdk-") as tmp:
            config_path = _config_file(config, Path(tmp))
            bundle = context.package(_context_dir(model_dir, includes, Path(tmp)))
            tree, _, _ = transfer.upload_context(conn, bundle)
            remote_config = transfer.upload_config(conn, config_path)
        return int(self._call("create_experiment", remote_config, tree, []))

    def checkpoint_listing(self, exp_id: int, trial_id: int | None, metric: str | None) -> CheckpointListing:
        infos, smaller, values = self._call("checkpoint_listing", exp_id, trial_id, metric)
        return CheckpointListing(infos, bool(smaller), values)

    def kill_trial(self, trial_id: int) -> None:
        self._call("kill_trial", trial_id)

    def trial_log_lines(self, trial_id: int, options: Mapping[str, Any]) -> Iterator[str]:
        return iter(self._call("trial_log_lines", trial_id, dict(options)))

    def set_checkpoint_metadata(self, uuid: str, metadata: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call("set_checkpoint_metadata", uuid, metadata))

    def delete_checkpoint(self, uuid: str) -> None:
        self._call("delete_checkpoint", uuid)

    def remove_checkpoint_files(self, uuid: str, globs: Iterable[str]) -> None:
        self._call("remove_checkpoint_files", uuid, list(globs))

    def download_checkpoint(self, checkpoint: Checkpoint, dst: Path | None) -> Path:
        """The login node checks the checkpoint and names its directory; its files come back
        over SFTP, checked again here (cli/remote/transfer.py)."""
        import detslurm.cli.remote.transfer as transfer

        answer = self._call("checkpoint_location", checkpoint.uuid)
        path, _, _, _ = transfer.fetch_checkpoint(self._connection(), str(answer), dst)
        return path
