"""Early writeback: a checkpoint's data goes to disk while the trial is still writing it.

A checkpoint is durable before its rename, so ``store_path`` ends with an fsync of
every file. Left alone, the kernel keeps a freshly written checkpoint in the page cache (a
node with a lot of memory starts writeback only after gigabytes are dirty, or 30 s), so that
fsync finds the whole checkpoint still to write, and the trial waits for the disk after it
waited for ``torch.save``. While the body of ``store_path`` runs, a thread starts the writeback
of every file that has grown by :data:`MIN_BYTES` since its last flush (``sync_file_range``,
which waits for nothing, where Linux has it; else fdatasync): the disk writes overlap the
serialization (and, on a GPU, the copies out of device memory), and the final fsync has only
the tail left. Small files are left to that final pass, which stays the one that counts: this
thread only moves work earlier. Its errors are left to that pass too, except one that a waiting
flush (the fdatasync fallback) saw, which that pass might no longer see: it fails the save.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

PERIOD_S = 0.02
# After a pass that flushed: short, since a writer adds 16 MiB in about 10 ms at 1.5 GB/s.
AGAIN_S = 0.005
# Below this, a flush costs more (a system call; with fdatasync, a journal commit) than it saves.
MIN_BYTES = 16 << 20
# Idle time after a pass, per second of CPU it used: 4 keeps the thread under a fifth of a core.
CPU_SHARE_WAIT = 4.0
# sync_file_range(2)'s flag that starts writeback of the range's dirty pages without waiting.
SYNC_FILE_RANGE_WRITE = 2


def _start_writeback_fn() -> tuple[Callable[[int], None], bool]:
    """How to send a file's dirty pages to disk now, and whether that call waits for the disk
    (and so can see a write error). Linux's ``sync_file_range(fd, 0, 0,
    SYNC_FILE_RANGE_WRITE)`` starts it and returns, with no journal commit (on a parallel
    filesystem, no forced commit on the servers: the data just leaves the client's cache);
    elsewhere (macOS, a Python without ctypes) fdatasync, or fsync where that is missing."""
    fallback: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)
    if not sys.platform.startswith("linux"):
        return fallback, True
    try:
        import ctypes  # here, not at the top: only trials that checkpoint pay for it

        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (ImportError, OSError, AttributeError):
        return fallback, True
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int

    def start(fd: int) -> None:
        if call(fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return start, False


# sync_file_range's answers that mean "not here" (a kernel or sandbox without it, a filesystem
# that cannot): the early writeback stops for this checkpoint; the final pass is unchanged.
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


class EarlyWriteback:
    """Context manager: flushes the regular files below ``root`` every ``period_s`` while open."""

    def __init__(self, root: Path, period_s: float = PERIOD_S, min_bytes: int = MIN_BYTES) -> None:
        self._root = str(root)
        self._period_s = period_s
        self._min_bytes = min_bytes
        self._flushed: dict[str, int] = {}
        self._start: Callable[[int], None] | None
        self._start, self._waits = _start_writeback_fn()
        # A write error that a waiting flush (fdatasync) saw. On Linux such a call marks the
        # error as reported, and the final fsync would then not see it: it is raised at exit.
        self.error: OSError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="detslurm-ckpt-writeback", daemon=True)
        self.flushes = 0  # for tests and benchmarks: how many flushes started early
        self.passes = 0

    def __enter__(self) -> EarlyWriteback:
        self._thread.start()
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        if typ is None and self.error is not None:
            raise self.error

    def _run(self) -> None:
        wait = self._period_s
        while self._start is not None and not self._stop.wait(wait):
            cpu = time.thread_time()
            try:
                flushed = self.flush_grown()
            except OSError as e:  # the final pass in store_path is the one that reports
                log.debug("early writeback of %s: %s", self._root, e)
                flushed = 0
            # A pass that flushed goes again almost at once: the writer is busy, and with the
            # fdatasync fallback more was written while it waited for the disk. But the walk
            # itself (a Trainer checkpoint copies the trial's code: thousands of small files)
            # never takes more than a fifth of a core, nor the GIL from the writer for longer.
            wait = max(AGAIN_S if flushed else self._period_s, CPU_SHARE_WAIT * (time.thread_time() - cpu))

    def flush_grown(self) -> int:
        """One pass: start the writeback of each file that grew by at least ``min_bytes`` since
        its last flush; returns how many it flushed. A file that cannot be flushed is skipped
        until it grows again; the others are still flushed."""
        before = self.flushes
        self.passes += 1
        for dirpath, _dirnames, filenames in os.walk(self._root):
            for name in filenames:
                if self._start is None:
                    return self.flushes - before
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:  # renamed or removed by the writer meanwhile
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_size - self._flushed.get(path, 0) < self._min_bytes:
                    continue
                self._flushed[path] = st.st_size
                if self._flush(path):
                    self.flushes += 1
        return self.flushes - before

    def _flush(self, path: str) -> bool:
        assert self._start is not None
        # O_NONBLOCK: a file swapped for a FIFO after the lstat must not hang the checkpoint.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except OSError as e:  # gone, swapped for a link, or unreadable: the final pass decides
            log.debug("early writeback of %s: %s", path, e)
            return False
        try:
            self._start(fd)
            return True
        except OSError as e:
            if self._waits and e.errno not in (errno.EINVAL, errno.EROFS):  # as the final pass tolerates
                self.error = self.error or e
            elif e.errno in _UNSUPPORTED:
                self._start = None
            log.debug("early writeback of %s: %s", path, e)
            return False
        finally:
            os.close(fd)
