"""``det e create -i/--include PATH``: extra files and directories beside the context's own.

Determined uploads each included path next to the context directory's contents, under its own
name. Here the context and the includes are copied into one staging directory, which is then
packaged like any context (95 MiB limit, symlink checks, snapshot at create time). The copy
honours the context's ``.detignore`` (ignored data sets are never copied) and each included
directory's own; the staged ``.detignore`` itself is left out, so that the context's patterns
cannot drop an included file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from detslurm import context as ctxmod
from detslurm.errors import ContextError


def _copy_tree(src: Path, dest: Path) -> None:
    """Copy what ``src``'s packaging would keep (its .detignore applied) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in ctxmod.scan(src):
        # The staged tree is packaged again with its own .detignore applied; copying this one would
        # let the context's patterns filter the included paths too.
        if entry.rel == ".detignore":
            continue
        target = dest / entry.rel
        if entry.kind == "dir":
            target.mkdir(parents=True, exist_ok=True)
        elif entry.kind == "link":
            # scan() has already checked that the link stays inside src and made its target relative,
            # so recreating it keeps it pointing at the copied file.
            os.symlink(entry.target, target)
        else:
            shutil.copy2(src / entry.rel, target)


def stage_context(context_dir: Path, includes: Sequence[Path], staging: Path) -> Path:
    """The context plus ``includes`` copied into ``staging``; the path to package.

    Raises ContextError naming the include that is missing or clashes with a context entry."""
    if not context_dir.is_dir():
        raise ContextError(f"context directory {context_dir} does not exist or is not a directory")
    # The context is copied first so that an include can never overwrite a context file: a
    # clash is found by the existence check below and refused.
    _copy_tree(context_dir, staging)
    for inc in includes:
        # resolve() so that `-i .` or `-i dir/` still gives the directory's real name, as
        # Determined names an include by its basename.
        name = inc.resolve().name
        if not inc.exists():
            raise ContextError(f"--include {inc}: no such file or directory")
        # is_symlink() too: exists() is False for a dangling link, which would still be clobbered.
        if (staging / name).exists() or (staging / name).is_symlink():
            raise ContextError(f"--include {inc}: the context already has an entry named {name!r}")
        if inc.is_dir():
            _copy_tree(inc, staging / name)
        else:
            shutil.copy2(inc, staging / name)
    return staging
