"""Root's audit log: every `det --all-users` command and every Slurm call it makes that can
change a job, one JSON object per line (docs/admin/audit.md).

Only root may use ``--all-users`` (detslurm/identity.py), and root writes the log, so the file
must be one only root can write: owned by root, writable by no one else, in a directory that
only root can write and whose ancestors no other user can rename. The checks run on every
record, and a record that cannot be written stops the command before it changes anything:
an admin action that leaves no trace is refused.

The log says who acted (the real uid's name, the login user the kernel keeps through su and
sudo, ``$SUDO_USER``), when, what (the command line) and which Slurm calls it made with their
outcome. It is no defence against root itself, who can edit it: forward it to the site's log
host for that.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from detslurm.errors import StateError
from detslurm.identity import os_user

if TYPE_CHECKING:
    from detslurm.slurm.client import Result, Runner

# Where the log goes unless the admin's site config names another file (`audit_log`).
DEFAULT_AUDIT_LOG = Path("/var/log/detslurm/audit.log")

# Slurm commands (and scontrol verbs) that only read: the command record covers them.
_READ_ONLY = frozenset({"squeue", "sinfo", "sacct", "sdiag", "sprio", "sshare"})
_SCONTROL_READS = frozenset({"show", "ping", "version"})
# Enough of Slurm's refusal to say why; the full text is on the admin's terminal.
_STDERR_CHARS = 500


class AuditError(StateError):
    """The audit log cannot be written safely; the admin action is refused."""


def changes_jobs(argv: Sequence[str]) -> bool:
    """Whether a Slurm command may change a job (sbatch, scancel, scontrol update/hold/...)."""
    if not argv:
        return False
    name = os.path.basename(argv[0])
    if name == "scontrol":
        verbs = [a for a in argv[1:] if not a.startswith("-")]
        return not verbs or verbs[0] not in _SCONTROL_READS
    if name == "sacctmgr":
        return not any(a in ("show", "list") for a in argv[1:])
    return name not in _READ_ONLY


def _login_user() -> Optional[str]:
    """Who logged in, as the kernel's audit keeps it across su and sudo (None where unknown)."""
    try:
        uid = int(Path("/proc/self/loginuid").read_text().strip())
    except (OSError, ValueError):
        return None
    # 4294967295 ((uid_t)-1): no login session set it (a daemon, a container's init).
    if uid == 0xFFFFFFFF:
        return None
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _who(env: Mapping[str, str]) -> dict[str, Any]:
    return {
        "user": os_user(),
        "uid": os.getuid(),
        "euid": os.geteuid(),
        "login_user": _login_user(),
        # Set by sudo; whoever runs det could set it too, so it is a hint beside login_user.
        "sudo_user": env.get("SUDO_USER") or None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


def _unsafe_dir(path: Path, parent: bool) -> Optional[str]:
    """Why ``path`` (a resolved directory) could let another user replace the log, or None.
    The log's own directory must be writable by root alone; an ancestor may be group-writable
    (Ubuntu's /var/log is root:syslog 0775) or world-writable with the sticky bit (/tmp), since
    no other user can then rename a directory root owns in it."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != 0:
        return f"{path} is not owned by root"
    if parent and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by users other than root"
    if not parent and st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return f"{path} is writable by every user"
    return None


def _check_dirs(directory: Path) -> None:
    for i, d in enumerate([directory, *directory.parents]):
        why = _unsafe_dir(d, parent=i == 0)
        if why:
            raise AuditError(f"the audit log's directory is not safe: {why}")


def _open_log(path: Path) -> int:
    """A descriptor to append to the log, after every check; the directory is made (0750) if
    its parent exists."""
    if not path.is_absolute():
        raise AuditError(f"the audit log {path} must be an absolute path")
    directory = Path(os.path.realpath(path.parent))
    try:
        if not directory.exists():
            _check_dirs(directory.parent)
            directory.mkdir(mode=0o750)
        _check_dirs(directory)
        # Never through a link, never a FIFO that would block: the name is checked on the open file.
        fd = os.open(
            directory / path.name,
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
            0o600,
        )
    except OSError as e:
        raise AuditError(f"cannot open the audit log {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise AuditError(f"the audit log {path} must be a regular file owned by root and writable by no one else")
    return fd


class AuditLog:
    """Appends the records of one `det` command to the log at ``path``."""

    def __init__(self, path: Path, env: Optional[Mapping[str, str]] = None) -> None:
        self.path = path
        self._who = _who(os.environ if env is None else env)

    def write(self, event: str, **fields: Any) -> None:
        """One record, flushed to disk before returning; AuditError when it cannot be written."""
        now = datetime.now(timezone.utc).isoformat(timespec="microseconds")
        line = json.dumps({"time": now, "event": event, **self._who, **fields}, ensure_ascii=True) + "\n"
        fd = _open_log(self.path)
        try:
            # Whole records even when two admins' commands write at once.
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = memoryview(line.encode())
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        except OSError as e:
            raise AuditError(f"cannot write the audit log {self.path}: {e.strerror}") from None
        finally:
            os.close(fd)

    def command(self, argv: Sequence[str]) -> None:
        """The record of a command, written before it does anything."""
        self.write("command", argv=["det", *argv], cwd=os.getcwd())

    def runner(self, inner: Runner) -> Runner:
        """``inner`` with every Slurm call that can change a job recorded before it runs (a call
        the log cannot record is not made) and its outcome after."""

        def run(
            argv: Sequence[str],
            *,
            input: Optional[str] = None,
            timeout: float,
            env: Optional[Mapping[str, str]] = None,
        ) -> Result:
            if not changes_jobs(argv):
                return inner(argv, input=input, timeout=timeout, env=env)
            self.write("slurm_call", slurm=list(argv))
            try:
                res = inner(argv, input=input, timeout=timeout, env=env)
            except Exception as e:
                self.write("slurm_result", slurm=list(argv), error=str(e)[:_STDERR_CHARS])
                raise
            said = (res.stderr or "").strip()[:_STDERR_CHARS]
            self.write("slurm_result", slurm=list(argv), returncode=res.returncode, stderr=said)
            return res

        return run


def audit_log_path(configured: Optional[str]) -> Path:
    """The log's path: the admin's site config's ``audit_log``, else the default."""
    return Path(configured) if configured else DEFAULT_AUDIT_LOG
