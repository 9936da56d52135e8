"""The smaller things a new user meets in the first hour, in local mode: sizes as people read
them, the context directory Determined requires, config errors that name the file, a dashboard
without Slurm, controller notes in time order, a kill that stops the searcher, and the
messages of remote mode when paramiko or the login node's SFTP is missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES

from detslurm.util import format_size

CORE = EXAMPLES / "core_api"


def test_sizes_read_as_people_read_them(det: Any, tmp_path: Path) -> None:
    assert [format_size(n) for n in (0, 512, 1024, 61442.1 * 1024, 1024**2 - 1, 5.5 * 1024**3)] == [
        "0 B",
        "512 B",
        "1.0 KiB",
        "60.0 MiB",
        "1.0 MiB",
        "5.5 GiB",
    ]
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text((CORE / "train.py").read_text())
    with open(ctx / "blob.bin", "wb") as f:  # sparse: st_size counts
        f.truncate(3 * 2**20)
    code, out, err = det("e", "create", "--dry-run", "--local", CORE / "const.yaml", ctx)
    assert code == 0, err
    assert "(2 entries, 3.0 MiB, sha256 " in out


def test_create_needs_the_context_directory(det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Determined's CLI takes the context as optional and then sends no code; packaging the
    current directory instead (a home directory, say) is refused with the fix."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text((CORE / "train.py").read_text())
    (ctx / "const.yaml").write_text((CORE / "const.yaml").read_text())
    monkeypatch.chdir(ctx)
    for args in (["const.yaml"], ["--config-file", "const.yaml"]):
        code, out, err = det("e", "create", "--local", "--dry-run", *args)
        assert code == 2 and "missing the context directory" in err, err
        assert "pass `.` for the current directory" in err and "Traceback" not in err
    code, out, err = det("e", "create", "--local", "--dry-run", "const.yaml", ".")
    assert code == 0 and "# dry run: nothing was created" in out, err
    code, out, err = det("e", "create", "--local", "--dry-run", "--config-file", "const.yaml", ".")
    assert code == 0 and "# dry run: nothing was created" in out, err
