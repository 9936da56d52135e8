"""The checkpoint settings a trial reads from its environment, checked in one place: by the
trial when it builds its checkpoint context, and by ``det e create`` when a config sets them in
``environment.environment_variables``, so a typo fails at create, not in the queued job.

Standard library only (detslurm.settings is too): the config check imports this on every create.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from detslurm import settings

SHARE_ENV = settings.CHECKPOINT_SHARE.name
# "0" turns the early writeback off (a filesystem where starting the writes of a checkpoint
# while it is written costs more than it overlaps); "1" or unset: on.
WRITEBACK_ENV = settings.CHECKPOINT_WRITEBACK.name


@dataclass(frozen=True)
class Modes:
    """The modes a checkpoint's dirs, files and owner-executable files get."""

    dir: int = 0o700
    file: int = 0o600
    exe: int = 0o700


def checkpoint_modes(env: Mapping[str, str]) -> Modes:
    """Owner-only, or group-readable with ``DETSLURM_CHECKPOINT_SHARE=group``."""
    share = (settings.CHECKPOINT_SHARE.raw(env) or "").strip().lower()
    if share == "group":
        return Modes(0o750, 0o640, 0o750)
    if share not in ("", "none", "private"):
        raise ValueError(f"{SHARE_ENV}={share!r}: expected 'group' or nothing")
    return Modes()


def early_writeback(env: Mapping[str, str]) -> bool:
    """Whether store_path starts writing large files to disk while they are written (_writeback)."""
    value = (settings.CHECKPOINT_WRITEBACK.raw(env) or "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{WRITEBACK_ENV}={value!r}: expected 0 or 1")
    return value != "0"


# Each setting's parser: raises ValueError naming the setting and what it expects.
CHECKS: dict[str, Callable[[Mapping[str, str]], object]] = {
    SHARE_ENV: checkpoint_modes,
    WRITEBACK_ENV: early_writeback,
}
