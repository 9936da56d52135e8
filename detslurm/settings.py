"""Where detslurm keeps things: the store (local disk) and experiment dirs (shared filesystem).

Precedence: environment variables > the user's config file > defaults. The SQLite store must
live on a local disk: SQLite's locking is unreliable on NFS/Lustre (Optuna's "database disk
image is malformed" history). The default data dir is platformdirs' per-user data dir, which is
under $HOME and so, on most clusters, on NFS: opening a SQLite store there warns (see
detslurm.store.fs), pointing to ``db_url``/``DETSLURM_DB_URL`` (PostgreSQL) or
``DETSLURM_DATA_DIR`` (a local disk); ``DETSLURM_ALLOW_NETWORK_DB=1`` silences it.
Experiment dirs must be on a filesystem every compute node sees (home or scratch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

from detslurm.errors import ConfigError

# A closed set: a typo in the user config must fail loudly, not silently fall back to a default
# store (which would hide every experiment recorded in the real one).
_KEYS = {"db_url", "experiments_dir", "checkpoint_dir", "data_dir", "max_local_trials", "poll_interval_s", "remote"}


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


def config_path() -> Path:
    """The user config file: $DETSLURM_CONFIG, else platformdirs' per-user config dir."""
    env = os.environ.get("DETSLURM_CONFIG")
    if env:
        return Path(env)
    return Path(platformdirs.user_config_dir("detslurm")) / "config.yaml"


def _read_user_config() -> dict[str, Any]:
    path = config_path()
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


def load() -> Settings:
    """Settings from the environment, the user config file and defaults, in that order of precedence."""
    cfg = _read_user_config()

    def pick(key: str, default: Any) -> Any:
        # An empty variable counts as unset, so ``DETSLURM_DB_URL= det ...`` falls back instead of
        # producing an empty database URL.
        env = os.environ.get(f"DETSLURM_{key.upper()}")
        if env:
            return env
        return cfg.get(key, default)

    data_dir = Path(pick("data_dir", platformdirs.user_data_dir("detslurm"))).expanduser()
    # Under $HOME by default: home is the filesystem every compute node is most likely to mount.
    exp_dir = Path(pick("experiments_dir", Path.home() / "detslurm" / "experiments")).expanduser()
    ckpt_dir = Path(pick("checkpoint_dir", exp_dir.parent / "checkpoints")).expanduser()
    db_url = str(pick("db_url", f"sqlite:///{data_dir / 'detslurm.db'}"))
    try:
        max_local = int(pick("max_local_trials", 2))
        poll = float(pick("poll_interval_s", 0.5))
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
