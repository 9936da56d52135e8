"""A Slurm trial's node-local working dir: fresh, private, verified, swept when left behind.

Why (docs/design/security.md): an older dir had a predictable name in a world-writable dir and was reused
when it existed, so another user could pre-create it and plant a ``startup-hook.sh`` or a module
that shadows ``json``. Now every launcher makes its own dir with ``mkdtemp`` (random name, 0700,
created exclusively) and checks it with ``lstat`` before anything goes in; no path here is ever
taken over from someone else.

Where the dir goes (:func:`choose_base`), first match wins:

1. ``$SLURM_TMPDIR``: sites set it to a per-job scratch dir (a prolog or SPANK plugin);
2. ``$TMPDIR`` when it is *private*: a directory owned by us that nobody else may write. That is
   what per-job tmp dirs look like (job_container/tmpfs-style plugins, auto_tmpdir, prologs make
   them 0700 for the job's user); a shared ``/tmp`` or ``/scratch`` (root-owned, 1777) is not;
3. the site config's ``node_tmpdir`` (``$DETSLURM_NODE_TMPDIR``, expanded by the batch shell);
4. ``$TMPDIR`` even when shared (a site's big node-local scratch), then ``/tmp``.

A base others may write without the sticky bit is never used: there they could rename our dir
away and put their own in its place after we checked it.

Bases 1-2 are usually removed by the site at the job's end. For the others a launcher killed by
SIGKILL leaves its dir behind, so each launcher first sweeps the dirs of *its own user's*
dead launchers on this node: a marker file names the job, the host and the launcher's pid and
start time; a dir is removed only when it is ours, older than :data:`STALE_AFTER_S`, made on
this host, and its launcher process is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from detslurm.protocol.paths import NODE_TMPDIR_ENV

PREFIX = "detslurm-"
MARKER = "detslurm-workdir.json"
WORK = "work"
# A day: long past any launcher's start-up, so a sweep never races a launcher that is still
# writing its marker; jobs that run longer are protected by the pid check, not by age.
STALE_AFTER_S = 24 * 3600


class WorkdirError(Exception):
    """The working dir could not be made private (a clear one-line reason)."""


@dataclass(frozen=True)
class Workdir:
    """``top`` is the 0700 dir we created (with the marker); ``path`` is where the code goes."""

    top: Path
    path: Path


def _private_dir(path: str) -> bool:
    """A directory owned by us that neither group nor others may write (symlinks followed:
    sites often link /scratch paths; the owner check applies to the target)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _usable_dir(path: str) -> bool:
    """An absolute dir we may create in, where nobody else can move our dir away: writable by
    others only with the sticky bit (/tmp's 1777), never a plain 777 dir."""
    # A relative base would depend on the launcher's cwd, which is where the context goes.
    if not (path and os.path.isabs(path) and os.access(path, os.W_OK | os.X_OK)):
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    loose = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
    return stat.S_ISDIR(st.st_mode) and not loose


def choose_base(env: Mapping[str, str]) -> Path:
    """Pure apart from stat calls: the base dir for this node's working dir (see the module doc)."""
    slurm_tmp, tmpdir, site = env.get("SLURM_TMPDIR", ""), env.get("TMPDIR", ""), env.get(NODE_TMPDIR_ENV, "")
    for candidate, ok in (
        # Private dirs first: in them no other user can even see our dir, let alone race us.
        (slurm_tmp, _usable_dir(slurm_tmp) and _private_dir(slurm_tmp)),
        (tmpdir, _usable_dir(tmpdir) and _private_dir(tmpdir)),
        (site, _usable_dir(site)),
        (tmpdir, _usable_dir(tmpdir)),
    ):
        if ok:
            return Path(candidate)
    # /tmp is 1777 on every Linux node; mkdtemp's exclusive create plus the sticky bit keep our
    # dir ours there.
    return Path("/tmp")


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or
    None when no such process is visible. With the pid it identifies one process for good."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its last ')'.
    fields = text.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None


def verify_private(path: Path) -> None:
    """Raise unless ``path`` is a real directory (not a symlink), owned by us, mode 0700."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise WorkdirError(f"working dir {path}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise WorkdirError(f"working dir {path} is not a directory of ours (a symlink or a file)")
    if st.st_uid != os.geteuid():
        raise WorkdirError(f"working dir {path} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise WorkdirError(f"working dir {path} has mode {stat.S_IMODE(st.st_mode):o}, not 700")


def create(base: Path, job_id: str, node: str) -> Workdir:
    """A fresh private working dir below ``base``: ``<base>/detslurm-<job>-node<N>-<random>``."""
    # The name only helps a person find the dir: the id comes from the environment, so it is
    # reduced to harmless characters and a bounded length before it becomes a path component.
    safe_job = "".join(c for c in job_id if c.isalnum() or c in "_.")[:40] or "job"
    safe_node = "".join(c for c in node if c.isdigit())[:6] or "0"
    try:
        top = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{safe_job}-node{safe_node}-", dir=base))
    except OSError as e:
        raise WorkdirError(f"cannot create a working dir in {base}: {e.strerror}") from None
    # mkdtemp already makes it 0700, but a hostile base (or an odd umask/ACL filesystem) must
    # fail here, before any code is written in.
    verify_private(top)
    marker = {
        "job_id": job_id,
        "node": node,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start": _start_time(os.getpid()),
    }
    # O_EXCL|O_NOFOLLOW: the marker is never written through a file or link someone placed first.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    with os.fdopen(os.open(top / MARKER, flags, 0o600), "w") as f:
        json.dump(marker, f)
    # Code goes one level down, beside the marker rather than with it: extracting the context or
    # a trial cleaning its cwd cannot remove the marker the sweep relies on.
    work = top / WORK
    work.mkdir(mode=0o700)
    verify_private(work)
    return Workdir(top, work)


def _marker(top: Path) -> Optional[dict[str, object]]:
    """The marker of a dir that looks like ours, read without following links; None otherwise."""
    try:
        # O_NONBLOCK: a fifo planted under the marker's name must not hang the sweep on open.
        fd = os.open(top / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        try:
            # A marker is a few hundred bytes; reading at most 4 KiB bounds what a planted file costs.
            data = json.loads(f.read(4096))
        except ValueError:
            return None
    return data if isinstance(data, dict) else None


def is_stale(top: Path, now: float) -> bool:
    """Whether ``top`` is one of our dead launchers' working dirs (every condition must hold)."""
    try:
        st = os.lstat(top)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or now - st.st_mtime < STALE_AFTER_S:
        return False
    marker = _marker(top)
    # Another host's dir (a shared base) is judged by that host: its pids mean nothing here.
    if marker is None or not marker.get("job_id") or marker.get("host") != socket.gethostname():
        return False
    pid = marker.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    start = _start_time(pid)
    # Alive with the same start time: the launcher still runs (a job may run for days).
    return start is None or start != marker.get("start")


def sweep_stale(base: Path, now: Optional[float] = None) -> list[Path]:
    """Remove our dead launchers' dirs in ``base``; the ones removed. Never raises: a sweep
    that fails must not fail the trial."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        top = base / name
        if is_stale(top, now):
            # ignore_errors: the site's cleanup or a concurrent sweep may remove parts first.
            shutil.rmtree(top, ignore_errors=True)
            removed.append(top)
    return removed


def remove(wd: Workdir) -> None:
    """The end of the run: the whole dir goes (context, hook output, whatever the trial left)."""
    shutil.rmtree(wd.top, ignore_errors=True)
