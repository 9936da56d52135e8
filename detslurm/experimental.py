"""``det.experimental``: Determined's experimental namespace, as far as detslurm has it.

``from determined.experimental import client`` then ``client.get_checkpoint(uuid)`` (seed 003's
checkpoint loading) works unchanged. ``client`` reads the login node's store, so it is imported
on first use only: scripts that merely ``import determined`` never pay for SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detslurm import client
    from detslurm.core import v2 as core_v2


# A module __getattr__ (PEP 562) makes `client` lazy without changing how it is imported.
def __getattr__(name: str) -> Any:
    if name == "client":
        return importlib.import_module("detslurm.client")
    if name == "core_v2":
        # In-job code: the singleton Core API, managed or detached (detslurm/core/v2.py).
        return importlib.import_module("detslurm.core.v2")
    raise AttributeError(f"module 'detslurm.experimental' has no attribute {name!r}")


__all__ = ["client", "core_v2"]
