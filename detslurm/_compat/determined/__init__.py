"""detslurm's API under Determined's names, so scripts written for Determined run unchanged."""

import contextlib as _contextlib
import sys as _sys
from collections.abc import Iterator as _Iterator
from pathlib import Path as _Path
from typing import Any as _Any

from detslurm import core
from detslurm.core import get_cluster_info
from detslurm.errors import InvalidHP

LOG_FORMAT = "%(levelname)s: [%(process)s] %(name)s: %(message)s"


@_contextlib.contextmanager
def import_from_path(path: "str | _Path") -> _Iterator[None]:
    """Import modules from ``path`` inside the block, then forget them again, so an older
    model_def.py (from a checkpoint's code/) and the current one never collide."""
    path = str(path)
    before = set(_sys.modules)
    _sys.path.insert(0, path)
    try:
        yield
    finally:
        with _contextlib.suppress(ValueError):
            _sys.path.remove(path)
        for name in set(_sys.modules) - before:
            mod = _sys.modules.get(name)
            origin = str(getattr(mod, "__file__", "") or "")
            if origin.startswith(path):
                del _sys.modules[name]


def __getattr__(name: str) -> _Any:
    # Heavy or optional parts load on first use only.
    if name == "pytorch":
        import importlib

        return importlib.import_module("detslurm.pytorch")
    if name == "experimental":
        from determined import experimental

        return experimental
    raise AttributeError(name)


__all__ = ["InvalidHP", "LOG_FORMAT", "core", "get_cluster_info", "import_from_path"]
