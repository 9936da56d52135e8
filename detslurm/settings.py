"""Every ``DETSLURM_*`` environment variable, declared once: its type, default and meaning.

Code reads a variable only through its declaration here (``DATA_DIR.get(env)``), never by its
name; ``tests/unit/test_settings.py`` holds every product module to that, and checks that each
declaration is used. ``python -m detslurm.settings --markdown`` prints the table that
docs/admin/settings.md holds, and ``det config`` prints the effective values and their sources.

Two kinds: a *setting* is set by the user or the site admin (the shell, or, for the keys in the
table, the user config file); a *protocol* variable is set by detslurm for a job or a process it
starts, and is part of the contract between the login side and the job (detslurm/protocol/).
Precedence for settings: environment > the user config file > default. An empty variable
counts as unset, so ``DETSLURM_DB_URL= det ...`` falls back instead of using an empty URL.

Where things live: the SQLite store must be on a local disk (SQLite's locking is unreliable on
NFS/Lustre); the default data dir is under $HOME and so, on most clusters, on NFS: opening a
SQLite store there warns (detslurm.store.fs). Experiment dirs must be on a filesystem every
compute node sees.

The in-job side (launchers, trial processes) reads this module too: it imports only the standard
library and detslurm.errors, so that importing it stays cheap.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

from detslurm.errors import ConfigError, DetSlurmError

T = TypeVar("T")
PREFIX = "DETSLURM_"  # every variable's name starts with it


class Kind(enum.Enum):
    SETTING = "setting"  # set by the user or the admin
    PROTOCOL = "protocol"  # set by detslurm for a job or a process it starts


class Side(enum.Enum):
    """Where the variable is read."""

    LOGIN = "login"  # det, the daemon, the dashboard
    JOB = "job"  # launchers and trial processes on the compute nodes
    BOTH = "both"


class Source(enum.Enum):
    """Where an effective value came from (``det config``)."""

    ENVIRONMENT = "environment"
    CONFIG_FILE = "config file"
    DEFAULT = "default"


class Var(Generic[T]):
    """One environment variable. ``get`` parses it (a bad value is an error naming the variable).

    A plain class, not a dataclass: every launcher and trial process imports this module, and a
    dataclass costs about a millisecond to create.
    """

    __slots__ = ("name", "kind", "side", "type", "parse", "default", "help", "key", "default_doc")

    def __init__(
        self,
        name: str,
        kind: Kind,
        side: Side,
        type: str,  # as the docs name it: path, text, number, integer, flag, url, lines
        parse: Callable[[str], T],
        default: T,
        help: str,
        key: str | None = None,  # the user config file's key ("remote.det": nested)
        default_doc: str | None = None,  # a default computed at run time, as the docs say it
    ) -> None:
        self.name, self.kind, self.side, self.type = name, kind, side, type
        self.parse, self.default, self.help = parse, default, help
        self.key, self.default_doc = key, default_doc

    def __repr__(self) -> str:
        return f"<{self.name}>"

    def raw(self, env: Mapping[str, str] | None = None) -> str | None:
        """The value as set, or None when unset or empty."""
        value = (os.environ if env is None else env).get(self.name)
        return value or None

    def get(self, env: Mapping[str, str] | None = None) -> T:
        raw = self.raw(env)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError:
            raise DetSlurmError(f"${self.name} must be {_TYPE_TEXT.get(self.type, self.type)}, got {raw!r}") from None

    @property
    def default_text(self) -> str:
        if self.default_doc is not None:
            return self.default_doc
        if self.default is None or self.default == "":
            return "unset"
        return str(int(self.default)) if isinstance(self.default, bool) else str(self.default)


_TYPE_TEXT = {"number": "a number", "integer": "an integer", "flag": "0 or 1"}
REGISTRY: dict[str, Var[Any]] = {}


def _declare(var: Var[T]) -> Var[T]:
    if not var.name.startswith(PREFIX) or var.name in REGISTRY:
        raise AssertionError(f"bad or duplicate declaration {var.name}")
    REGISTRY[var.name] = var
    return var


def _flag(text: str) -> bool:
    return text.strip().lower() not in ("0", "false", "no", "off")


def _path(text: str) -> Path:
    return Path(text).expanduser()


def _text(name: str, kind: Kind, side: Side, help: str, default: str | None = None, **kw: Any) -> Var[str | None]:
    return _declare(Var(name, kind, side, kw.pop("type", "text"), str, default, help, **kw))


def _int(name: str, kind: Kind, side: Side, default: int, help: str, **kw: Any) -> Var[int]:
    return _declare(Var(name, kind, side, "integer", int, default, help, **kw))


def _pathvar(name: str, kind: Kind, side: Side, help: str, **kw: Any) -> Var[Path | None]:
    return _declare(Var(name, kind, side, "path", _path, None, help, **kw))


def _number(name: str, side: Side, default: float, help: str, **kw: Any) -> Var[float]:
    return _declare(Var(name, Kind.SETTING, side, "number", float, default, help, **kw))


def _flagvar(name: str, side: Side, help: str) -> Var[bool]:
    return _declare(Var(name, Kind.SETTING, side, "flag", _flag, False, help))


S, P = Kind.SETTING, Kind.PROTOCOL
LOGIN, JOB, BOTH = Side.LOGIN, Side.JOB, Side.BOTH

# -- settings read by det, the daemon and the dashboard ------------------------------------
CONFIG = _pathvar(
    "DETSLURM_CONFIG",
    S,
    BOTH,
    "The user config file (YAML; its keys are in the Key column).",
    default_doc="<user config dir>/detslurm/config.yaml",
)
DATA_DIR = _pathvar(
    "DETSLURM_DATA_DIR",
    S,
    BOTH,
    "The SQLite store and the daemon's files; on a local disk.",
    key="data_dir",
    default_doc="<user data dir>/detslurm",
)
DB_URL = _text(
    "DETSLURM_DB_URL",
    S,
    LOGIN,
    "The store: sqlite:///PATH, or postgresql+psycopg://... for several users or hosts.",
    type="url",
    key="db_url",
    default_doc="sqlite:///<data_dir>/detslurm.db",
)
EXPERIMENTS_DIR = _pathvar(
    "DETSLURM_EXPERIMENTS_DIR",
    S,
    BOTH,
    "Experiment dirs; on a filesystem every compute node mounts.",
    key="experiments_dir",
    default_doc="~/detslurm/experiments",
)
CHECKPOINT_DIR = _pathvar(
    "DETSLURM_CHECKPOINT_DIR",
    S,
    BOTH,
    "Checkpoints of experiments and off-cluster scripts that name no storage; on a filesystem all nodes mount.",
    key="checkpoint_dir",
    default_doc="<experiments_dir>/../checkpoints",
)
MAX_LOCAL_TRIALS = _int(
    "DETSLURM_MAX_LOCAL_TRIALS",
    S,
    LOGIN,
    2,
    "Trials that run at once without Slurm (--local); at least 1.",
    key="max_local_trials",
)
POLL_INTERVAL_S = _number(
    "DETSLURM_POLL_INTERVAL_S",
    LOGIN,
    0.5,
    "The daemon's tick, in seconds (never below the site's floor).",
    key="poll_interval_s",
)
ALLOW_NETWORK_DB = _flagvar(
    "DETSLURM_ALLOW_NETWORK_DB", LOGIN, "1: no warning about a SQLite store on a network filesystem."
)
SITE_CONFIG = _pathvar(
    "DETSLURM_SITE_CONFIG",
    S,
    LOGIN,
    "The user's own site file (adds pools and defaults; the limits of the admin's "
    "`/etc/detslurm/site.yaml` hold); unset: `<user config dir>/detslurm/site.yaml`.",
)
ADMIN_SITE_CONFIG = _pathvar(
    "DETSLURM_ADMIN_SITE_CONFIG",
    S,
    LOGIN,
    "Tests only: the admin's site file, read only where `/etc/detslurm/site.yaml` does not exist "
    "and only if root owns it and no one else may write it.",
)
SLURM_TIMEOUT_S = _number(
    "DETSLURM_SLURM_TIMEOUT_S", LOGIN, 30.0, "Seconds a Slurm command may take before it counts as failed."
)
DAEMON_IDLE_EXIT_S = _number(
    "DETSLURM_DAEMON_IDLE_EXIT_S", LOGIN, 600.0, "Seconds the daemon waits with nothing to watch, then exits."
)
DEBUG = _flagvar("DETSLURM_DEBUG", LOGIN, "1: an internal error of det prints its traceback.")
SSH_CONFIG = _pathvar(
    "DETSLURM_SSH_CONFIG", S, LOGIN, "The OpenSSH client config `det -m ssh://...` reads.", default_doc="~/.ssh/config"
)
REMOTE_DET = _text(
    "DETSLURM_REMOTE_DET",
    S,
    LOGIN,
    "The det that `det -m` runs on the login node (a path, or a venv).",
    key="remote.det",
    default="det",
)
REMOTE_SETUP = _text(
    "DETSLURM_REMOTE_SETUP",
    S,
    LOGIN,
    "Shell lines `det -m` runs before it (module load, source a venv).",
    type="lines",
    key="remote.setup",
)
REMOTE_PERSIST_S = _number(
    "DETSLURM_REMOTE_PERSIST_S",
    LOGIN,
    600.0,
    "Seconds `det -m` keeps an authenticated connection (0: none).",
    key="remote.persist_s",
)
TICK_STATS = _pathvar(
    "DETSLURM_TICK_STATS", S, LOGIN, "A file the daemon appends one JSON line per tick to (bench/asha_scale.py)."
)

# -- settings read in the job (set them in the config's environment.environment_variables) --
CHECKPOINT_SHARE = _text(
    "DETSLURM_CHECKPOINT_SHARE", S, JOB, "group: checkpoints readable by the group; unset: owner only."
)
CHECKPOINT_WRITEBACK = _text(
    "DETSLURM_CHECKPOINT_WRITEBACK",
    S,
    JOB,
    "0: no early writeback of checkpoint files while they are written.",
    default="1",
)
DIST_JOIN_TIMEOUT_S = _number(
    "DETSLURM_DIST_JOIN_TIMEOUT_S",
    JOB,
    300.0,
    "Seconds the Core API's ranks wait for each other to join (a framework's imports can take minutes).",
)
NETWORK_INTERFACE = _text(
    "DETSLURM_NETWORK_INTERFACE",
    S,
    JOB,
    "Horovod's network interface.",
    default_doc="the one that resolves to the node's name",
)
WORKDIR = _pathvar(
    "DETSLURM_WORKDIR", S, JOB, "The working dir of a trial run outside Slurm.", default_doc="the run dir"
)

# -- the job protocol: set by detslurm, read in the job ------------------------------------
TRIAL_DIR = _pathvar("DETSLURM_TRIAL_DIR", P, JOB, "The trial's dir (protocol/env.py).")
EXP_DIR = _pathvar("DETSLURM_EXP_DIR", P, JOB, "The experiment's dir (protocol/env.py).")
CHECKPOINT_BASE = _pathvar(
    "DETSLURM_CHECKPOINT_BASE", P, JOB, "The experiment's checkpoint storage base (protocol/env.py)."
)
NODE_TMPDIR = _text(
    "DETSLURM_NODE_TMPDIR", P, JOB, "The site config's node_tmpdir, as the batch shell expands it (exec/workdir.py)."
)
IN_CONTAINER = _text(
    "DETSLURM_IN_CONTAINER", P, JOB, "The container runtime the launcher runs in (slurm/containers.py)."
)
RUN_SECRET_FILE = _pathvar("DETSLURM_RUN_SECRET_FILE", P, JOB, "The run's secret file (protocol/secret.py).")
DIST_SECRET = _text(
    "DETSLURM_DIST_SECRET", P, JOB, "The run's secret, hex, handed by a launcher to its ranks (protocol/secret.py)."
)
DIST_PORT = _int("DETSLURM_DIST_PORT", P, JOB, 0, "The Core API's rendezvous port, chosen by the launcher.")
TORCH_PORT = _text("DETSLURM_TORCH_PORT", P, JOB, "torch.distributed's port under the Horovod launcher.")
FAILED_RANKS_DIR = _text(
    "DETSLURM_FAILED_RANKS_DIR", P, JOB, "Where a failed rank leaves a mark for its agent (launchers/_agent.py)."
)
PREEMPT_SIGNAL = _declare(
    Var(
        "DETSLURM_PREEMPT_SIGNAL",
        P,
        JOB,
        "text",
        str,
        "SIGUSR2",
        "The site's warning signal, from the site config (signal).",
    )
)


def config_path(env: Mapping[str, str] | None = None) -> Path:
    """The user config file: $DETSLURM_CONFIG, else platformdirs' per-user config dir."""
    return CONFIG.get(env) or _user_config_dir() / "config.yaml"


def site_config_path() -> Path | None:
    """$DETSLURM_SITE_CONFIG (even when missing: loading it then fails clearly), else the first
    site config file found, else None."""
    named = SITE_CONFIG.get()
    if named is not None:
        return named
    return next((p for p in (Path("/etc/detslurm/site.yaml"), _user_config_dir() / "site.yaml") if p.is_file()), None)


# platformdirs is imported where a default dir is needed, not with this module: the in-job side
# imports this module and mostly needs no dir.
def _user_config_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_config_dir("detslurm"))


def default_data_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("detslurm"))


def protocol_names() -> tuple[str, ...]:
    """The variables detslurm sets for a job: a process must never inherit stale ones."""
    return tuple(v.name for v in REGISTRY.values() if v.kind is Kind.PROTOCOL)


# -- the resolved settings of the login side ------------------------------------------------

# A closed set: a typo in the user config must fail loudly, not silently fall back to a default
# store (which would hide every experiment recorded in the real one).
_KEYS = frozenset(v.key.partition(".")[0] for v in REGISTRY.values() if v.key)


@dataclass(frozen=True)
class Settings:
    """The user's resolved settings; load() fills every field, so callers never see a missing value."""

    data_dir: Path
    db_url: str
    experiments_dir: Path
    checkpoint_dir: Path
    max_local_trials: int
    poll_interval_s: float

    @property
    def user_config_path(self) -> Path:
        return config_path()


def read_user_config(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The user config file as a mapping ({} when there is none); a ConfigError names a bad file."""
    path = config_path(env)
    try:
        if not path.exists():
            return {}
        text = path.read_text()
    except OSError as e:
        raise ConfigError([f"{path}: cannot read: {e.strerror}"], source="detslurm user config") from None
    # Imported only when there is a file to parse: most commands of most users have none, and
    # yaml is a tenth of `det t logs`' start-up.
    import yaml

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: {e}"], source="detslurm user config") from None
    # An empty file (or one of only comments) is the same as no file.
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: must be a mapping"], source="detslurm user config")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ConfigError(
            [f"{path}: unknown key {k!r}; valid keys: {', '.join(sorted(_KEYS))}" for k in unknown],
            source="detslurm user config",
        )
    return raw


def pick(var: Var[Any], cfg: Mapping[str, Any], env: Mapping[str, str] | None = None) -> tuple[Any, Source]:
    """``var``'s value as given (text from the environment, or the config file's value) and where
    it came from; (None, DEFAULT) when neither gives one."""
    raw = var.raw(env)
    if raw is not None:
        return raw, Source.ENVIRONMENT
    node: Any = cfg
    for part in (var.key or "").split(".") if var.key else ():
        node = node.get(part) if isinstance(node, dict) else None
    if var.key and node is not None:
        return node, Source.CONFIG_FILE
    return None, Source.DEFAULT


def _dir(var: Var[Any], cfg: Mapping[str, Any], env: Mapping[str, str] | None, default: Path) -> Path:
    given, _ = pick(var, cfg, env)
    return default if given is None else Path(str(given)).expanduser()


def experiment_dirs(cfg: Mapping[str, Any], env: Mapping[str, str] | None = None) -> tuple[Path, Path]:
    """(experiments dir, checkpoint dir) from ``env``, the user config ``cfg`` and the defaults:
    the login side and a detached run in a job must find the same dirs."""
    # Under $HOME by default: home is the filesystem every compute node is most likely to mount.
    exps = _dir(EXPERIMENTS_DIR, cfg, env, Path.home() / "detslurm" / "experiments")
    return exps, _dir(CHECKPOINT_DIR, cfg, env, exps.parent / "checkpoints")


def load() -> Settings:
    """Settings from the environment, the user config file and defaults, in that order of precedence."""
    cfg = read_user_config()

    def value(var: Var[Any], default: Any) -> Any:
        given, _ = pick(var, cfg)
        return default if given is None else given

    data_dir = _dir(DATA_DIR, cfg, None, default_data_dir())
    exp_dir, ckpt_dir = experiment_dirs(cfg)
    db_url = str(value(DB_URL, f"sqlite:///{data_dir / 'detslurm.db'}"))
    try:
        max_local = int(value(MAX_LOCAL_TRIALS, MAX_LOCAL_TRIALS.default))
        poll = float(value(POLL_INTERVAL_S, POLL_INTERVAL_S.default))
    except ValueError as e:
        raise ConfigError([f"detslurm settings: {e}"], source="detslurm user config") from None
    return Settings(
        data_dir=data_dir,
        db_url=db_url,
        experiments_dir=exp_dir,
        checkpoint_dir=ckpt_dir,
        # Clamped rather than rejected: 0 local slots would hang --local runs forever, and a near-zero
        # poll interval would spin a CPU on the login node.
        max_local_trials=max(1, max_local),
        poll_interval_s=max(0.05, poll),
    )


# -- what `det config` and the docs show ----------------------------------------------------


class Effective(NamedTuple):
    var: Var[Any]
    value: str
    source: Source

    def as_json(self) -> dict[str, Any]:
        v = self.var
        return {
            "name": v.name,
            "key": v.key,
            "value": self.value,
            "source": self.source.value,
            "type": v.type,
            "read_by": v.side.value,
            "default": v.default_text,
            "help": v.help,
        }


def effective() -> list[Effective]:
    """Every setting (not the protocol's variables) as this process resolves it, with its source."""
    cfg = read_user_config()
    st = load()
    resolved: dict[str, object] = {
        CONFIG.name: config_path(),
        SITE_CONFIG.name: site_config_path() or "",
        DATA_DIR.name: st.data_dir,
        DB_URL.name: _mask_url(st.db_url),
        EXPERIMENTS_DIR.name: st.experiments_dir,
        CHECKPOINT_DIR.name: st.checkpoint_dir,
        MAX_LOCAL_TRIALS.name: st.max_local_trials,
        POLL_INTERVAL_S.name: st.poll_interval_s,
        SSH_CONFIG.name: SSH_CONFIG.get() or Path.home() / ".ssh" / "config",
    }
    out = []
    for var in REGISTRY.values():
        if var.kind is not Kind.SETTING:
            continue
        given, source = pick(var, cfg)
        if var.name in resolved:
            text = str(resolved[var.name])
        elif given is None:
            # A default the docs describe in words (default_doc) has no value to show here.
            text = "" if var.default is None else var.default_text
        else:
            text = "; ".join(map(str, given)) if isinstance(given, list) else str(given)
        out.append(Effective(var, text, source))
    return out


def _mask_url(url: str) -> str:
    """``url`` with its password hidden (``det config`` output lands in logs and issues)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{host}"


def markdown() -> str:
    """docs/admin/settings.md: the registry as two tables (tests/unit/test_settings.py keeps them equal)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "# Settings",
        "",
        "<!-- Generated by `python -m detslurm.settings --markdown` from detslurm/settings.py; do not edit. -->",
        "",
        "Every `DETSLURM_*` environment variable detslurm reads. A setting comes from the environment,",
        "else from the user config file (`$DETSLURM_CONFIG`; the keys in the Key column), else its",
        "default; an empty variable counts as unset. `det config` prints the effective value of each",
        "setting and where it came from (`--json` for scripts).",
        "",
        "The user config file is YAML with the keys of the Key column (`remote.det` is `det` under `remote`):",
        "",
        "```yaml",
        "data_dir: /local/me/detslurm",
        "experiments_dir: /scratch/me/detslurm/experiments",
        "remote:",
        "  det: ~/venv/bin/det",
        "```",
        "",
        "Settings read in the job (*job* below) reach it through the experiment config's",
        "`environment.environment_variables`.",
        "",
        "| Variable | Key | Type | Default | Read by | Meaning |",
        "|---|---|---|---|---|---|",
    ]
    for v in REGISTRY.values():
        if v.kind is Kind.SETTING:
            key = f"`{v.key}`" if v.key else ""
            default = "unset" if v.default_text == "unset" else f"`{v.default_text}`"
            lines.append(f"| `{v.name}` | {key} | {v.type} | {cell(default)} | {v.side.value} | {cell(v.help)} |")
    lines += [
        "",
        "## Job protocol",
        "",
        "Set by detslurm for a job or for the processes a launcher starts; not settings.",
        "",
        "| Variable | Type | Meaning |",
        "|---|---|---|",
    ]
    lines += [f"| `{v.name}` | {v.type} | {cell(v.help)} |" for v in REGISTRY.values() if v.kind is Kind.PROTOCOL]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m detslurm.settings", description="detslurm settings")
    parser.add_argument("--markdown", action="store_true", help="print docs/admin/settings.md")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(), end="")
    else:
        parser.print_help()
