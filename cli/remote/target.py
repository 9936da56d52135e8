"""Where remote mode goes: the ``ssh://`` URL, and the laptop's `remote:` settings.

The URL names the login node and optionally how to find `det` there:
``ssh://[user@]host[:port][/path]`` where /path is the remote `det` executable or a venv whose
``bin/det`` is used. The host may be an alias from ~/.ssh/config (resolved later, in sshconf).
"""

from __future__ import annotations

import importlib.util
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detslurm.errors import ConfigError, DetSlurmError

# Determined users often already have DET_MASTER=http://master:8080 in their environment; only
# an ssh:// value means something to detslurm, anything else is ignored (local mode) from the
# environment, but refused when given explicitly with -m.
_SCHEME = "ssh://"
_HOST = re.compile(r"^[A-Za-z0-9._-]+$|^\[[0-9A-Fa-f:.]+\]$")
# detslurm.settings.REMOTE_PERSIST_S's default (tests/unit/test_settings.py keeps them equal): that module
# is imported only where the settings are read, as main() imports this one for every `det`.
DEFAULT_PERSIST_S = 600.0


class RemoteError(DetSlurmError):
    """Remote mode cannot reach or use the login node (bad URL, SSH failure, refused host key)."""


# What remote mode needs on the laptop and is not installed by default (pyproject's extras).
EXTRA = "pip install 'detslurm[remote]'"


def missing_extra(e: ImportError | None = None) -> RemoteError:
    """The one-line error for an SSH library that is missing (or whose import fails)."""
    why = f" ({e})" if e is not None else " (paramiko is not installed)"
    return RemoteError(f"remote mode needs its extra: {EXTRA}{why}")


def require_ssh() -> None:
    """Refuse at once, naming the extra, when paramiko is not installed: before a holder process
    is started (it would die of the ImportError) and without paying for the import here."""
    if importlib.util.find_spec("paramiko") is None:
        raise missing_extra()


@dataclass(frozen=True)
class Target:
    """One parsed ``ssh://`` URL: None fields are filled from ~/.ssh/config later."""

    host: str
    user: str | None = None
    port: int | None = None
    det_path: str | None = None  # remote det executable, or a venv directory

    @property
    def url(self) -> str:
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"{_SCHEME}{user}{self.host}{port}{self.det_path or ''}"


def parse_url(url: str) -> Target:
    """Parse ``ssh://[user@]host[:port][/path]``; a clear RemoteError names what is wrong."""
    if not url.startswith(_SCHEME):
        raise RemoteError(
            f"master {url!r}: detslurm has no master server; -m/DET_MASTER takes ssh://[user@]login-node[:port] "
            "(the login node where detslurm is installed)"
        )
    rest = url[len(_SCHEME) :]
    hostport, slash, path = rest.partition("/")
    user, at, hostport2 = hostport.rpartition("@")
    if not at:
        user, hostport2 = "", hostport
    host, port_s = hostport2, ""
    if hostport2.startswith("["):  # [ipv6]:port
        end = hostport2.find("]")
        host, port_s = hostport2[: end + 1], hostport2[end + 2 :] if end >= 0 else ""
    elif ":" in hostport2:
        host, _, port_s = hostport2.partition(":")
    if not host or not _HOST.match(host):
        raise RemoteError(f"master {url!r}: {host!r} is not a host name")
    if at and (not user or not re.match(r"^[A-Za-z0-9._][A-Za-z0-9._-]*$", user)):
        raise RemoteError(f"master {url!r}: {user!r} is not a user name")
    port: int | None = None
    if port_s:
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise RemoteError(f"master {url!r}: port {port_s!r} is not a number from 1 to 65535")
        port = int(port_s)
    return Target(host=host.strip("[]"), user=user or None, port=port, det_path=f"/{path}" if slash and path else None)


def split_master(argv: Sequence[str], env: Mapping[str, str]) -> tuple[str | None, list[str]]:
    """Take `-m URL` / `--master URL` / `--master=URL` off the front of argv (before the
    subcommand, like Determined's `det -m`), else DET_MASTER when it is an ssh:// URL.

    Returns (url or None for local mode, the argv to run)."""
    args = list(argv)
    i = 0
    while i < len(args) and args[i].startswith("-"):
        a = args[i]
        if a in ("-m", "--master"):
            if i + 1 >= len(args):
                raise RemoteError(f"{a} needs a value: ssh://[user@]login-node[:port]")
            return args[i + 1], args[:i] + args[i + 2 :]
        if a.startswith("--master="):
            return a.split("=", 1)[1], args[:i] + args[i + 1 :]
        if a.startswith("-m") and not a.startswith("--"):
            return a[2:], args[:i] + args[i + 1 :]
        i += 1
    env_url = env.get("DET_MASTER", "")
    if env_url.startswith(_SCHEME):
        return env_url, args
    return None, args


@dataclass(frozen=True)
class RemoteSettings:
    """The laptop's `remote:` mapping in the detslurm user config (env vars override).

    det: the remote `det` (a path; a venv directory means its bin/det);
    setup: shell lines run before it (``module load detslurm``, ``source ~/venv/bin/activate``);
    persist_s: how long the connection holder keeps an authenticated connection for later
    commands (0: no holder, every command connects and authenticates itself)."""

    det: str = "det"
    setup: tuple[str, ...] = field(default_factory=tuple)
    persist_s: float = DEFAULT_PERSIST_S


def remote_settings(raw: Any, env: Mapping[str, str], where: str) -> RemoteSettings:
    """Validate the `remote:` value of the user config (``where`` names the file in errors)."""
    from detslurm import settings

    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{where}: remote: must be a mapping (det, setup, persist_s)"], "detslurm user config")
    unknown = sorted(set(raw) - {"det", "setup", "persist_s"})
    if unknown:
        raise ConfigError([f"{where}: remote: unknown key {k!r}; valid: det, setup, persist_s" for k in unknown])
    det = settings.REMOTE_DET.raw(env) or raw.get("det", "det")
    setup_raw = settings.REMOTE_SETUP.raw(env) or raw.get("setup", [])
    if isinstance(setup_raw, str):
        setup_raw = setup_raw.splitlines()
    persist = settings.REMOTE_PERSIST_S.raw(env) or raw.get("persist_s", DEFAULT_PERSIST_S)
    errors = []
    if not isinstance(det, str) or not det:
        errors.append(f"{where}: remote.det must be a path to det (or a venv), got {det!r}")
    if not isinstance(setup_raw, list) or not all(isinstance(s, str) for s in setup_raw):
        errors.append(f"{where}: remote.setup must be a list of shell lines, got {setup_raw!r}")
    try:
        persist_s = float(persist)
    except (TypeError, ValueError):
        errors.append(f"{where}: remote.persist_s must be a number of seconds, got {persist!r}")
        persist_s = 0.0
    if errors:
        raise ConfigError(errors, source="detslurm user config")
    return RemoteSettings(det=str(det), setup=tuple(setup_raw), persist_s=max(0.0, persist_s))


def load_remote_settings(env: Mapping[str, str]) -> RemoteSettings:
    """Read `remote:` from the user config file (detslurm.settings.config_path)."""
    from detslurm import settings

    return remote_settings(settings.read_user_config(env).get("remote"), env, str(settings.config_path(env)))


# Linux's sockaddr_un holds 108 bytes including the terminating NUL.
SUN_PATH_MAX = 107


def runtime_dir(name_len: int = 0) -> Path:
    """A private (0700) per-user directory for the connection holder's sockets.

    ``$XDG_RUNTIME_DIR/detslurm`` when set, else ``/tmp/detslurm-<uid>``; the latter too when a
    long XDG_RUNTIME_DIR would leave no room for a socket name of ``name_len`` bytes (bind()
    refuses paths longer than sun_path)."""
    fallback = Path(f"/tmp/detslurm-{os.getuid()}")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    d = Path(xdg) / "detslurm" if xdg else fallback
    if len(os.fsencode(d)) + 1 + name_len > SUN_PATH_MAX:
        d = fallback
    return _private_dir(d)


def _private_dir(d: Path) -> Path:
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    # lstat: a link planted in /tmp must not send our sockets somewhere else.
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RemoteError(f"{d} must be a directory owned by you with mode 0700 (it holds SSH connection sockets)")
    return d
