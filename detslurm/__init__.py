"""detslurm: Determined's experiment workflow on Slurm, with no master server and no root.

The in-job API lives in :mod:`detslurm.core` (Core API) and :mod:`detslurm.pytorch` (Trainer API);
the login-node side in :mod:`detslurm.cli`, :mod:`detslurm.controller` and :mod:`detslurm.store`.

``import detslurm as det`` offers Determined's top-level names (``det.core``, ``det.pytorch``,
``det.get_cluster_info``, ``det.InvalidHP``, ``det.import_from_path``, ``det.LOG_FORMAT``,
``det.experimental``, ``det.launch``), so ``import determined as det`` scripts can switch by
changing one line. Heavy parts load on first attribute access only (PEP 562): this module must
stay cheap for ``det --help``, and a ``.pth`` file imports it at every interpreter start.
"""

from __future__ import annotations

import importlib

from detslurm.errors import DetSlurmError, InvalidHP

# Not `from typing import ...`: this module runs at every interpreter start (the .pth above), and
# importing typing there (with re, collections and contextlib behind it) cost about 5 ms each
# time. mypy treats any name TYPE_CHECKING as true.
TYPE_CHECKING = False

__version__ = "0.1.0"

# Determined's format for Python logging; its log shipper parses the level out of it.
LOG_FORMAT = "%(levelname)s: [%(process)s] %(name)s: %(message)s"

# Subpackages reached as attributes, and functions re-exported from the module that owns them.
_SUBMODULES = frozenset({"core", "pytorch", "experimental", "launch"})
_FUNCTIONS = {
    "get_cluster_info": "detslurm.core._info",
    "import_from_path": "detslurm.util",
    # Determined's info types (the trial env contract decodes into them).
    "ClusterInfo": "detslurm.protocol.env",
    "RendezvousInfo": "detslurm.protocol.env",
    "ResourcesInfo": "detslurm.protocol.env",
    "TrialInfo": "detslurm.protocol.env",
}

if TYPE_CHECKING:
    from typing import Any

    from detslurm import core, experimental, launch, pytorch
    from detslurm.core._info import get_cluster_info
    from detslurm.protocol.env import ClusterInfo, RendezvousInfo, ResourcesInfo, TrialInfo
    from detslurm.util import import_from_path


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"detslurm.{name}")
    if name in _FUNCTIONS:
        value = getattr(importlib.import_module(_FUNCTIONS[name]), name)
        globals()[name] = value  # resolve once
        return value
    raise AttributeError(f"module 'detslurm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES, *_FUNCTIONS})


__all__ = [
    "LOG_FORMAT",
    "ClusterInfo",
    "RendezvousInfo",
    "ResourcesInfo",
    "TrialInfo",
    "DetSlurmError",
    "InvalidHP",
    "__version__",
    "core",
    "experimental",
    "get_cluster_info",
    "import_from_path",
    "launch",
    "pytorch",
]
