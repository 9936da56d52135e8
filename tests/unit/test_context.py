from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
from conftest import write

from detslurm.context import MAX_CONTEXT_BYTES, extract, package, write_tarball
from detslurm.errors import ContextError


def names(root: Path) -> set[str]:
    return {e.rel for e in package(root).entries}


def test_ignores_defaults_and_detignore(tmp_path: Path) -> None:
    write(tmp_path / "train.py", "print(1)")
    write(tmp_path / "__pycache__/x.cpython-311.pyc", "x")
    write(tmp_path / "pkg/mod.pyc", "x")
    write(tmp_path / "pkg/mod.pyo", "x")
    write(tmp_path / "pkg/mod.py", "x")
    write(tmp_path / ".git/HEAD", "ref")
    write(tmp_path / "data/big.bin", "x" * 10)
    write(tmp_path / "logs/a.log", "x")
    write(tmp_path / "keep.log", "x")
    write(tmp_path / ".detignore", "data/\n*.log\n!keep.log\n")
    assert names(tmp_path) == {"train.py", "pkg", "pkg/mod.py", ".detignore", "keep.log", "logs"}


def test_size_limit_names_largest_files(tmp_path: Path) -> None:
    write(tmp_path / "train.py", "x")
    big = tmp_path / "weights.bin"
    with open(big, "wb") as f:  # sparse: st_size counts, no 95 MiB written
        f.truncate(MAX_CONTEXT_BYTES)
    write(tmp_path / "other.bin", "y" * 100)
    with pytest.raises(ContextError) as info:
        package(tmp_path)
    msg = str(info.value)
    assert "over the 95 MiB limit" in msg and "weights.bin" in msg and ".detignore" in msg
    write(tmp_path / ".detignore", "weights.bin\n")
    assert "weights.bin" not in names(tmp_path)


@pytest.mark.fault
def test_escaping_symlink_refused(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    write(ctx / "train.py", "x")
    write(tmp_path / "secret.txt", "s")
    os.symlink(tmp_path / "secret.txt", ctx / "leak.txt")
    with pytest.raises(ContextError, match="leak.txt .* points outside the context directory"):
        package(ctx)
    os.unlink(ctx / "leak.txt")
    os.symlink("../", ctx / "updir")
    with pytest.raises(ContextError, match="updir"):
        package(ctx)


def test_internal_symlink_kept_and_extracted(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    write(ctx / "lib/real.py", "VALUE = 1\n")
    os.symlink("lib/real.py", ctx / "alias.py")
    bundle = package(ctx)
    write_tarball(bundle, tmp_path / "c.tgz")
    extract(tmp_path / "c.tgz", tmp_path / "out")
    assert (tmp_path / "out/alias.py").is_symlink()
    assert (tmp_path / "out/alias.py").read_text() == "VALUE = 1\n"


def test_hash_and_snapshot_independence(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    write(ctx / "train.py", "v1")
    b1 = package(ctx)
    assert package(ctx).sha256 == b1.sha256
    write_tarball(b1, tmp_path / "snap.tgz")
    write(ctx / "train.py", "v2")  # edited after submission
    assert package(ctx).sha256 != b1.sha256
    extract(tmp_path / "snap.tgz", tmp_path / "run")
    assert (tmp_path / "run/train.py").read_text() == "v1"


def _evil_tar(path: Path, member: tarfile.TarInfo, data: bytes = b"") -> None:
    with tarfile.open(path, "w:gz") as tar:
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data) if data else None)


@pytest.mark.parametrize(
    "make",
    [
        lambda: tarfile.TarInfo("../escape.txt"),
        lambda: tarfile.TarInfo("/abs.txt"),
        lambda: tarfile.TarInfo("a/../../escape.txt"),
    ],
)
@pytest.mark.fault
def test_extract_refuses_traversal(tmp_path: Path, make) -> None:  # type: ignore[no-untyped-def]
    _evil_tar(tmp_path / "evil.tgz", make(), b"pwned")
    with pytest.raises(ContextError, match="escapes"):
        extract(tmp_path / "evil.tgz", tmp_path / "dest")
    assert not (tmp_path / "escape.txt").exists()


@pytest.mark.fault
def test_extract_refuses_escaping_link(tmp_path: Path) -> None:
    m = tarfile.TarInfo("link")
    m.type = tarfile.SYMTYPE
    m.linkname = "../../etc/passwd"
    _evil_tar(tmp_path / "evil.tgz", m)
    with pytest.raises(ContextError, match="escapes"):
        extract(tmp_path / "evil.tgz", tmp_path / "dest")


def test_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ContextError, match="does not exist"):
        package(tmp_path / "nope")
