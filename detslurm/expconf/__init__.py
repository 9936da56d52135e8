"""Experiment configuration (Determined expconf v0): parse, override, fill defaults, validate.

:mod:`detslurm.expconf.view` reads a stored config (standard library only: trials, launchers
and the read commands use it). Everything else here imports pydantic (about 0.1 s), so its names
load on first use (PEP 562), and importing the view does not pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detslurm.expconf.load import (
        ExperimentConfig,
        apply_overrides,
        from_stored,
        load_config,
        parse_yaml,
        validate,
    )
    from detslurm.expconf.schema import Length
    from detslurm.expconf.view import merge_config

# name -> the module that defines it
_LAZY = {
    "ExperimentConfig": "load",
    "apply_overrides": "load",
    "from_stored": "load",
    "load_config": "load",
    "merge_config": "view",
    "parse_yaml": "load",
    "validate": "load",
    "Length": "schema",
}
__all__ = [
    "ExperimentConfig",
    "Length",
    "apply_overrides",
    "from_stored",
    "load_config",
    "merge_config",
    "parse_yaml",
    "validate",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
