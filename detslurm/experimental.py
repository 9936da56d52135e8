"""``det.experimental``: Determined's experimental namespace, as far as detslurm has it.

``from determined.experimental import client`` then ``client.get_checkpoint(uuid)`` (seed 003's
checkpoint loading) works unchanged, and so do the SDK's classes at this level
(``det.experimental.Determined()``, ``Experiment``, ``Trial``, ``Checkpoint``...). ``client``
reads the login node's store, so it is imported on first use only: scripts that merely
``import determined`` never pay for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detslurm import client
    from detslurm._compat.determined.experimental import checkpoint, metrics
    from detslurm.core import v2 as core_v2
    from detslurm.pytorch._test_one_batch import test_one_batch

# The SDK's classes, re-exported from the client module as Determined's namespace does.
_FROM_CLIENT = frozenset(
    {
        "Checkpoint",
        "Determined",
        "Experiment",
        "ExperimentReference",
        "OrderBy",
        "Trial",
        "TrialOrderBy",
        "TrialReference",
        "TrialSortBy",
    }
)


# A module __getattr__ (PEP 562) makes `client` lazy without changing how it is imported.
def __getattr__(name: str) -> Any:
    if name == "client":
        return importlib.import_module("detslurm.client")
    if name in _FROM_CLIENT:
        return getattr(importlib.import_module("detslurm.client"), name)
    if name in ("checkpoint", "metrics"):
        # Determined's submodules of SDK classes; theirs and ours hold the same classes as client.
        return importlib.import_module(f"detslurm._compat.determined.experimental.{name}")
    if name == "test_one_batch":
        from detslurm.pytorch._test_one_batch import test_one_batch

        return test_one_batch
    if name == "core_v2":
        # In-job code: the singleton Core API, managed or detached (detslurm/core/v2.py).
        return importlib.import_module("detslurm.core.v2")
    raise AttributeError(f"module 'detslurm.experimental' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = ["checkpoint", "client", "core_v2", "metrics", "test_one_batch", *sorted(_FROM_CLIENT)]
