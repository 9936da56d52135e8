"""Context extraction on a Python without tarfile's extraction filters.

Debian 12's system python3 is 3.11.2, which predates ``filter="data"``; trials on such nodes must
still extract their code safely instead of failing. Run with the venv built from the system
Python that the second-user tests use (tests/security_harness.py).
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from conftest import ROOT

PROBE = """
import sys, tarfile
from pathlib import Path
from detslurm.context import extract
from detslurm.errors import ContextError
print("filters", hasattr(tarfile, "data_filter"))
try:
    extract(Path(sys.argv[1]), Path(sys.argv[2]))
    print("extracted")
except ContextError as e:
    print("refused", e)
"""

pytestmark = pytest.mark.heavy  # minutes of CPU: CI's run starts it after the rest


def tarball(path: Path, members: list[tuple[str, int]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, mode in members:
            info = tarfile.TarInfo(name)
            info.mode = mode
            info.size = 2
            tar.addfile(info, io.BytesIO(b"x\n"))
    return path


@pytest.fixture(scope="module")
def old_python() -> Path:
    if os.geteuid() != 0:
        pytest.skip("the shared venv is built by root")
    from security_harness import shared_det

    python = shared_det(ROOT).parent / "python"
    out = subprocess.run(
        [str(python), "-c", "import tarfile; print(hasattr(tarfile, 'data_filter'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if out.strip() != "False":
        pytest.skip("the system python3 has extraction filters: nothing old to test here")
    return python


def test_extracts_privately_without_filters(old_python: Path, tmp_path: Path) -> None:
    tb = tarball(tmp_path / "ok.tar.gz", [("train.py", 0o4777), ("run.sh", 0o755), ("data.txt", 0o666)])
    out = subprocess.run(
        [str(old_python), "-c", PROBE, str(tb), str(tmp_path / "dest")], capture_output=True, text=True, check=True
    ).stdout
    assert "filters False" in out and "extracted" in out, out
    modes = {p.name: p.stat().st_mode & 0o7777 for p in (tmp_path / "dest").iterdir()}
    assert modes == {"train.py": 0o700, "run.sh": 0o700, "data.txt": 0o600}  # no setuid, no group/other


def test_refuses_traversal_without_filters(old_python: Path, tmp_path: Path) -> None:
    tb = tarball(tmp_path / "evil.tar.gz", [("../escaped.txt", 0o644)])
    out = subprocess.run(
        [str(old_python), "-c", PROBE, str(tb), str(tmp_path / "dest")], capture_output=True, text=True, check=True
    ).stdout
    assert "refused" in out and not (tmp_path / "escaped.txt").exists()
