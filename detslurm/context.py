"""Context directory packaging: what goes into a trial's working directory.

The context is snapshotted (a tar.gz plus a content hash) into the experiment dir at create
time, so later edits to the user's directory never change queued or restarted trials.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from detslurm.errors import ContextError

if TYPE_CHECKING:
    import pathspec

# Determined's limit for a context (its common/constants.py); kept so a context
# that works here also works there, and data sets are not copied into every trial dir.
MAX_CONTEXT_BYTES = 95 * 1024 * 1024
# Ignored even without a .detignore, as Determined does: bytecode and history are large,
# change on every run (breaking the content hash) and are never needed by a trial.
ALWAYS_IGNORED = ["__pycache__/", "*.pyc", "*.pyo", ".git/"]


@dataclass(frozen=True)
class Entry:
    rel: str
    kind: str  # "file" | "dir" | "link"
    size: int = 0
    mode: int = 0o644
    target: str = ""


@dataclass(frozen=True)
class ContextBundle:
    root: Path
    entries: tuple[Entry, ...]
    total_bytes: int
    sha256: str


def _spec(root: Path) -> pathspec.GitIgnoreSpec:
    # Imported here: only packaging needs it, and every trial's exec.launch imports this module
    # for extract() on the way to its first step.
    import pathspec

    lines = list(ALWAYS_IGNORED)
    ignore = root / ".detignore"
    if ignore.is_file():
        lines += ignore.read_text().splitlines()
    # Gitignore semantics, as Determined documents for .detignore (negation, dir/ patterns).
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _link_entry(root: Path, path: Path, rel: str) -> Entry:
    target = os.readlink(path)
    resolved = (path.parent / target).resolve() if not os.path.isabs(target) else Path(target).resolve()
    root_r = root.resolve()
    if resolved != root_r and root_r not in resolved.parents:
        raise ContextError(
            f"context directory {root}: symbolic link {rel} -> {target} points outside the "
            "context directory; copy the file in or add the link to .detignore"
        )
    # Stored relative, so the link still points at the same file once extracted elsewhere.
    rel_target = os.path.relpath(resolved, (root_r / rel).parent)
    return Entry(rel=rel, kind="link", target=rel_target)


def scan(root: Path) -> list[Entry]:
    spec = _spec(root)
    entries: list[Entry] = []
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        rel_dir = base.relative_to(root).as_posix()
        keep = []
        for d in sorted(dirnames):
            rel = d if rel_dir == "." else f"{rel_dir}/{d}"
            # The trailing slash lets "data/" patterns match directories; an ignored directory is
            # pruned from the walk, so a huge ignored data set is never even listed.
            if spec.match_file(rel + "/"):
                continue
            # os.walk lists a symlink to a directory among dirnames but does not descend into it: it is
            # packaged as a link (checked to stay inside the context), never as a copy of its target.
            if (base / d).is_symlink():
                entries.append(_link_entry(root, base / d, rel))
                continue
            keep.append(d)
            entries.append(Entry(rel=rel, kind="dir", mode=0o755))
        dirnames[:] = keep
        for name in sorted(filenames):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if spec.match_file(rel):
                continue
            path = base / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                entries.append(_link_entry(root, path, rel))
            # Sockets, fifos and devices are skipped: they cannot be packaged and reading a fifo would block.
            elif stat.S_ISREG(st.st_mode):
                entries.append(Entry(rel=rel, kind="file", size=st.st_size, mode=st.st_mode & 0o777))
    return entries


def _too_big(root: Path, entries: list[Entry], total: int) -> ContextError:
    largest = sorted((e for e in entries if e.kind == "file"), key=lambda e: -e.size)[:5]
    listing = "\n".join(f"  {e.size / 2**20:8.1f} MiB  {e.rel}" for e in largest)
    return ContextError(
        f"context directory {root} is {total / 2**20:.1f} MiB, over the "
        f"{MAX_CONTEXT_BYTES // 2**20} MiB limit. Largest files:\n{listing}\n"
        "Add large files (data sets, checkpoints, binaries) to .detignore and load data from "
        "a shared filesystem instead."
    )


def package(root: Path) -> ContextBundle:
    root = Path(root)
    if not root.is_dir():
        raise ContextError(f"context directory {root} does not exist or is not a directory")
    entries = scan(root)
    total = sum(e.size for e in entries)
    if total > MAX_CONTEXT_BYTES:
        raise _too_big(root, entries, total)
    h = hashlib.sha256()
    for e in entries:
        # NUL separators: no file name can contain one, so two different trees cannot hash alike by
        # shifting bytes between a name and its content. Modes and links count: they change behaviour.
        h.update(f"{e.kind}\0{e.rel}\0{e.mode:o}\0{e.target}\0".encode())
        if e.kind == "file":
            with open(root / e.rel, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return ContextBundle(root=root, entries=tuple(entries), total_bytes=total, sha256=h.hexdigest())


def write_tarball(bundle: ContextBundle, dest: Path) -> None:
    """Write the bundle as tar.gz to ``dest`` atomically (temp name, then rename)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for e in bundle.entries:
            info = tarfile.TarInfo(e.rel)
            info.mode = e.mode
            info.mtime = 0  # reproducible bytes for the same content
            if e.kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif e.kind == "link":
                info.type = tarfile.SYMTYPE
                info.linkname = e.target
                tar.addfile(info)
            else:
                data = (bundle.root / e.rel).read_bytes()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, dest)


def _safe_member(m: tarfile.TarInfo, dest: Path) -> None:
    # The tarball sits in the experiment dir, which a trial can write: extraction treats it as
    # untrusted input, whatever wrote it first.
    p = PurePosixPath(m.name)
    if p.is_absolute() or ".." in p.parts:
        raise ContextError(f"refusing to extract {m.name!r}: path escapes the destination")
    # Hard links, devices and fifos are refused: a hard link can name any file the extracting
    # user may read, and no context needs the others.
    if not (m.isfile() or m.isdir() or m.issym()):
        raise ContextError(f"refusing to extract {m.name!r}: only files, dirs and links are allowed")
    if m.issym():
        target = (dest / p.parent / m.linkname).resolve()
        root = dest.resolve()
        if PurePosixPath(m.linkname).is_absolute() or (target != root and root not in target.parents):
            raise ContextError(f"refusing to extract link {m.name!r} -> {m.linkname!r}: it escapes the destination")


def _private_mode(m: tarfile.TarInfo) -> int:
    """Owner-only modes for the extracted code (docs/design/security.md): 0700 dirs, 0600 files,
    0700 files the owner could execute. Nobody else on the node needs to read a trial's code."""
    if m.isdir() or (m.isfile() and m.mode & 0o100):
        return 0o700
    return 0o600


def extract(tarball: Path, dest: Path) -> None:
    """Extract a context tarball into ``dest`` (created 0700 if missing), private to the owner,
    refusing traversal, absolute paths and escaping links."""
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tarfile.open(tarball, "r:*") as tar:
        members = tar.getmembers()
        for m in members:
            _safe_member(m, dest)
            if not m.issym():
                m.mode = _private_mode(m)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:
            # Pythons before 3.10.12/3.11.4 (Debian 12's 3.11.2, say) have no extraction
            # filters: _safe_member already refused what escapes and the modes are private.
            tar.extractall(dest, members=members)
    # The "data" filter leaves directories at the umask's mode (755 typically): tighten them,
    # including parents a tarball implies without listing them. os.walk follows no symlinks.
    for dirpath, dirnames, _ in os.walk(dest):
        for d in dirnames:
            if not os.path.islink(os.path.join(dirpath, d)):
                os.chmod(os.path.join(dirpath, d), 0o700)


def extract_as_packaged(tarball: Path, dest: Path) -> None:
    """Extract a context into a private ``dest`` and give its entries back the modes they were
    packaged with, so packaging ``dest`` again hashes the same (`det e fork` reuses a context).
    Only for a directory the caller alone can reach: :func:`extract` makes files owner-only
    for a reason on shared nodes."""
    extract(tarball, dest)
    with tarfile.open(tarball, "r:*") as tar:
        # Deepest first: a directory's own mode must not stop us from reaching its entries.
        for m in sorted(tar.getmembers(), key=lambda m: m.name.count("/"), reverse=True):
            if m.isfile() or m.isdir():  # names already checked by extract()
                os.chmod(dest / m.name, (m.mode & 0o777) | 0o700 * m.isdir())
