"""File locks (the daemon's controller lock, the SQLite migration lock) with clear errors.

``flock`` is local-only on NFS mounted with ``local_lock=flock`` and refused on Lustre mounted
without ``flock``. filelock already falls back to a lock file when the
filesystem reports ENOSYS; any other OSError (ENOLCK, EOPNOTSUPP, EACCES, a missing dir) would
otherwise surface as a traceback. Here it becomes a LockError that says what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import filelock

from detslurm.errors import DetSlurmError


class LockError(DetSlurmError):
    """A file lock cannot be taken because of the filesystem, not because someone holds it."""

    def __init__(self, path: Path, error: OSError) -> None:
        self.path = path
        self.error = error
        why = error.strerror or str(error)
        super().__init__(
            f"cannot lock {path}: {why}. The filesystem may not support file locks (NFS, Lustre "
            "without 'flock'): set DETSLURM_DATA_DIR to a directory on a local disk"
        )


# The slice of filelock's API used here, so tests can inject a lock whose filesystem
# refuses flock without patching filelock.
class _Lock(Protocol):
    def acquire(self, timeout: float | None = None) -> object: ...

    def release(self) -> None: ...


@contextlib.contextmanager
def hold_lock(
    path: Path, timeout: float = 0, lock_factory: Callable[[str], _Lock] = filelock.FileLock
) -> Iterator[bool]:
    """Hold the file lock at ``path`` for the block: yields True when taken, False when another
    process held it for ``timeout`` seconds (0: try once). Raises LockError when the lock cannot
    work at all. ``lock_factory`` is for tests (a lock whose filesystem refuses flock)."""
    lock = lock_factory(str(path))
    try:
        lock.acquire(timeout=timeout)
    # A held lock is the normal "someone else drives" case: the caller decides what to do.
    except filelock.Timeout:
        yield False
        return
    except OSError as e:
        raise LockError(path, e) from None
    try:
        yield True
    finally:
        # Released on any exit from the block, exceptions included; the kernel also drops an
        # flock when the process dies, so a crashed holder never blocks the next daemon.
        lock.release()
