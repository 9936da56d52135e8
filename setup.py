"""Packaging metadata lives in pyproject.toml; this file only adds one file to the install.

``detslurm-determined.pth`` goes to the top of site-packages, where Python's ``site`` module runs
its ``import`` line at every start. That line puts :mod:`detslurm._compat.finder` at the end of
``sys.meta_path``, so ``import determined`` works wherever detslurm is installed while a real
``determined`` package, whenever it is installed, still wins (see that module for why a finder
and not a top-level package). Both kinds of install carry the file:

- a wheel (``pip install .``): ``build_py`` writes it into the build dir, whose top level is the
  wheel's (and so site-packages') top level;
- an editable install (``pip install -e .``): setuptools does not copy build output into an
  editable wheel, but it points the ``install`` command's ``install_lib`` at the wheel's unpacked
  top level, so the file is written there. The ``.pth`` sorts after setuptools'
  ``__editable__.detslurm-*.pth``, which makes ``detslurm`` importable first.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "detslurm-determined.pth"
# One line, as .pth import lines must be. A missing or broken detslurm (a half-removed install)
# must not print an error at every interpreter start, hence the try.
PTH_TEXT = (
    'import sys; exec("try:\\n from detslurm._compat import finder\\n'
    'except ImportError:\\n pass\\nelse:\\n finder.install()")\n'
)


class BuildPyWithPth(build_py):
    """build_py that also emits ``detslurm-determined.pth`` at the install's top level."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            top = Path(self.get_finalized_command("install").install_lib)
        else:
            top = Path(self.build_lib)
        top.mkdir(parents=True, exist_ok=True)
        (top / PTH_NAME).write_text(PTH_TEXT)
        self._pth = str(top / PTH_NAME)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        pth = getattr(self, "_pth", None)
        if pth and not getattr(self, "editable_mode", False):
            outputs.append(pth)
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth})
