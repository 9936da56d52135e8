"""Modules loaded on first use, for the CLI's read paths.

`det e list` must answer 10k experiments in 0.3 s (bench/README.md), and importing the store's ORM,
the controller and pydantic costs more than that. The command modules name their heavy
dependencies through :func:`lazy_module` (under ``if not TYPE_CHECKING``, so mypy still sees
the real module), and a command that never touches one never loads it.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_module(name: str) -> ModuleType:
    """The module ``name``, whose code runs at its first attribute access (the stdlib's
    LazyLoader). An already imported module is returned as it is."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        # A typo in a module name must fail here, at import, not at the first use in a command.
        raise ImportError(f"no module named {name!r}")
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
