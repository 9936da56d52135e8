"""detslurm's API under Determined's names, so scripts written for Determined run unchanged.

Found through ``detslurm._compat.finder`` (or PYTHONPATH inside trials) only when no real
``determined`` package is installed. Every name resolves lazily through ``detslurm``'s own
top level, so ``import determined`` stays as cheap as ``import detslurm`` (no torch).
"""

from typing import Any as _Any

import detslurm as _detslurm
from detslurm import LOG_FORMAT, InvalidHP

# Attribute access only; `from determined import core` finds the subpackages in this directory.
_FORWARDED = (
    "core",
    "pytorch",
    "experimental",
    "launch",
    "get_cluster_info",
    "import_from_path",
    "ClusterInfo",
    "RendezvousInfo",
    "ResourcesInfo",
    "TrialInfo",
)


def __getattr__(name: str) -> _Any:
    if name in _FORWARDED:
        import importlib

        if name in ("core", "pytorch", "experimental", "launch"):
            # Our own `determined.<name>` subpackage, so `determined.core is det.core` holds
            # whichever way it was first imported.
            return importlib.import_module(f"{__name__}.{name}")
        return getattr(_detslurm, name)
    raise AttributeError(f"module 'determined' has no attribute {name!r}")


def __dir__() -> list:  # type: ignore[type-arg]
    return sorted({*globals(), *_FORWARDED})


__all__ = ["InvalidHP", "LOG_FORMAT", *_FORWARDED]
