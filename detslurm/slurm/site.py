"""Site configs: resource pools are partitions, plus the site's signals, polling floor and setup.

Found via $DETSLURM_SITE_CONFIG, then /etc/detslurm/site.yaml, then the user's config dir
(~/.config/detslurm/site.yaml). Validated like expconf: every error, with its path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

import platformdirs
from pydantic import Field, ValidationError, model_validator

from detslurm.errors import ConfigError
from detslurm.expconf.load import _pydantic_errors, parse_yaml
from detslurm.expconf.schema import Strict

ROOT = "<site-config>"


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


class SiteConfig(Strict):
    default_pool: str = ""
    pools: dict[str, Pool] = Field(default_factory=dict)
    # Never poll slurmctld more often than this, whatever a user asks for.
    poll_interval_s: float = Field(default=10.0, ge=0.5)
    signal: str = "USR2"  # not USR1: NCCL installs its own USR1 handler
    signal_lead_s: int = Field(default=300, ge=0)
    container_runtime: Literal["none", "apptainer", "singularity", "pyxis"] = "none"
    # Shell lines run (verbatim: written by the site's admins) before every trial, e.g. module load.
    setup: list[str] = Field(default_factory=list)
    python: Optional[str] = None  # the interpreter on compute nodes (default: the CLI's own)
    node_tmpdir: str = "${TMPDIR:-/tmp}"  # node-local base for trial working dirs (shell syntax)

    @model_validator(mode="after")
    def _default_pool_exists(self) -> SiteConfig:
        if self.pools and self.default_pool not in self.pools:
            valid = ", ".join(sorted(self.pools))
            raise ValueError(f"default_pool {self.default_pool!r} is not one of the pools: {valid}")
        if self.signal.upper().removeprefix("SIG") in ("USR1", "KILL", "STOP"):
            raise ValueError(f"signal {self.signal} cannot be used (USR1 is taken by NCCL; KILL/STOP cannot be caught)")
        return self

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


def site_config_path() -> Optional[Path]:
    env = os.environ.get("DETSLURM_SITE_CONFIG")
    candidates = (
        [Path(env)]
        if env
        else [Path("/etc/detslurm/site.yaml"), Path(platformdirs.user_config_dir("detslurm")) / "site.yaml"]
    )
    return next((p for p in candidates if p.is_file()), Path(env) if env else None)


def load_site_config(path: Optional[Path] = None) -> SiteConfig:
    path = path or site_config_path()
    if path is None:
        return SiteConfig()
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError([f"{path}: cannot read the site config: {e.strerror}"], source="site config") from None
    raw = parse_yaml(text, ROOT)
    try:
        return SiteConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(sorted(_pydantic_errors(e, ROOT, SiteConfig)), source=f"site config {path}") from None
