"""Small helpers shared by the login-node and in-job sides: files, terminal-safe text (stdlib only)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

# The experiments dir's subdirectory where detached runs (the user's own sbatch scripts)
# register. Here, in a leaf module, rather than in detslurm.protocol.detached: the read
# commands' reconcile step checks for it, and importing the protocol package for a name cost
# `det t logs` 0.03 s of its start-up.
DETACHED_DIR = "detached"


# Terminal control: escapes and carriage returns could rewrite other lines on screen, and the C1
# range too (U+009B is a one-character CSI to many terminals, the same as ESC [). Tab and newline
# are kept.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` (written by a trial or a node: untrusted) with terminal control characters
    replaced by spaces, safe to print to a terminal."""
    return _CONTROL.sub(" ", text)


_SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_size(n: float) -> str:
    """A byte count as people read it: the largest binary unit under which it is at least 1,
    one decimal (61442.1 KiB reads ``60.0 MiB``; bytes stay whole, ``512 B``)."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in _SIZE_UNITS[1:]:
        n /= 1024
        # Rounded before comparing: 1023.96 KiB would print as "1024.0 KiB".
        if abs(round(n, 1)) < 1024 or unit == _SIZE_UNITS[-1]:
            break
    return f"{n:.1f} {unit}"


def detached_root(experiments: Path) -> Path:
    """Where detached runs register under the experiments dir."""
    return experiments / DETACHED_DIR


def atomic_write_text(path: Path, text: str, mode: int = 0o644, durable: bool = True) -> None:
    """Write to a temp file in the same dir, fsync, then rename: readers on other nodes see
    the old file or the new one, never half of one. ``durable=False`` skips the fsync, for
    files the controller rewrites from the store whenever they differ. The dir is made if
    missing."""
    # Few metadata operations: a submission writes a few of these per trial, and each create,
    # mkdir, chmod or rename is a server round trip on NFS or Lustre. So the parent is made only
    # when the create says it is missing, and the mode is set at the create (chmod only where the
    # umask took bits off).
    fd, tmp = _create_temp(path, mode)
    try:
        try:
            data = memoryview(text.encode())
            while data:
                data = data[os.write(fd, data) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    # BaseException: a KeyboardInterrupt mid-write must not leave a stray temp file either.
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# Temp names tried before giving up: a filesystem that answers EEXIST to every name (a broken
# FUSE or NFS server) must fail the write, not hang the controller.
_TEMP_TRIES = 100


def _create_temp(path: Path, mode: int) -> tuple[int, str]:
    """A new file beside ``path`` under a random name (two writers never share one; nobody can
    guess it to put a link there first), with exactly ``mode``: its descriptor and name. The
    parent is made when the create finds it missing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    made_parent = False
    for _ in range(_TEMP_TRIES):
        # 8 random hex digits: as long as mkstemp's, so a name that fitted before still does.
        tmp = os.path.join(path.parent, f".{path.name}.{os.urandom(4).hex()}.tmp")
        try:
            fd = os.open(tmp, flags, mode)
            break
        except FileExistsError:
            continue  # taken: try another name
        except FileNotFoundError:
            if made_parent:
                raise
            path.parent.mkdir(parents=True, exist_ok=True)
            made_parent = True
    else:
        raise FileExistsError(errno.EEXIST, "no usable temporary file name", str(path.parent))
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)  # the umask took bits off: never visible with other bits at the final name
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return fd, tmp


def atomic_write_json(path: Path, obj: Any, durable: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, sort_keys=True), durable=durable)


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return default


@contextlib.contextmanager
def import_from_path(path: str | os.PathLike[str]) -> Iterator[None]:
    """Import modules from ``path`` inside the block, then forget them again.

    Determined's ``det.import_from_path``: an older ``model_def.py`` (from a checkpoint's
    ``code/``) and the current one can be imported in one interpreter without colliding, as long
    as the caller binds them to different names. Only modules whose file lies under ``path`` are
    dropped from ``sys.modules`` afterwards; anything else imported meanwhile stays cached.
    """
    root = os.path.realpath(os.fspath(path))
    before = set(sys.modules)
    # First on the path, so `import model_def` finds this directory's copy, not one already
    # on sys.path.
    sys.path.insert(0, root)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(root)
        for name in set(sys.modules) - before:
            origin = getattr(sys.modules.get(name), "__file__", None)
            # A prefix test alone would also match a sibling dir (/ckpt/code2 for /ckpt/code).
            if origin and os.path.realpath(origin).startswith(root + os.sep):
                del sys.modules[name]


def open_regular(path: os.PathLike[str] | str, flags: int) -> tuple[BinaryIO, os.stat_result] | None:
    """``path`` opened with ``flags`` (add O_NONBLOCK where a FIFO could stand in: its open then
    does not wait for a writer) as a binary file, with its fstat; None, and nothing left open,
    when it is not a regular file. OSError from the open or the fstat is the caller's."""
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        # os.fdopen refuses a directory, hence the check first; from here the file owns fd.
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "not a regular file"
