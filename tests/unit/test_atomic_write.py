"""util.atomic_write_text: the one way the controller replaces a file that other nodes read."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from detslurm import util
from detslurm.util import atomic_write_text


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("mask", "want"), [(0o077, 0o644), (0o000, 0o600), (0o022, 0o640)])
def test_the_mode_is_exactly_the_one_asked_whatever_the_umask(
    tmp_path: Path, umask: None, mask: int, want: int
) -> None:
    os.umask(mask)
    atomic_write_text(tmp_path / "f", "x", mode=want)
    assert mode(tmp_path / "f") == want and (tmp_path / "f").read_text() == "x"


def test_missing_dirs_are_made_and_no_temp_file_is_left(tmp_path: Path) -> None:
    target = tmp_path / "a/b/c.json"
    atomic_write_text(target, "é" * 100_000)
    atomic_write_text(target, "second", durable=False)
    assert target.read_text() == "second"
    assert os.listdir(target.parent) == ["c.json"]


def test_a_link_at_the_name_is_replaced_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "d").mkdir()
    (tmp_path / "d/f").symlink_to(victim)
    atomic_write_text(tmp_path / "d/f", "ours", mode=0o600)
    assert victim.read_text() == "keep"
    assert not (tmp_path / "d/f").is_symlink() and (tmp_path / "d/f").read_text() == "ours"


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "f"
    target.write_text("old")
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        # Only the temp file's fsync fails (a full disk, say); anything else fsyncs for real.
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / ".f.")):
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(util.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["f"]


def test_a_taken_temp_name_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temp name is random: one that exists (a collision, or planted) is never opened."""
    names = [b"\x00" * 4, b"\x01" * 4]
    real_urandom = os.urandom

    def urandom(n: int) -> bytes:
        # The temp names' 4 bytes come from the list; any other caller gets real randomness.
        return names.pop(0) if n == 4 and names else real_urandom(n)

    monkeypatch.setattr(util.os, "urandom", urandom)
    planted = tmp_path / ".f.00000000.tmp"
    planted.symlink_to(tmp_path / "elsewhere")
    atomic_write_text(tmp_path / "f", "x")
    assert (tmp_path / "f").read_text() == "x"
    assert not (tmp_path / "elsewhere").exists() and planted.is_symlink()


def test_only_missing_levels_are_made_and_no_chmod_by_name(
    tmp_path: Path, umask: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submission writes a few files per trial, each metadata call a round trip on NFS: a
    write into an existing dir makes no dir and changes no mode by name, and a new run dir costs
    the mkdirs of its missing levels only (none that fail)."""
    from detslurm.controller.executor import RunSpec
    from detslurm.controller.files import prepare_runs
    from detslurm.expconf import ExperimentConfig

    calls: list[tuple[str, str]] = []
    real_mkdir, real_chmod = os.mkdir, os.chmod

    def mkdir(path: str, mode: int = 0o777, **kw: object) -> None:
        if str(path).startswith(str(tmp_path)):  # only this test's paths are counted
            calls.append(("mkdir", str(path)))
        real_mkdir(path, mode, **kw)  # type: ignore[arg-type]

    def chmod(path: str, mode: int, **kw: object) -> None:
        if str(path).startswith(str(tmp_path)):
            calls.append(("chmod", str(path)))
        real_chmod(path, mode, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "chmod", chmod)
    (tmp_path / "trials/7").mkdir(parents=True)
    calls.clear()
    atomic_write_text(tmp_path / "trials/7/ops.json", "{}", durable=False)
    atomic_write_text(tmp_path / "trials/7/job_id", "12_3", mode=0o600, durable=False)
    assert calls == []
    run_dir = tmp_path / "trials/7/runs/1"
    # prepare_runs reads only the run dir of a plan.
    spec = RunSpec("n", [], {}, run_dir, run_dir / "log", tmp_path, (1, 7, 1), cast("ExperimentConfig", None))
    ready, failed = prepare_runs([(1, spec)])
    assert failed == [] and len(ready) == 1 and (run_dir / "run-secret").is_file()
    assert calls == [("mkdir", str(tmp_path / "trials/7/runs")), ("mkdir", str(run_dir))]


def test_a_filesystem_that_refuses_every_name_fails_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EEXIST for every temp name (a broken FUSE or NFS server): an error, never a hang."""
    real_open = os.open
    tries: list[str] = []

    def open_(path: str, flags: int, mode: int = 0o777, **kw: object) -> int:
        if str(path).startswith(str(tmp_path / ".f.")):
            tries.append(str(path))
            raise FileExistsError(17, "File exists", path)
        return real_open(path, flags, mode, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(util.os, "open", open_)
    with pytest.raises(FileExistsError, match="no usable temporary file name"):
        atomic_write_text(tmp_path / "f", "x")
    assert len(tries) == util._TEMP_TRIES and os.listdir(tmp_path) == []


def test_an_interrupt_while_the_temp_is_made_is_not_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C at the mode check, with the temp already gone (removed by someone else), stays
    a Ctrl-C: it is not taken for a missing dir and the write retried."""
    real_fstat = os.fstat

    def fstat(fd: int) -> os.stat_result:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.startswith(str(tmp_path / ".f.")):
            os.unlink(name)
            raise KeyboardInterrupt
        return real_fstat(fd)

    monkeypatch.setattr(util.os, "fstat", fstat)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(tmp_path / "f", "x")
    assert os.listdir(tmp_path) == []
