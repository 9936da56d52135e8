"""Detached runs: a user's own script (their sbatch, srun, torchrun) tracked through core_v2.

The one owner of where a detached run's files live and what its records say. The in-job side
(``detslurm.core.v2``) registers a run by creating its dir and writing :class:`DetachedRun`;
it appends the same typed events as a managed trial (``events/rank-0.jsonl``) and ends with a
:class:`RunClosed`. The login side (``detslurm.controller.detached``) finds runs with one
directory scan (:func:`scan`) and ingests them; no connection ever goes to the login node.

Layout, below ``<experiments_dir>/detached/`` (mode 0700, ours)::

    .key                                   random HMAC key, 0600
    e-<hmac(external experiment id)>/      one experiment
      trials/<int(hmac(external trial id))>/
        latest_checkpoint.json             LatestCheckpoint: what a rerun resumes from
        runs/<n>/                          one run per start (requeue, re-run): RunPaths
          detached.json closed.json events/rank-0.jsonl

Names come from an HMAC under a private key, never from the ids themselves: default ids are
Slurm job ids, public in squeue, and a name anyone can compute is a name anyone can pre-create
(or symlink) where the parent is shared; an id is also user text that must not shape a path.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detslurm.protocol import _check as c
from detslurm.protocol._check import BadRecord
from detslurm.protocol.paths import RunPaths
from detslurm.protocol.records import read_record
from detslurm.util import DETACHED_DIR as DETACHED_DIR
from detslurm.util import atomic_write_json
from detslurm.util import detached_root as detached_root

KEY_FILE = ".key"
REGISTRATION = "detached.json"
CLOSED = "closed.json"
LATEST = "latest_checkpoint.json"
MAX_ID = 256  # characters of an external id
_KEY_BYTES = 32
# 12 hex digits: a trial key well inside a 64-bit int, with collisions out of reach.
_TRIAL_HEX = 12
CLOSE_STATES = ("COMPLETED", "ERROR", "STOPPED")


class DetachedError(RuntimeError):
    """The detached dir cannot be used safely (not ours, not private, unreadable)."""


def check_private_dir(path: Path) -> None:
    """``path`` is a real directory (no symlink) owned by us and closed to others."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise DetachedError(f"cannot use {path}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise DetachedError(f"{path} is not a directory owned by you: refusing to keep detached runs there")
    if st.st_mode & 0o077:
        raise DetachedError(f"{path} is open to other users (mode {st.st_mode & 0o777:o}); chmod 700 it")


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) 0700, then check it as :func:`check_private_dir`."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Created, then checked whatever happened: an existing dir must pass the same checks.
    try:
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # the umask may have taken bits; never more than 0700 either way
    except FileExistsError:
        pass
    check_private_dir(path)


def _read_key(path: Path) -> bytes:
    # O_NOFOLLOW and fstat on the open file: what is checked is what is read.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise DetachedError(f"{path} is not private to you: delete it and run again")
        text = f.read(4 * _KEY_BYTES).decode("ascii", "replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise DetachedError(f"{path} does not hold a key; delete it and run again") from None
    if len(key) != _KEY_BYTES:
        raise DetachedError(f"{path} does not hold a {_KEY_BYTES}-byte key; delete it and run again")
    return key


def load_key(root: Path) -> bytes:
    """The root's naming key, created on first use. Many jobs start at once (an array): the key
    is written under a random name and linked into place, so exactly one writer wins and every
    job reads the winner's key."""
    path = root / KEY_FILE
    if not path.exists():
        tmp = root / f".key.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_bytes(_KEY_BYTES).hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            # Another job may win the race: then its key is the one every job reads.
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    return _read_key(path)


# NUL-separated: no two different (experiment, trial) pairs can join into the same message.
def _digest(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\x00".join(parts).encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class DetachedLayout:
    """Paths of detached runs below one root, named through the root's key."""

    root: Path
    key: bytes = field(repr=False)

    @classmethod
    def open(cls, root: Path) -> DetachedLayout:
        """The layout at ``root``, creating the private root and its key if needed."""
        ensure_private_dir(root)
        return cls(root, load_key(root))

    def exp_dir(self, external_experiment_id: str) -> Path:
        return self.root / f"e-{_digest(self.key, 'experiment', external_experiment_id)[:24]}"

    def trial_key(self, external_experiment_id: str, external_trial_id: str) -> int:
        return int(_digest(self.key, "trial", external_experiment_id, external_trial_id)[:_TRIAL_HEX], 16)

    def trial_dir(self, external_experiment_id: str, external_trial_id: str) -> Path:
        key = self.trial_key(external_experiment_id, external_trial_id)
        return self.exp_dir(external_experiment_id) / "trials" / str(key)


def allocate_run(exp_dir: Path, trial_key: int) -> RunPaths:
    """A fresh run dir for the trial: the next number, taken with an exclusive mkdir, so two
    starts of one trial (a requeue racing a re-run) never share a dir."""
    runs = exp_dir / "trials" / str(trial_key) / "runs"
    # Level by level: mkdir(parents=True) gives the parents it makes the umask's mode (0755), not
    # 0700. The private root already closes them; each level closed too keeps a run private if
    # the root's mode is ever loosened by hand.
    for d in (exp_dir, exp_dir / "trials", runs.parent, runs):
        d.mkdir(exist_ok=True, mode=0o700)
    for _ in range(1000):
        taken = [int(n) for n in os.listdir(runs) if n.isdigit()]
        run = max(taken, default=0) + 1
        try:
            (runs / str(run)).mkdir(mode=0o700)
        except FileExistsError:
            continue  # another start took it between the listing and the mkdir: next number
        return RunPaths(exp_dir, trial_key, run)
    raise DetachedError(f"could not allocate a run dir in {runs}")


def registration(paths: RunPaths) -> Path:
    return paths.dir / REGISTRATION


def closed(paths: RunPaths) -> Path:
    return paths.dir / CLOSED


def latest_file(paths: RunPaths) -> Path:
    return paths.trial_dir / LATEST


def _ext_id(value: Any, key: str) -> str:
    s = c.text(value, key, MAX_ID)
    if not s:
        raise BadRecord(f"{key!r} is empty")
    return s


@dataclass(frozen=True)
class DetachedRun:
    """In-job -> login: a run of a user's own script, written once when core_v2 starts it."""

    external_experiment_id: str
    external_trial_id: str
    name: str
    checkpoint_base: str
    description: str | None = None
    labels: tuple[str, ...] = ()
    hparams: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    searcher_metric: str | None = None
    smaller_is_better: bool = True
    # The Slurm job (``123`` or ``123_4`` for an array task), "" outside Slurm; host and pid
    # let the login side tell a plain process that died from one still running.
    job_id: str = ""
    host: str = ""
    pid: int = 0
    start: float = 0.0

    def encode(self) -> dict[str, Any]:
        # Versioned like the events: a future field change is refused by an older reader, not misread.
        out = dict(self.__dict__)
        out["labels"] = list(self.labels)
        out["v"] = 1
        return out

    def write(self, paths: RunPaths) -> None:
        atomic_write_json(registration(paths), self.encode())

    @classmethod
    def decode(cls, value: Any) -> DetachedRun:
        # Written in the job, so untrusted: every field checked, bounded, typed (never a KeyError).
        if not isinstance(value, dict):
            raise BadRecord("the detached run record must be a JSON object")
        d = value
        try:
            labels = d.get("labels", [])
            if not isinstance(labels, list):
                raise BadRecord("'labels' must be a list")
            metric = d.get("searcher_metric")
            description = d.get("description")
            return cls(
                external_experiment_id=_ext_id(c.req(d, "external_experiment_id"), "external_experiment_id"),
                external_trial_id=_ext_id(c.req(d, "external_trial_id"), "external_trial_id"),
                name=c.text(c.req(d, "name"), "name", 512) or "detached",
                checkpoint_base=c.text(c.req(d, "checkpoint_base"), "checkpoint_base"),
                description=None if description is None else c.text(description, "description"),
                labels=tuple(c.text(x, "labels[]", 256) for x in labels),
                hparams=c.mapping(d.get("hparams", {}), "hparams"),
                data=c.mapping(d.get("data", {}), "data"),
                searcher_metric=None if metric is None else c.text(metric, "searcher_metric", 256),
                smaller_is_better=bool(d.get("smaller_is_better", True)),
                job_id=c.text(d.get("job_id", ""), "job_id", 64),
                host=c.text(d.get("host", ""), "host", 256),
                pid=c.integer(d.get("pid", 0), "pid", hi=c.INT32_MAX),
                start=c.number(d.get("start", 0.0), "start"),
            )
        except BadRecord as e:
            raise BadRecord(f"detached run record: {e.reason}") from None

    @classmethod
    def read(cls, paths: RunPaths) -> DetachedRun | None:
        value = read_record(registration(paths))
        return None if value is None else cls.decode(value)


@dataclass(frozen=True)
class RunClosed:
    """In-job -> login: how the script ended (core_v2.close); absent when it was killed."""

    state: str  # one of CLOSE_STATES; STOPPED: it acknowledged a preemption and exited
    message: str = ""
    time: float = 0.0

    def write(self, paths: RunPaths) -> None:
        atomic_write_json(closed(paths), {"v": 1, "state": self.state, "message": self.message, "time": self.time})

    @classmethod
    def read(cls, paths: RunPaths) -> RunClosed | None:
        value = read_record(closed(paths))
        if value is None:
            return None
        if not isinstance(value, dict):
            raise BadRecord("the close record must be a JSON object")
        state = c.text(value.get("state"), "state", 16)
        if state not in CLOSE_STATES:
            raise BadRecord(f"close record: unknown state {state[:16]!r}")
        return cls(state, c.text(value.get("message", ""), "message"), c.number(value.get("time", 0.0), "time"))


@dataclass(frozen=True)
class LatestCheckpoint:
    """In-job only: the trial's newest checkpoint, so a rerun resumes without the store."""

    uuid: str
    steps_completed: int
    storage_path: str

    def write(self, paths: RunPaths) -> None:
        atomic_write_json(latest_file(paths), dict(self.__dict__))

    @classmethod
    def read(cls, paths: RunPaths) -> LatestCheckpoint | None:
        value = read_record(latest_file(paths))
        if not isinstance(value, dict):
            return None
        return cls(
            c.uuid(value.get("uuid")),
            c.integer(value.get("steps_completed", 0), "steps_completed"),
            c.text(value.get("storage_path", ""), "storage_path"),
        )


def scan(root: Path) -> Iterator[RunPaths]:
    """Every registered run below ``root``: one pass of directory listings, no file read.
    Anything not shaped like our layout is skipped (it is not ours)."""
    for exp in _subdirs(root, lambda n: n.startswith("e-")):
        for trial in _subdirs(exp / "trials", str.isdigit):
            for run in _subdirs(trial / "runs", str.isdigit):
                paths = RunPaths(exp, int(trial.name), int(run.name))
                if registration(paths).is_file():
                    yield paths


def _subdirs(path: Path, keep: Any) -> list[Path]:
    # No symlinks followed: a link planted in a run tree would point the scan (and ingest) elsewhere.
    try:
        entries = list(os.scandir(path))
    except OSError:
        return []
    return sorted(
        (Path(e.path) for e in entries if keep(e.name) and e.is_dir(follow_symlinks=False)),
        key=lambda p: (len(p.name), p.name),
    )
