"""Site configs: resource pools are partitions, plus the site's signals, polling floor and setup.

Found via $DETSLURM_SITE_CONFIG, then /etc/detslurm/site.yaml, then the user's config dir
(~/.config/detslurm/site.yaml). Validated like expconf: every error, with its path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, ValidationError, field_validator, model_validator

from detslurm import settings
from detslurm.errors import ConfigError
from detslurm.expconf.load import _pydantic_errors, parse_yaml
from detslurm.expconf.sbatch_args import check_sbatch_args
from detslurm.expconf.schema import Strict
from detslurm.slurm.containers import Runtime

ROOT = "<site-config>"

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

    @field_validator("python")
    @classmethod
    def _safe_python(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not _PYTHON.fullmatch(value):
            raise ValueError(
                f"python {value!r} must be an absolute path made of letters, digits and _ . / + @ % , = - only"
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
    def _default_pool_exists(self) -> SiteConfig:
        if self.pools and self.default_pool not in self.pools:
            valid = ", ".join(sorted(self.pools))
            raise ValueError(f"default_pool {self.default_pool!r} is not one of the pools: {valid}")
        return self

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


def load_site_config(path: Optional[Path] = None) -> SiteConfig:
    path = path or settings.site_config_path()
    if path is None:
        return SiteConfig()
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError([f"{path}: cannot read the site config: {e.strerror}"], source="site config") from None
    raw = parse_yaml(text, ROOT)
    try:
        site = SiteConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(sorted(_pydantic_errors(e, ROOT, SiteConfig)), source=f"site config {path}") from None
    errors = site.sbatch_arg_errors()
    if errors:
        raise ConfigError(errors, source=f"site config {path}")
    return site
