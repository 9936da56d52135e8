"""The in-job library a container trial imports detslurm from, without installing it in the image.

A copy of what runs inside a job (``detslurm.exec``, ``.core``, ``.protocol``, ``.launch``, the
``determined`` compatibility package, the Trainer API) plus its light, pure-Python dependencies,
laid out as an import root (``<lib>/detslurm/launch/...``, ``<lib>/hostlist.py``, ...). It is
bind-mounted read-only into the container and put on ``PYTHONPATH``.

Why a copy and not the install itself: an editable install maps ``detslurm.launch`` to
``launchers/`` through an import hook the container does not have, and a bind of a dir into a
read-only bind cannot create its mount point. The copy is content-addressed (by the sources'
paths, sizes and mtimes), made once per experiment dir on the shared filesystem and reused by
every run; it is a few MB.

Which dependencies: the import closure of ``detslurm.exec.launch``, the launchers and the Core
API, minus the standard library (tests/unit/slurm/test_containers.py checks it stays this list). None has
compiled parts, so the image's Python (>= 3.10) can import them whatever its minor version.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Top-level modules the in-job side imports besides detslurm and the standard library.
DEPENDENCIES = ("hostlist", "pathspec", "platformdirs", "typing_extensions")
# Parts of the detslurm package only the login side uses: not copied (cli is mapped to its own
# dir in source trees anyway; the store and controller pull SQLAlchemy and pydantic).
LOGIN_ONLY = frozenset({"cli", "controller", "store", "remote", "slurm", "templates", "expconf", "searcher"})
# What jobs do use of those: the typed view of the experiment config (standard library only).
IN_JOB_FILES = ("expconf/__init__.py", "expconf/view.py")


@dataclass(frozen=True)
class Source:
    """One tree (or single module) to copy, and where it goes under the library root."""

    path: Path
    dest: str


def sources() -> list[Source]:
    """Where the in-job modules live in this install (found without importing them)."""
    out: list[Source] = []
    for name, dest in (("detslurm", "detslurm"), ("detslurm.launch", "detslurm/launch")):
        out.append(Source(_package_dir(name), dest))
    for dep in DEPENDENCIES:
        spec = importlib.util.find_spec(dep)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"detslurm's in-job dependency {dep!r} is not installed")
        if spec.submodule_search_locations:
            out.append(Source(Path(spec.origin).parent, dep))
        else:
            out.append(Source(Path(spec.origin), Path(spec.origin).name))
    return out


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"cannot find the package {name}")
    return Path(next(iter(spec.submodule_search_locations)))


def _files(src: Source) -> list[tuple[Path, str]]:
    """(file, its path under the library root) for every file of a source we copy."""
    if src.path.is_file():
        return [(src.path, src.dest)]
    out: list[tuple[Path, str]] = []
    for dirpath, dirnames, filenames in os.walk(src.path):
        rel = Path(dirpath).relative_to(src.path)
        # Skip caches, and at the package's top the login-only parts (and launch/, copied from
        # its own source so that source trees and wheels give the same layout).
        skip = {"__pycache__"} | (LOGIN_ONLY | {"launch"} if src.dest == "detslurm" and rel == Path(".") else set())
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for f in sorted(filenames):
            if f.endswith((".py", ".typed")):
                out.append((Path(dirpath) / f, str(Path(src.dest) / rel / f)))
    if src.dest == "detslurm":
        out += [(src.path / f, f"detslurm/{f}") for f in IN_JOB_FILES]
    return out


def lib_key(srcs: list[Source]) -> str:
    """A short content key: paths, sizes and mtimes of every file (cheap: no file is read)."""
    h = hashlib.sha256()
    for src in srcs:
        for path, dest in _files(src):
            st = path.stat()
            h.update(f"{dest}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def lib_dir(base: Path, srcs: list[Source] | None = None) -> Path:
    """Where the library for this install goes under ``base`` (pure but for stat calls)."""
    return base / lib_key(srcs if srcs is not None else sources())


def ensure_lib(target: Path, srcs: list[Source] | None = None) -> Path:
    """Make the library at ``target`` (a path from :func:`lib_dir`) unless it exists. Built in a
    temporary dir and renamed into place, so a reader never sees half of it."""
    if target.is_dir():
        return target
    srcs = srcs if srcs is not None else sources()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        for src in srcs:
            for path, dest in _files(src):
                out = tmp / dest
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, out)
        # Read-only for the owner too: the trial must not change what later runs import.
        for dirpath, _, filenames in os.walk(tmp):
            for f in filenames:
                os.chmod(Path(dirpath) / f, 0o400)
        os.chmod(tmp, 0o700)
        os.rename(tmp, target)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)  # another submission made it meanwhile
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise RuntimeError(f"cannot make the container library at {target}: {e}") from None
    return target
