"""Print the public surface of ``determined`` as JSON, one entry per dotted path.

Run as a script by tests/unit/compat/test_determined_oracle_surface.py twice: by the real determined's
interpreter (.venv-determined, scripts/oracle-venv) and by ours, where ``import determined`` is
detslurm's compatibility package. Standard library only, and it imports nothing of the tests.

What counts as public: every name of a listed module not starting with ``_``, except what the
module merely imported for its own use (another project's modules, ``typing`` names, loggers);
the public submodules of each listed package (``determined.launch.torch_distributed``); and, for
every class of the API, its public members. A class met again under another path is recorded
as an alias of the first path (``determined.core.DistributedContext`` is the same class as
``determined.experimental.core_v2.DistributedContext``), so each class is compared once.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import inspect
import io
import json
import logging
import pkgutil
import sys
import types
import typing
import warnings
from typing import Any

MODULES = [
    "determined",
    "determined.core",
    "determined.pytorch",
    "determined.pytorch.samplers",
    "determined.pytorch.deepspeed",
    "determined.pytorch.experimental",
    "determined.experimental",
    "determined.experimental.client",
    "determined.experimental.core_v2",
    "determined.launch",
]
# Packages whose API objects are described (ours live in detslurm and are re-exported).
API_PACKAGES = ("determined", "detslurm")
PRIMITIVES = (type(None), bool, int, float, str)

Entry = dict[str, Any]


def is_api(obj: object) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in API_PACKAGES


def shown(value: object) -> str:
    """A default or a constant as compared: its repr for plain values, else its kind."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, PRIMITIVES):
        return repr(value)
    if isinstance(value, (tuple, list, frozenset)) and all(isinstance(v, PRIMITIVES) for v in value):
        return repr(value)
    return f"<{type(value).__name__}>"


def signature(obj: Any) -> str | None:
    """Parameters as ``(a, b=1, *, c)``: names, kinds and defaults; annotations are not compared."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    parts: list[str] = []
    star_done = False
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star_done = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star_done:
                parts.append("*")
                star_done = True
            parts.append(p.name if p.default is p.empty else f"{p.name}={shown(p.default)}")
            if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
                parts.append("/")
    return "(" + ", ".join(parts) + ")"


def imported_for_own_use(name: str, obj: object) -> bool:
    if isinstance(obj, types.ModuleType):
        return obj.__name__.split(".")[0] not in API_PACKAGES
    if getattr(typing, name, None) is obj or isinstance(obj, typing.TypeVar):
        return True
    return isinstance(obj, logging.Logger)


def is_type_alias(obj: object) -> bool:
    return typing.get_origin(obj) is not None or isinstance(obj, types.UnionType)


class Walker:
    def __init__(self) -> None:
        self.out: dict[str, Entry] = {}
        self.seen: dict[int, str] = {}

    def walk(self, names: list[str]) -> None:
        modules = {name: mod for name in names if (mod := self.load(name)) is not None}
        # A class's own path is where a module names it, before any member refers to it.
        for name, mod in modules.items():
            for attr, obj in self.public(mod):
                if isinstance(obj, type):
                    self.seen.setdefault(id(obj), f"{name}.{attr}")
        for name, mod in modules.items():
            self.module(name, mod)

    @staticmethod
    def load(name: str) -> types.ModuleType | None:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            return None  # absent: the comparison reports it

    @staticmethod
    def public(mod: types.ModuleType) -> list[tuple[str, Any]]:
        attrs = sorted(a for a in dir(mod) if not a.startswith("_"))
        return [(a, obj) for a in attrs if not imported_for_own_use(a, obj := getattr(mod, a))]

    def module(self, name: str, mod: types.ModuleType) -> None:
        self.out[name] = {"kind": "module"}
        for attr, obj in self.public(mod):
            self.value(f"{name}.{attr}", obj, depth=0)
        for sub in pkgutil.iter_modules(getattr(mod, "__path__", [])):
            path = f"{name}.{sub.name}"
            if name != "determined" and not sub.name.startswith("_") and path not in self.out:
                self.out[path] = {"kind": "module"}

    def value(self, path: str, obj: object, depth: int) -> None:
        if isinstance(obj, types.ModuleType):
            self.out[path] = {"kind": "module"}
        elif isinstance(obj, type) and is_api(obj):
            first = self.seen.setdefault(id(obj), path)
            if first != path:
                self.out[path] = {"kind": "alias", "of": first}
            else:
                self.klass(path, obj, depth)
        elif isinstance(obj, type):
            self.out[path] = {"kind": "class from", "name": f"{obj.__module__}.{obj.__qualname__}"}
        elif is_type_alias(obj):
            self.out[path] = {"kind": "type alias"}
        elif callable(obj):
            self.out[path] = {"kind": "function", "signature": signature(obj)}
        else:
            self.out[path] = {"kind": "value", "value": shown(obj)}

    def klass(self, path: str, cls: type, depth: int) -> None:
        if issubclass(cls, enum.Enum):
            members = {m.name: shown(m.value) for m in cls}
            self.out[path] = {"kind": "enum", "members": members}
            return
        # Bases are not compared; they let the comparison count an inherited member once.
        bases = [self.seen[id(b)] for b in cls.__mro__[1:] if id(b) in self.seen and is_api(b)]
        self.out[path] = {"kind": "class", "signature": signature(cls), "bases": bases}
        if depth > 1:
            return
        for attr in sorted(a for a in dir(cls) if not a.startswith("_")):
            self.member(f"{path}.{attr}", cls, attr, depth)

    def member(self, path: str, cls: type, attr: str, depth: int) -> None:
        static = inspect.getattr_static(cls, attr)
        if isinstance(static, property):
            self.out[path] = {"kind": "property"}
        elif isinstance(static, (staticmethod, classmethod)):
            kind = type(static).__name__
            self.out[path] = {"kind": kind, "signature": signature(getattr(cls, attr))}
        elif inspect.isfunction(static):
            self.out[path] = {"kind": "method", "signature": signature(static)}
        elif isinstance(static, type):
            self.value(path, static, depth + 1)
        elif callable(static) or inspect.isdatadescriptor(static) or inspect.ismethoddescriptor(static):
            # Inherited from a base outside the API (object, Exception, torch's Sampler...).
            self.out[path] = {"kind": "inherited"}
        else:
            self.out[path] = {"kind": "attribute", "value": shown(static)}


def main() -> None:
    walker = Walker()
    # Importing the API may log or print (DeepSpeed announces its accelerator): keep stdout JSON.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        walker.walk(MODULES)
    json.dump(walker.out, sys.stdout, indent=0, sort_keys=True)


if __name__ == "__main__":
    main()
