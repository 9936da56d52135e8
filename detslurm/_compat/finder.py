"""``import determined`` anywhere detslurm is installed, unless a real ``determined`` is.

Installed by ``detslurm-determined.pth`` (see ``setup.py``): Python's ``site`` module runs that
file's one ``import`` line at every interpreter start, which calls :func:`install`. Why a finder
and not a top-level ``determined`` package in site-packages:

- a real ``determined`` installed later (``pip install determined``) would have to overwrite our
  files, and uninstalling either would break the other;
- the finder sits at the **end** of ``sys.meta_path`` and answers only for the name
  ``determined``, and only when no other finder (site-packages, PYTHONPATH, the current dir, an
  editable install) can: whatever real package exists always wins, checked at import time, so
  installing one later needs no change here.

Once the top-level ``determined`` comes from our directory, its submodules (``determined.core``,
``determined.launch.horovod``, ...) are found by the normal path machinery in that package.
Startup cost: importing this module and ``detslurm`` (a few ms); nothing heavy is imported.
"""

from __future__ import annotations

import os
import sys

# Not typing's TYPE_CHECKING: typing, collections.abc and types would be imported at every
# interpreter start for annotations alone (strings here, under `from __future__ import annotations`).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import importlib.machinery
    from collections.abc import Sequence
    from types import ModuleType
    from typing import Optional

NAME = "determined"
# os.path, not pathlib, and no importlib.abc base class: this module is imported at every
# interpreter start where detslurm is installed, and those imports cost about 5 ms each time.
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.realpath(__file__)), NAME)


class DeterminedFallbackFinder:
    """Resolves ``determined`` to detslurm's compatibility package as the last resort (a
    meta path finder by protocol: ``find_spec`` is all the import system asks of it)."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != NAME:
            return None
        if self._someone_else_has_it(fullname, path, target):
            return None
        init = os.path.join(PACKAGE_DIR, "__init__.py")
        if not os.path.isfile(init):
            return None  # a broken install: behave as if we were not here
        import importlib.util  # only when `determined` is imported, not at interpreter start

        return importlib.util.spec_from_file_location(NAME, init, submodule_search_locations=[PACKAGE_DIR])

    def _someone_else_has_it(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType]) -> bool:
        # Finders before us have already said no when we are asked. Finders appended after us
        # (another .pth that sorts later, a plugin) have not: ask them first, so a real
        # `determined` they know about wins too.
        meta = sys.meta_path
        after = meta[meta.index(self) + 1 :] if self in meta else []
        for finder in after:
            find = getattr(finder, "find_spec", None)
            if find is not None and find(fullname, path, target) is not None:
                return True
        return False


def installed() -> Optional[DeterminedFallbackFinder]:
    """The finder on ``sys.meta_path``, if one is there."""
    return next((f for f in sys.meta_path if isinstance(f, DeterminedFallbackFinder)), None)


def install() -> None:
    """Append the finder to ``sys.meta_path`` (idempotent)."""
    if installed() is None:
        sys.meta_path.append(DeterminedFallbackFinder())
