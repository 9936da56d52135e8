"""Which filesystem a path is on, and a warning when the SQLite store is on a network one.

SQLite in WAL mode needs every process on one host (the WAL index is shared memory), and its
locks are unreliable over NFS. ``$HOME`` on a cluster is usually NFS, Lustre or GPFS, and the
default store lives under it (platformdirs' user data dir). ``statvfs`` cannot tell the type,
so the type comes from ``/proc/self/mountinfo``: the mount with the longest mount point that
contains the path.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from detslurm import settings

log = logging.getLogger("detslurm.store")

# Filesystems shared between hosts, where SQLite's WAL and locking do not hold.
NETWORK_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "beegfs",
        "glusterfs",
        "panfs",
        "afs",
        "9p",
        "wekafs",
        "orangefs",
        "pvfs2",
        "ocfs2",
        "gfs2",
    }
)
# FUSE network mounts show as fuse.<driver>.
_NETWORK_FUSE = frozenset({"sshfs", "glusterfs", "cephfs", "ceph-fuse", "gcsfuse", "s3fs", "rclone", "juicefs"})
_warned: set[str] = set()


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fs_type: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo (octal).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts in ``/proc/self/mountinfo`` text, in order (later mounts are on top)."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue  # not a mountinfo line: ignore rather than fail a store open
        # Field 5 is the mount point; after the " - " separator come the fs type and the source.
        mounts.append(Mount(_unescape(fields[4]), tail[0]))
    return mounts


def fs_type(path: str, mounts: list[Mount]) -> str | None:
    """The type of the filesystem ``path`` (absolute, resolved) is on: longest mount point wins,
    and of equal ones the last mounted."""
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        inside = mp == "/" or path == mp or path.startswith(mp + "/")
        # >= rather than >: a later mount over the same point hides the earlier one.
        if inside and (best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/")):
            best = m
    return best.fs_type if best else None


def is_network_fs(fs: str | None) -> bool:
    if fs is None:
        return False
    if fs.startswith("fuse."):
        return fs.removeprefix("fuse.") in _NETWORK_FUSE
    return fs in NETWORK_FS_TYPES


def _resolved(path: Path) -> Path:
    """``path`` with symlinks resolved as far as it exists (the store's dir may not exist yet;
    what does not exist cannot be a mount point, so the rest is kept as written)."""
    path = path.absolute()
    existing, tail = path, []
    while not existing.exists() and existing != existing.parent:
        tail.append(existing.name)
        existing = existing.parent
    return existing.resolve().joinpath(*reversed(tail))


def network_fs_of(db_path: Path, mountinfo: str | None = None) -> str | None:
    """The network filesystem type ``db_path``'s directory is on, or None (local, or unknown)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None  # not Linux, or no /proc: nothing to tell
    # The directory, not the file: the store file may not exist yet, and SQLite's -wal and -shm
    # files live beside it.
    fs = fs_type(str(_resolved(db_path.parent)), parse_mountinfo(mountinfo))
    return fs if is_network_fs(fs) else None


def warn_if_network_db(db_path: Path, mountinfo: str | None = None) -> str | None:
    """Log a warning (once per process and path) when the SQLite store is on a network
    filesystem; returns the warning, or None. ``DETSLURM_ALLOW_NETWORK_DB=1`` silences it."""
    if settings.ALLOW_NETWORK_DB.get() or str(db_path) in _warned:
        return None
    fs = network_fs_of(db_path, mountinfo)
    if fs is None:
        return None
    # A warning, not an error: one user on one login node is safe on NFS, and the store may
    # have been put there on purpose.
    _warned.add(str(db_path))
    msg = (
        f"the detslurm store {db_path} is on a network filesystem ({fs}); SQLite is not safe there "
        "when detslurm runs on more than one host. Set db_url (or DETSLURM_DB_URL) to a PostgreSQL "
        f"server, or DETSLURM_DATA_DIR to a local disk; {settings.ALLOW_NETWORK_DB.name}=1 silences this warning."
    )
    log.warning("%s", msg)
    return msg
