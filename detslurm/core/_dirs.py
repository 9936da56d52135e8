"""Where a script's experiments and checkpoints go when no trial says so (a detached run, a
script run off-cluster): the login side's settings, read from the process's environment."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from detslurm import settings
from detslurm.errors import ConfigError

log = logging.getLogger("detslurm.core")


@dataclass(frozen=True)
class UserDirs:
    """The experiments and checkpoint dirs, resolved as the login side's settings do."""

    experiments: Path
    checkpoints: Path


def user_dirs(env: Mapping[str, str]) -> UserDirs:
    """The environment, then the user config file, then the defaults, as ``detslurm.settings``
    resolves them for the login side."""
    try:
        cfg = settings.read_user_config(env)
    except ConfigError as e:
        # A broken config file is the login side's error to report; a job falls back to defaults.
        log.warning("ignoring the detslurm config: %s", e)
        cfg = {}
    return UserDirs(*settings.experiment_dirs(cfg, env))
