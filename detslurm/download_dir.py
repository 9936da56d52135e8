"""Where a checkpoint download writes: a fresh directory, renamed into place when complete.

A checkpoint's files are a trial's output (docs/design/security.md). Copied into a directory
that already holds files, a link an earlier download left (``sub -> ~/.ssh``) would have the next
download write through it. So every download fills a new private temporary directory beside the
destination and renames it into place; a destination that exists is refused unless it is an
empty directory (which the rename then replaces). A failed download leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from detslurm.errors import DetSlurmError

# The hidden `det checkpoint` command a remote download asks the login node which directory to
# copy (cli/checkpoint.py answers, cli/remote/transfer.py asks).
LOCATE_COMMAND = "locate-for-download"


class DestinationExists(DetSlurmError):
    """The download's destination already holds something."""


def _check_free(dst: Path) -> None:
    try:
        st = os.lstat(dst)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode) and not os.listdir(dst):
        return
    raise DestinationExists(
        f"{dst} already exists; a checkpoint is downloaded only into a new (or empty) directory: "
        "choose another --output-dir or remove it first"
    )


@contextlib.contextmanager
def fresh_download_dir(dst: Path) -> Iterator[Path]:
    """A new empty directory to fill; renamed to ``dst`` when the block ends without error,
    removed otherwise. It stays 0700 (mkdtemp's): checkpoints are private by default."""
    _check_free(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Beside the destination: same filesystem, so the rename is one atomic step.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        yield tmp
        _check_free(dst)  # again: something may have appeared while the files were copied
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
