"""The mark that says "our checkpoint code made this directory, for this run".

A checkpoint's uuid and path come from a trial's event lines, which the login side treats as
untrusted (docs/design/security.md): a forged event could name any directory of the user's. So
deletes (GC, ``det e delete``, ``det checkpoint delete``) remove a directory only when

- its name is a canonical UUID4, as the Core API makes them (never ``datasets`` or ``projects``);
- it holds :data:`MARKER_NAME`, written at save time, whose content is an HMAC keyed with the
  run's secret (``protocol/secret.py``) over the uuid: a directory the user made by hand, or one
  a trial merely named, has no valid mark.

Stdlib only: the job writes the mark, the login side checks it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import uuid as uuidlib
from pathlib import Path

MARKER_NAME = ".detslurm-checkpoint"
_DOMAIN = b"detslurm checkpoint mark v1\0"
_MAX_MARK_BYTES = 256
_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def canonical_uuid(text: str) -> bool:
    """Whether ``text`` is a UUID4 written exactly as ``str(uuid.uuid4())`` writes it."""
    try:
        parsed = uuidlib.UUID(text)
    except (ValueError, AttributeError, TypeError):
        return False
    return parsed.version == 4 and str(parsed) == text


def mark(secret: bytes, uuid: str) -> str:
    """The mark's content for checkpoint ``uuid`` of the run whose secret is ``secret``."""
    return hmac.new(secret, _DOMAIN + uuid.encode(), hashlib.sha256).hexdigest()


def write_mark(directory: Path, secret: bytes, uuid: str) -> None:
    """Write the mark into ``directory`` (a new checkpoint dir, not yet renamed into place)."""
    fd = os.open(directory / MARKER_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(mark(secret, uuid) + "\n")


def has_mark(directory: Path, secret: bytes, uuid: str) -> bool:
    """Whether ``directory`` holds a valid mark for ``uuid`` under ``secret``. The mark is opened
    without following a link, and only a regular file counts."""
    try:
        fd = os.open(directory / MARKER_NAME, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return False
        got = f.read(_MAX_MARK_BYTES).strip()
    return hmac.compare_digest(got, mark(secret, uuid).encode())
