"""Site configs: resource pools are partitions, plus the site's signals, polling floor and setup.

Two layers (docs/admin/site-config.md). The admin's file, at the path fixed below
(:data:`ADMIN_SITE_CONFIG`), sets limits that hold whatever the user does: the polling floor and
``limits`` (partitions, accounts, QoS, maximum time). The user's own file ($DETSLURM_SITE_CONFIG,
else ~/.config/detslurm/site.yaml) may add pools and choose defaults, and may tighten a limit,
never loosen one. Validated like expconf: every error, with its path.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from detslurm import settings
from detslurm.errors import ConfigError
from detslurm.expconf.load import _pydantic_errors, parse_yaml
from detslurm.expconf.sbatch_args import check_sbatch_args
from detslurm.expconf.schema import Strict
from detslurm.slurm.containers import Runtime

ROOT = "<site-config>"
# The admin's file: a path fixed in the package, not a setting, so that nothing a user controls
# (environment, config files) can move it. See admin_site_path for the one test-only override.
ADMIN_SITE_CONFIG = Path("/etc/detslurm/site.yaml")
DEFAULT = "default"  # the origin of a value no file set

# Warning signals a site may choose. These go into the batch script unquoted (trap, kill -s), so
# the value must be one of a fixed set. Not USR1 (NCCL's own handler), KILL/STOP (cannot be
# caught), TERM (the script traps TERM itself: Slurm sends it to the step at preemption), CONT
# (Slurm sends it when resuming a suspended job, which would read as a warning).
SIGNALS = ("USR2", "HUP", "INT", "QUIT", "ALRM", "URG", "WINCH", "XCPU")
# A path, or a shell default expansion ``${VAR:-/abs/path}``: no quotes, `;`, `$(`, backticks or
# spaces, so the value is safe inside the script's double quotes.
_SAFE_PATH = r"/[A-Za-z0-9_./+@%,=-]*"
_NODE_TMPDIR = re.compile(rf"{_SAFE_PATH}|\$\{{[A-Za-z_][A-Za-z0-9_]*:-{_SAFE_PATH}\}}(/[A-Za-z0-9_./+@%,=-]*)?")
_PYTHON = re.compile(_SAFE_PATH)


class Pool(Strict):
    partition: str
    slot_type: Literal["gpu", "cpu"] = "cpu"
    slots_per_node: int = Field(default=1, ge=1)
    gres_name: str = "gpu"
    account: Optional[str] = None
    qos: Optional[str] = None
    time_limit_min: Optional[int] = Field(default=None, ge=1)
    extra_sbatch_args: list[str] = Field(default_factory=list)
    description: str = ""


class Limits(Strict):
    """What a site locks (``limits:``); unset: no limit. Every file may tighten these, none loosen."""

    partitions: Optional[list[str]] = None  # the partitions any pool (the user's too) may use
    accounts: Optional[list[str]] = None  # the values --account may take
    qos: Optional[list[str]] = None  # the values --qos may take
    max_time_min: Optional[int] = Field(default=None, ge=1)  # the longest --time, in minutes


class ContainerOptions(Strict):
    """How the site's container runtime is called (``container:`` in the site config)."""

    # The runtime's binary (an absolute path, or a name found on the nodes' PATH).
    executable: Optional[str] = None
    # Between the binary and its subcommand, e.g. podman's ["--runtime", "runc", "--cgroup-manager=cgroupfs"].
    global_options: list[str] = Field(default_factory=list)
    # After run/exec (podman: ["--ulimit", "nofile=1024:1024"]; pyxis: srun options).
    run_options: list[str] = Field(default_factory=list)
    # The interpreter inside images (they must have Python >= 3.10 for detslurm's launcher).
    python: str = "python3"
    # Which GPUs a GPU pool's containers get: NVIDIA (--nv, CDI) or AMD (--rocm, /dev/kfd).
    gpu_vendor: Literal["nvidia", "amd"] = "nvidia"

    @field_validator("global_options", "run_options")
    @classmethod
    def _one_word_each(cls, words: list[str]) -> list[str]:
        # Each is one argv word (quoted into the script); a newline would still break a log line.
        for i, word in enumerate(words):
            if any(ch in word for ch in "\0\r\n"):
                raise ValueError(f"item {i}: NUL, carriage return and newline are not allowed")
        return words

    @field_validator("executable", "python")
    @classmethod
    def _program(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_./+@%,=-]+", value):
            raise ValueError(f"{value!r} must be a program name or path made of letters, digits and _ . / + @ % , = -")
        return value


class SiteConfig(Strict):
    default_pool: str = ""
    pools: dict[str, Pool] = Field(default_factory=dict)
    # Never poll slurmctld more often than this, whatever a user asks for.
    poll_interval_s: float = Field(default=10.0, ge=0.5)
    signal: str = "USR2"  # one of SIGNALS (not USR1: NCCL installs its own USR1 handler)
    signal_lead_s: int = Field(default=300, ge=0)
    # How trials with environment.image run: slurm/containers.py (none = the nodes' own Python).
    # Strict models take no enum from YAML text: the value is checked against the enum's values.
    container_runtime: Runtime = Field(default=Runtime.NONE, strict=False)
    container: ContainerOptions = Field(default_factory=ContainerOptions)
    # Shell lines run (verbatim: written by the site's admins) before every trial, e.g. module load.
    setup: list[str] = Field(default_factory=list)
    python: Optional[str] = None  # the interpreter on compute nodes (default: the CLI's own)
    # Node-local base for trial working dirs (shell syntax, expanded by the batch shell). Unset:
    # $SLURM_TMPDIR, then a private per-job $TMPDIR, then $TMPDIR, then /tmp (exec/workdir.py).
    node_tmpdir: Optional[str] = None
    limits: Limits = Field(default_factory=Limits)
    # Root's audit log of `det --all-users` (detslurm/audit.py); only the admin's file sets it.
    audit_log: Optional[str] = None
    # Which file set each limit ("poll_interval_s", "limits.accounts", ...) and each pool
    # ("pools.NAME"): filled by load_site_config, read by origin().
    _origins: dict[str, str] = PrivateAttr(default_factory=dict)
    _files: list[Path] = PrivateAttr(default_factory=list)
    # The user's pools that the admin's file defines too (the admin's definition is used).
    _shadowed: list[str] = PrivateAttr(default_factory=list)

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        name = value.upper().removeprefix("SIG")
        if name in ("USR1", "KILL", "STOP"):
            raise ValueError(f"signal {value} cannot be used (USR1 is taken by NCCL; KILL/STOP cannot be caught)")
        if name not in SIGNALS:
            raise ValueError(f"signal {value!r} is not one of {', '.join(SIGNALS)}")
        return name

    @field_validator("node_tmpdir")
    @classmethod
    def _safe_node_tmpdir(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not _NODE_TMPDIR.fullmatch(value):
            raise ValueError(
                f"node_tmpdir {value!r} must be an absolute path or ${{VAR:-/absolute/path}}, "
                "made of letters, digits and _ . / + @ % , = - only"
            )
        return value

    @field_validator("python", "audit_log")
    @classmethod
    def _safe_python(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        if value is not None and not _PYTHON.fullmatch(value):
            raise ValueError(
                f"{info.field_name} {value!r} must be an absolute path made of letters, digits and "
                "_ . / + @ % , = - only"
            )
        return value

    @field_validator("setup")
    @classmethod
    def _setup_lines(cls, lines: list[str]) -> list[str]:
        # Lines stay verbatim (admins write shell here), but one line must stay one line.
        for i, line in enumerate(lines):
            if any(ch in line for ch in "\0\r\n"):
                raise ValueError(
                    f"line {i}: NUL, carriage return and newline are not allowed (one shell line per entry)"
                )
        return lines

    @model_validator(mode="after")
    def _default_pool_exists(self, info: ValidationInfo) -> SiteConfig:
        # A user's file over the admin's is checked once merged (its pools add to the admin's).
        if info.context and info.context.get("layer"):
            return self
        if self.pools and self.default_pool not in self.pools:
            valid = ", ".join(sorted(self.pools))
            raise ValueError(f"default_pool {self.default_pool!r} is not one of the pools: {valid}")
        return self

    def origin(self, key: str) -> str:
        """The file that set ``key`` (``poll_interval_s``, ``limits.qos``, ``pools.gpu``), or "default"."""
        return self._origins.get(key, DEFAULT)

    @property
    def files(self) -> list[Path]:
        """The site files read, the admin's first; [] when there are none."""
        return list(self._files)

    @property
    def shadowed_pools(self) -> list[str]:
        """The pools of the user's file that the admin's defines too: the admin's are used."""
        return list(self._shadowed)

    @property
    def runs_containers(self) -> bool:
        """environment.image is honoured (a runtime is configured)."""
        return self.container_runtime != Runtime.NONE

    def sbatch_arg_errors(self) -> list[str]:
        """Problems with the pools' extra_sbatch_args, validated like a user's sbatch_args."""
        return [
            line
            for name, pool in sorted(self.pools.items())
            for line in check_sbatch_args(pool.extra_sbatch_args, f"{ROOT}.pools.{name}.extra_sbatch_args")
        ]

    def pool(self, name: str) -> tuple[str, Pool]:
        """The pool for an expconf resource_pool ("" = the site default)."""
        name = name or self.default_pool
        if not self.pools:
            return name, Pool(partition=name)
        if name not in self.pools:
            raise ConfigError(
                [
                    f"<config>.resources.resource_pool: resource pool {name!r} does not exist; "
                    f"valid pools: {', '.join(sorted(self.pools))}"
                ]
            )
        return name, self.pools[name]


def _read(path: Path, root_owned: bool = False, layer: bool = False) -> SiteConfig:
    """One site file, validated; with ``root_owned``, refused unless root owns it and no one
    else may write it (checked on the open file, so it cannot be swapped after the check);
    ``layer``: a user's file read over the admin's (merge checks what needs both)."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if root_owned and (st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
                raise ConfigError(
                    [f"{path}: an admin site config must be owned by root and writable by no one else"],
                    source=f"${settings.ADMIN_SITE_CONFIG.name}",
                )
            text = fh.read().decode("utf-8", errors="replace")
    except OSError as e:
        raise ConfigError([f"{path}: cannot read the site config: {e.strerror}"], source="site config") from None
    raw = parse_yaml(text, ROOT)
    try:
        site = SiteConfig.model_validate(raw, context={"layer": layer})
    except ValidationError as e:
        raise ConfigError(sorted(_pydantic_errors(e, ROOT, SiteConfig)), source=f"site config {path}") from None
    errors = site.sbatch_arg_errors()
    if errors:
        raise ConfigError(errors, source=f"site config {path}")
    site._files = [path]
    site._origins = {f"pools.{name}": str(path) for name in site.pools}
    site._origins.update({key: str(path) for key in _limit_keys(site)})
    return site


def _limit_keys(site: SiteConfig) -> list[str]:
    """The limits ``site`` sets itself (not left at their defaults)."""
    keys = [f"limits.{name}" for name in site.limits.model_fields_set if getattr(site.limits, name) is not None]
    return [*keys, "poll_interval_s"] if "poll_interval_s" in site.model_fields_set else keys


def admin_site_path(env: Optional[dict[str, str]] = None) -> Optional[Path]:
    """The admin's site file: :data:`ADMIN_SITE_CONFIG` when it exists. Only where it does not,
    $DETSLURM_ADMIN_SITE_CONFIG may name another (for tests), and _read then requires root to
    own that file: a user who sets the variable gains nothing, since with no admin file there is
    no limit to escape, and a file of their own is refused."""
    if ADMIN_SITE_CONFIG.exists():
        return ADMIN_SITE_CONFIG
    return settings.ADMIN_SITE_CONFIG.get(env)


def user_site_path() -> Optional[Path]:
    """The user's own site file: $DETSLURM_SITE_CONFIG (even when missing: loading then fails
    clearly), else ~/.config/detslurm/site.yaml where it exists."""
    named = settings.SITE_CONFIG.get()
    if named is not None:
        return named
    import platformdirs

    path = Path(platformdirs.user_config_dir("detslurm")) / "site.yaml"
    return path if path.is_file() else None


def load_site_config(path: Optional[Path] = None) -> SiteConfig:
    """``path`` alone; else the admin's file and the user's, merged (the admin's limits hold)."""
    if path is not None:
        return _read(path)
    admin_path, user_path = admin_site_path(), user_site_path()
    admin = _read(admin_path, root_owned=admin_path != ADMIN_SITE_CONFIG) if admin_path else None
    same = admin_path is not None and user_path is not None and _same_file(admin_path, user_path)
    user = _read(user_path, layer=admin is not None) if user_path is not None and not same else None
    site = merge(admin, user) if admin is not None and user is not None else admin or user or SiteConfig()
    errors = limit_errors(site)
    if errors:
        raise ConfigError(errors, source="site config: over the site's limits")
    return site


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def _tighter(a: Optional[list[str]], b: Optional[list[str]]) -> Optional[list[str]]:
    """The values both allow (None: any)."""
    if a is None or b is None:
        return b if a is None else a
    return [v for v in a if v in b]


def merge(admin: SiteConfig, user: SiteConfig) -> SiteConfig:
    """The user's file over the admin's: its defaults win, its pools are added, its setup lines
    run after the admin's, and each limit is the stricter of the two."""
    a_path, u_path = str(admin.files[0]), str(user.files[0])
    raw: dict[str, Any] = admin.model_dump(exclude_unset=True)
    mine = user.model_dump(exclude_unset=True)
    for key in set(mine) - {"pools", "limits", "setup", "poll_interval_s", "audit_log"}:
        raw[key] = mine[key]
    # A pool of the admin's stays the admin's (a file `det site init` wrote before the admin
    # installed one names the same pools): the doctor names the user's pools left unused.
    raw["pools"] = {**mine.get("pools", {}), **raw.get("pools", {})}
    raw["setup"] = [*admin.setup, *user.setup]
    raw["poll_interval_s"] = max(admin.poll_interval_s, user.poll_interval_s)
    lim, ulim = admin.limits, user.limits
    raw["limits"] = {
        "partitions": _tighter(lim.partitions, ulim.partitions),
        "accounts": _tighter(lim.accounts, ulim.accounts),
        "qos": _tighter(lim.qos, ulim.qos),
        "max_time_min": min((m for m in (lim.max_time_min, ulim.max_time_min) if m is not None), default=None),
    }
    try:
        site = SiteConfig.model_validate(_plain(raw), strict=False)
    except ValidationError as e:
        raise ConfigError(sorted(_pydantic_errors(e, ROOT, SiteConfig)), source=f"site config {u_path}") from None
    site._files = [*admin.files, *user.files]
    site._shadowed = sorted(set(admin.pools) & set(user.pools))
    # The admin's file is named for every limit it holds at least as tightly as the user's.
    site._origins = {**user._origins, **{k: v for k, v in admin._origins.items() if k.startswith("pools.")}}
    for name in ("partitions", "accounts", "qos", "max_time_min"):
        key = f"limits.{name}"
        if getattr(lim, name) is not None and getattr(site.limits, name) == getattr(lim, name):
            site._origins[key] = a_path
    if "poll_interval_s" in admin._origins and site.poll_interval_s == admin.poll_interval_s:
        site._origins["poll_interval_s"] = a_path
    return site


def _plain(raw: dict[str, Any]) -> dict[str, Any]:
    """Enum members as their values: the model validates YAML-like data."""
    out = dict(raw)
    if isinstance(out.get("container_runtime"), Runtime):
        out["container_runtime"] = out["container_runtime"].value
    return out


def limit_errors(site: SiteConfig) -> list[str]:
    """Pools that break the site's limits, each naming the pool's file and the limit's."""
    lim, out = site.limits, []
    for name, pool in sorted(site.pools.items()):
        at = f"{site.origin(f'pools.{name}')}: {ROOT}.pools.{name}"
        checks = (
            ("partitions", pool.partition, "partition"),
            ("accounts", pool.account, "account"),
            ("qos", pool.qos, "qos"),
        )
        for limit, value, field in checks:
            allowed = getattr(lim, limit)
            if value is not None and allowed is not None and value not in allowed:
                out.append(
                    f"{at}.{field}: {value!r} is not allowed by the site "
                    f"(limits.{limit} in {site.origin(f'limits.{limit}')}: {', '.join(allowed) or 'none'})"
                )
        if pool.time_limit_min and lim.max_time_min and pool.time_limit_min > lim.max_time_min:
            out.append(
                f"{at}.time_limit_min: {pool.time_limit_min} is over the site's maximum "
                f"(limits.max_time_min {lim.max_time_min} in {site.origin('limits.max_time_min')})"
            )
    return out
