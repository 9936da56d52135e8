"""detslurm's API under Determined's names, so scripts written for Determined run unchanged."""

import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path
from typing import Any as _Any

from detslurm import core
from detslurm.core import get_cluster_info
from detslurm.errors import InvalidHP

LOG_FORMAT = "%(levelname)s: [%(process)s] %(name)s: %(message)s"


def import_from_path(module_name: str, file_path: "str | _Path") -> _Any:
    """Import a module from a file path under a name (e.g. to load code saved in a checkpoint)."""
    spec = _ilu.spec_from_file_location(module_name, str(file_path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {module_name} from {file_path}")
    module = _ilu.module_from_spec(spec)
    _sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


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
