"""Every user's daemon on this login node, for root (`det --all-users daemon status`).

Found from what each daemon already leaves: a process holding ``daemon.lock`` open (the lock it
keeps for its whole life) whose ``daemon.pid`` beside it names that very process (host, uid,
pid and start time, as ``det daemon status`` checks its own), and the ``daemon.status`` it
rewrites after every round (its polling interval and last tick).

Root reads files in directories other users control here, so each is opened without following
links and used only when the daemon's own user owns it: a user cannot make root read, or show,
a file that is not theirs.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from detslurm.daemon import _CREATE_TIME_SLACK_S, PidRecord, TickStatus

# A pid or status file is a few hundred bytes; anything larger is not one.
_MAX_BYTES = 64 * 1024
_LOCK_NAME = "daemon.lock"


@dataclass(frozen=True)
class UserDaemon:
    user: str
    uid: int
    pid: int
    data_dir: Path
    started: float  # the process's start, epoch seconds
    tick: Optional[TickStatus]  # None until its first status file (or one it could not write)


def _maybe_daemon(argv: Sequence[str]) -> bool:
    """A cheap first filter on the command line: `python -m detslurm.daemon run` (what `det`
    starts) or `det daemon start --foreground` (systemd --user, a Slurm job)."""
    return any("detslurm" in a for a in argv) or "daemon" in argv


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def read_owned(path: Path, uid: int) -> Optional[str]:
    """The text of ``path`` when it is a small regular file that ``uid`` owns, reached without
    following a link at its last component; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_size > _MAX_BYTES:
            return None
        return os.read(fd, _MAX_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _daemon_of(pid: int, uid: int, created: float, lock: Path, host: str) -> Optional[UserDaemon]:
    """The daemon whose lock file is ``lock``, when the pid file beside it names this process."""
    text = read_owned(lock.with_name("daemon.pid"), uid)
    rec = PidRecord.parse(text) if text is not None else None
    if rec is None or (rec.host, rec.uid, rec.pid) != (host, uid, pid):
        return None
    if abs(rec.create_time - created) > _CREATE_TIME_SLACK_S:
        return None
    status = read_owned(lock.with_name("daemon.status"), uid)
    tick = TickStatus.parse(status) if status is not None else None
    return UserDaemon(_user_name(uid), uid, pid, lock.parent, created, tick if tick and tick.pid == pid else None)


def every_daemon() -> list[UserDaemon]:
    """The detslurm daemons running on this host, every user's (other users' need root), by user."""
    import psutil

    host, found = socket.gethostname(), []
    for proc in psutil.process_iter(["pid", "uids", "cmdline", "create_time"]):
        info = proc.info
        if not info["cmdline"] or not _maybe_daemon(info["cmdline"]) or info["uids"] is None:
            continue
        try:
            files = proc.open_files()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for f in files:
            if Path(f.path).name == _LOCK_NAME:
                daemon = _daemon_of(info["pid"], info["uids"].real, info["create_time"], Path(f.path), host)
                if daemon is not None:
                    found.append(daemon)
                    break
    return sorted(found, key=lambda d: (d.user, d.pid))
