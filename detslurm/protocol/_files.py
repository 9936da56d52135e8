"""Opening a file a trial may have replaced: whatever is at the path (a directory, a FIFO, a
device) is looked at through the descriptor, and the descriptor is closed on every way out."""

from __future__ import annotations

import os
import stat
from typing import BinaryIO


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


def kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "not a regular file"
