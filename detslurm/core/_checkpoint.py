"""Checkpoints on a shared filesystem, written atomically (contract 5).

A checkpoint is written into ``<base>/.<uuid>.partial`` and renamed to ``<base>/<uuid>`` only
when complete, after ``metadata.json``; a crash mid-write leaves the previous checkpoint as the
latest usable one. Sharded checkpoints: every rank writes into the same partial directory.

Private by default (docs/design/security.md): checkpoints hold weights and pickles that the Trainer
loads on restart, so a base dir we create is 0700 and every checkpoint is 0700 dirs and 0600
files (0700 where the owner may execute), whatever the umask. A base that already exists keeps
its mode (a group project dir set up on purpose). To share checkpoints with the group, set
``DETSLURM_CHECKPOINT_SHARE=group`` (e.g. in ``environment.environment_variables``): the group
may then read them (0750/0640), never write them, since a writable pickle runs as the owner.

Before the rename every file and directory is fsynced, so the rename cannot reach the disk
before the data on a node crash; large files start going to disk while they are written
(``_writeback``), so that fsync waits only for their tail. Partial dirs left by a killed writer
are swept by the next writer on the same base once they are :data:`STALE_PARTIAL_AFTER_S` old
and ours.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import logging
import os
import re
import shutil
import stat
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

from detslurm import settings
from detslurm.ckpt_settings import Modes, checkpoint_modes, early_writeback
from detslurm.core._distributed import DistributedContext
from detslurm.core._writeback import EarlyWriteback
from detslurm.errors import CheckpointNotFound
from detslurm.protocol.ckmark import MARKER_NAME, write_mark
from detslurm.protocol.events import CheckpointDeleted, CheckpointSaved, Event
from detslurm.protocol.secret import RunSecretError, read_run_secret

log = logging.getLogger("detslurm.core")
STALE_PARTIAL_AFTER_S = 6 * 3600
_PARTIAL = re.compile(r"^\.[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\.partial$")


def ensure_base(base: Path, modes: Modes) -> None:
    """Create ``base`` and any missing parents with the private dir mode; existing dirs keep theirs."""
    if base.is_dir():  # the usual case, once per checkpoint: one stat
        return
    missing = [p for p in (base, *base.parents) if not p.exists()]
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another rank or trial made it meanwhile
            p.mkdir(mode=modes.dir)
            os.chmod(p, modes.dir)  # the umask may have cleared bits the share mode wants
            # The new name is durable too: after a node crash the base and the checkpoints
            # renamed into it must not vanish with an unsynced parent entry. Best effort: a
            # parent we may enter but not read (0711) cannot be opened to sync.
            with contextlib.suppress(PermissionError):
                _fsync_dir(str(p.parent))


def _fsync_dir(path: str) -> None:
    """fsync a directory named by the user or made by us (the base and its parents). Symlinks
    are followed: a base such as ``~/ckpts -> /lustre/...`` is a common choice on clusters."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        _fsync(fd)
    finally:
        os.close(fd)


_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW
# What an entry's open may answer when the trial swapped it meanwhile (a symlink, a socket, a
# FIFO's or device's no-reader, gone, a dir): it is then not a file of the checkpoint's.
_SWAPPED = {errno.ELOOP, errno.ENXIO, errno.ENOENT, errno.EISDIR, errno.ENOTDIR}


def _fsync(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems cannot fsync a directory (or anything)
        if e.errno not in (errno.EINVAL, errno.EROFS):
            raise


def _open_entry(name: str, dir_fd: int) -> Optional[int]:
    """A descriptor for the file ``name`` of ``dir_fd``; None for one swapped for something else.
    A file the trial left unreadable to itself (mode 0200) is opened for writing instead: its
    mode is then set through that descriptor, never by a path."""
    for access in (os.O_RDONLY, os.O_WRONLY):
        try:
            return os.open(name, access | _NOFOLLOW, dir_fd=dir_fd)
        except OSError as e:
            if e.errno in _SWAPPED:
                return None
            if e.errno != errno.EACCES or access == os.O_WRONLY:
                raise
    return None  # not reached: the second try returns or raises


def _sync_file(name: str, dir_fd: int, modes: Optional[Modes]) -> None:
    """fsync one entry through one descriptor, setting its mode on the way. Type and mode come
    from that descriptor, never from a path looked up again: a FIFO swapped in neither blocks
    the open (O_NONBLOCK) nor gets synced; anything but a regular file is left alone."""
    fd = _open_entry(name, dir_fd)
    if fd is None:
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return
        if modes is not None:
            os.fchmod(fd, modes.exe if st.st_mode & 0o100 else modes.file)
        _fsync(fd)
    finally:
        os.close(fd)


def _named(e: OSError, where: str, name: str) -> OSError:
    # An open relative to a descriptor names no path: the save's error should say which entry.
    return type(e)(e.errno, e.strerror, os.path.join(where, name))


def _sync_dir(dir_fd: int, where: str, modes: Optional[Modes], chmod: bool) -> None:
    """fsync the files and directories below ``dir_fd``, then ``dir_fd`` itself (bottom-up: a
    directory after its entries). Each entry is opened relative to its directory's descriptor,
    without following a link and without waiting (a directory swapped for a symlink or a FIFO
    after the listing leads nowhere); only real files and directories are synced."""
    with os.scandir(dir_fd) as entries:
        listed = [(e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False)) for e in entries]
    for name, is_dir, is_file in listed:
        if is_file:
            try:
                _sync_file(name, dir_fd, modes)
            except OSError as e:
                raise _named(e, where, name) from None
        elif is_dir:
            try:
                sub = os.open(name, _OPEN_DIR, dir_fd=dir_fd)
            except OSError as e:
                # Swapped or gone meanwhile: not ours. Unreadable (0311): fail the save rather
                # than leave a subtree unsynced, and not private, below a complete checkpoint.
                if e.errno in _SWAPPED:
                    continue
                raise _named(e, where, name) from None
            try:
                _sync_dir(sub, os.path.join(where, name), modes, chmod=True)
            finally:
                os.close(sub)
    if modes is not None and chmod:
        os.fchmod(dir_fd, modes.dir)
    _fsync(dir_fd)


def sync_tree(root: Path, modes: Optional[Modes]) -> None:
    """fsync every file and directory below ``root`` (and ``root``), setting ``modes`` on those
    below it when given (``root``'s own mode is its creator's). Symlinks, FIFOs, sockets and
    devices are neither followed, opened for good, nor changed."""
    fd = os.open(root, _OPEN_DIR)
    try:
        _sync_dir(fd, str(root), modes, chmod=False)
    finally:
        os.close(fd)


def remove_partial(path: Path) -> None:
    """Remove a partial checkpoint dir, including subdirs the trial left unlistable (0311):
    each is made ours to list (0700) before the walk enters it. Never raises."""
    with contextlib.suppress(OSError):
        if not os.path.islink(path):
            os.chmod(path, stat.S_IRWXU)
    for dirpath, dirnames, _files in os.walk(path):  # top-down: a child is fixed before it is entered
        for name in dirnames:
            child = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                if not os.path.islink(child):
                    os.chmod(child, stat.S_IRWXU)
    shutil.rmtree(path, ignore_errors=True)


def sweep_partials(base: Path, now: Optional[float] = None) -> list[Path]:
    """Remove ``.<uuid>.partial`` dirs in ``base`` that a killed writer left: ours, a real dir,
    untouched (itself and its top entries) for :data:`STALE_PARTIAL_AFTER_S`. Never raises."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        names = [n for n in os.listdir(base) if _PARTIAL.match(n)]
    except OSError:
        return removed
    for name in names:
        path = base / name
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            # A writer still busy on a large file changes only that file's mtime.
            newest = max([st.st_mtime, *(e.stat(follow_symlinks=False).st_mtime for e in os.scandir(path))])
        except OSError:
            continue
        if now - newest >= STALE_PARTIAL_AFTER_S:
            remove_partial(path)
            removed.append(path)
    return removed


class DownloadMode(enum.Enum):
    LocalWorkersShareDownload = "LOCAL_WORKERS_SHARE_DOWNLOAD"
    NoSharedDownload = "NO_SHARED_DOWNLOAD"


def list_resources(root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[(d if rel == "." else f"{rel}/{d}") + "/"] = 0
        for f in filenames:
            # lstat: a link (even a dangling one) is listed with its own size, never followed.
            out[f if rel == "." else f"{rel}/{f}"] = os.lstat(os.path.join(dirpath, f)).st_size
    return out


def merge_metadata(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-rank metadata; equal leaves are fine, conflicting leaves are an error."""

    def merge(a: Any, b: Any, path: str) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            out = dict(a)
            for k, v in b.items():
                out[k] = merge(out[k], v, f"{path}.{k}") if k in out else v
            return out
        if a != b:
            raise RuntimeError(f"refusing to upload with metadata conflicts at {path or '.'}: {a!r} != {b!r}")
        return a

    merged: dict[str, Any] = {}
    for p in parts:
        merged = merge(merged, p or {}, "")
    return merged


def _env_mark_key() -> Optional[bytes]:
    """The run's secret, when the login side named one (a managed run): it keys the mark that
    lets the login side delete our checkpoints later. None off-cluster: nothing is marked, so
    nothing is deleted for us."""
    path = settings.RUN_SECRET_FILE.raw(os.environ)
    if not path:
        return None
    try:
        return read_run_secret(path)
    except RunSecretError as e:
        log.warning("checkpoints of this run are not marked for cleanup: %s", e)
        return None


class CheckpointContext:
    def __init__(
        self,
        dist: DistributedContext,
        base: Path,
        report: Callable[[Event], None],
        require_steps: bool,
        mark_key: Optional[bytes] = None,
    ) -> None:
        self._dist = dist
        # Read once, on the chief only (the one that finishes checkpoints).
        self._mark_key = mark_key if mark_key is not None or dist.rank != 0 else _env_mark_key()
        self.base = Path(base)
        self._report = report
        self._require_steps = require_steps
        self._modes = checkpoint_modes(os.environ)
        self._writeback = early_writeback(os.environ)
        self._swept = False

    # -- writing ---------------------------------------------------------------------------
    def _check_metadata(self, metadata: dict[str, Any] | None) -> dict[str, Any]:
        md = dict(metadata or {})
        if self._require_steps and "steps_completed" not in md:
            raise ValueError("checkpoint metadata must include 'steps_completed' when running as a trial")
        return md

    def _finish(self, partial: Path, storage_id: str, md: dict[str, Any]) -> None:
        final = self.base / storage_id
        try:
            (partial / "metadata.json").write_text(json.dumps(md, sort_keys=True, indent=2))
            if self._mark_key is not None:
                # What the login side checks before it deletes this dir (protocol/ckmark.py).
                write_mark(partial, self._mark_key, storage_id)
            # Private modes and fsync of everything before the rename, then of the base (the rename).
            sync_tree(partial, self._modes)
            resources = list_resources(partial)
            resources.pop(MARKER_NAME, None)  # ours, not one of the trial's files
            os.replace(partial, final)
        except BaseException:
            # Not durable, so not a checkpoint: nothing half-made is left to fill the disk.
            remove_partial(partial)
            raise
        _fsync_dir(str(self.base))
        self._report(
            CheckpointSaved(
                uuid=storage_id,
                metadata=md,
                resources=resources,
                steps_completed=int(md.get("steps_completed", 0)),
                size=sum(resources.values()),
                storage_path=str(final),
            )
        )

    def _prepare_base(self) -> None:
        """Rank 0, before each write: the base exists (private if we make it); once per
        context, partial dirs of killed writers are swept."""
        ensure_base(self.base, self._modes)
        if not self._swept:
            self._swept = True
            sweep_partials(self.base)

    @contextlib.contextmanager
    def store_path(self, metadata: dict[str, Any] | None = None, *, shard: bool = False) -> Iterator[tuple[Path, str]]:
        if not shard and self._dist.rank != 0:
            raise RuntimeError("cannot call CheckpointContext.store_path(shard=False) from non-chief worker")
        md = self._check_metadata(metadata) if (self._dist.rank == 0 or shard) else {}
        storage_id = str(uuidlib.uuid4()) if self._dist.rank == 0 else ""
        if shard:
            storage_id = self._dist.broadcast(storage_id)
        partial = self.base / f".{storage_id}.partial"
        if self._dist.rank == 0:
            self._prepare_base()
            partial.mkdir(mode=self._modes.dir)
            os.chmod(partial, self._modes.dir)
        if shard:
            self._dist.allgather(None)  # the directory exists before any rank writes
        # One writer (rank 0) starts its files' writeback early (_writeback). Not sharded ones: a
        # node's walk would stat the files other nodes are writing, a lock round trip each on a
        # parallel filesystem such as Lustre, so they keep only the final pass.
        flushes = self._writeback and not shard and self._dist.rank == 0
        try:
            with EarlyWriteback(partial) if flushes else contextlib.nullcontext():
                yield partial, storage_id
        except BaseException:
            # A failed write (a full filesystem, a crash in user code) leaves no half checkpoint
            # behind to fill the disk: the latest complete one stays the one we resume from.
            if self._dist.rank == 0:
                remove_partial(partial)
            raise
        if shard:
            try:
                self._seal_shards(partial, storage_id, md)
            except BaseException:
                if self._dist.rank == 0:  # a node's pass or a collective failed: nothing half-made stays
                    remove_partial(partial)
                raise
        else:
            self._finish(partial, storage_id, md)

    def _seal_shards(self, partial: Path, storage_id: str, md: dict[str, Any]) -> None:
        # One fsync pass per node, once all of its ranks are done writing: their writes share
        # this node's page cache, which no other node's fsync can flush (Lustre).
        self._dist.allgather_local(None)
        if self._dist.rank != 0 and self._dist.get_local_rank() == 0:
            sync_tree(partial, None)
        parts = self._dist.allgather(md)
        if self._dist.rank == 0:
            self._finish(partial, storage_id, merge_metadata(parts))
        self._dist.allgather(None)  # nobody returns before the rename

    def upload(
        self,
        ckpt_dir: os.PathLike[str] | str | None,
        metadata: dict[str, Any] | None = None,
        *,
        shard: bool = False,
        selector: Callable[[str], bool] | None = None,
    ) -> str:
        if not shard and self._dist.rank != 0:
            raise RuntimeError("cannot call .upload(shard=False) from non-chief worker")
        if shard and not any(self._dist.allgather(ckpt_dir is not None)):
            raise RuntimeError("upload(shard=True) needs a ckpt_dir on at least one rank")
        with self.store_path(metadata, shard=shard) as (path, storage_id):
            if ckpt_dir is not None:
                src = Path(ckpt_dir)
                for rel in list_resources(src):
                    if rel.endswith("/") or rel == "metadata.json" or (selector and not selector(rel)):
                        continue
                    (path / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src / rel, path / rel)
        return storage_id

    # -- reading ---------------------------------------------------------------------------
    def _path(self, storage_id: str) -> Path:
        if "/" in storage_id or storage_id.startswith("."):
            raise ValueError(f"invalid checkpoint id {storage_id!r}")
        p = self.base / storage_id
        if not p.is_dir():
            raise CheckpointNotFound(storage_id, str(self.base))
        return p

    @contextlib.contextmanager
    def restore_path(
        self,
        storage_id: str,
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Callable[[str], bool] | None = None,
    ) -> Iterator[Path]:
        # Shared filesystem: every rank reads the checkpoint where it lies.
        yield self._path(storage_id)

    def download(
        self,
        storage_id: str,
        ckpt_dir: os.PathLike[str] | str,
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Callable[[str], bool] | None = None,
    ) -> None:
        src = self._path(storage_id)
        dst = Path(ckpt_dir)
        dst.mkdir(parents=True, exist_ok=True)
        for rel in list_resources(src):
            if rel.endswith("/") or (selector and not selector(rel)):
                continue
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dst / rel)

    def get_metadata(self, storage_id: str) -> dict[str, Any]:
        md: dict[str, Any] = json.loads((self._path(storage_id) / "metadata.json").read_text())
        return md

    def delete(self, storage_id: str) -> None:
        shutil.rmtree(self._path(storage_id))
        self._report(CheckpointDeleted(uuid=storage_id))


def _storage_base_of(storage_manager: Any) -> Path:
    """A directory from what Determined's unit tests pass as a storage manager: a path, or a
    shared-fs manager (which keeps its directory in ``_base_path``)."""
    if isinstance(storage_manager, (str, os.PathLike)):
        return Path(storage_manager)
    base = getattr(storage_manager, "_base_path", None)
    if isinstance(base, (str, os.PathLike)):
        return Path(base)
    raise TypeError(
        "DummyCheckpointContext: storage_manager must be a directory (str or path) or a shared-fs "
        f"storage manager with a base path; got {type(storage_manager).__name__}"
    )


def _log_report(event: Event) -> None:
    if isinstance(event, CheckpointSaved):
        log.info("saved checkpoint %s", event.uuid)
    elif isinstance(event, CheckpointDeleted):
        log.info("deleted checkpoint %s", event.uuid)


class DummyCheckpointContext(CheckpointContext):
    """Off-cluster twin, for unit tests and scripts run by hand: checkpoints are written to the
    given directory exactly as on a cluster (atomically, private), and are logged instead of
    recorded in the store."""

    def __init__(self, dist: DistributedContext, storage_manager: Any) -> None:
        super().__init__(dist, _storage_base_of(storage_manager), _log_report, require_steps=False)
