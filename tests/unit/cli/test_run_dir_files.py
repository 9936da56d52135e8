"""The controller's own files in run dirs the trials own (controller/files.py): a symlink, a
FIFO or a directory a trial put at one of their names never redirects, blocks or fails the
controller's step."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from detslurm.controller import files
from detslurm.protocol import BestValidation, ControlRecord


def finishes(fn: Callable[[], Any], timeout: float = 10) -> list[Any]:
    """``fn``'s result, in a thread that must end within ``timeout`` (a blocking open would not)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert out, f"{fn} did not return within {timeout} s"
    return out


def test_the_job_id_marker_replaces_a_planted_link_or_fifo(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link, fifo = tmp_path / "a" / "job_id", tmp_path / "b" / "job_id"
    link.parent.mkdir()
    fifo.parent.mkdir()
    link.symlink_to(victim)
    os.mkfifo(fifo)
    for marker in (link, fifo):
        finishes(lambda m=marker: files.write_marker(m, "123_4"))
        assert not marker.is_symlink() and marker.read_text() == "123_4"
    assert victim.read_text() == "precious"


def test_the_job_id_marker_is_read_only_from_a_small_regular_file(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("77")
    (tmp_path / "link").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "big").write_text("1" * 10_000)
    (tmp_path / "ok").write_text("42\n")
    for name in ("link", "fifo", "dir", "big"):
        assert finishes(lambda n=name: files.read_marker(tmp_path / n)) == [None], name
    assert files.read_marker(tmp_path / "ok") == "42"


def test_a_file_the_step_cannot_write_fails_only_that_file(tmp_path: Path) -> None:
    (tmp_path / "best_validation.json").mkdir()  # a directory at the file's name
    assert files._written(BestValidation(0.5), tmp_path / "best_validation.json") is False
    assert files._written(ControlRecord(preempt=True, reason="pause"), tmp_path / "control.json") is True
    assert ControlRecord.read(tmp_path / "control.json") == ControlRecord(preempt=True, reason="pause")


def test_log_readers_skip_a_fifo_at_the_logs_name(tmp_path: Path) -> None:
    """`det t logs` and the dashboard read logs in the trial's run dir: a FIFO there (no writer)
    is no log, and must not hold the command or a server thread."""
    from detslurm.cli import logs as cli_logs
    from detslurm.dashboard import logs as dash_logs

    fifo = tmp_path / "output.log"
    os.mkfifo(fifo)
    assert finishes(lambda: list(cli_logs.file_lines(fifo))) == [[]]
    assert finishes(lambda: list(cli_logs.file_lines_reversed(fifo))) == [[]]
    assert finishes(lambda: dash_logs._read(str(fifo), 0, 1 << 16)) == [b""]
    real = tmp_path / "real.log"
    real.write_text("a\nb\n")
    assert list(cli_logs.file_lines(real)) == ["a", "b"] and dash_logs._read(str(real), 2, 10) == b"b\n"
