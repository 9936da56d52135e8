"""``determined.experimental``: ``client`` loads on first use (it needs the login node's store)."""

from typing import Any as _Any


def __getattr__(name: str) -> _Any:
    from detslurm import experimental

    return getattr(experimental, name)


__all__ = ["client", "core_v2"]
