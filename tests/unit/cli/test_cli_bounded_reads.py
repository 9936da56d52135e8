"""Read commands stay cheap whatever a trial wrote and whoever holds the store.

- Logs: a trial's output file is untrusted; `--tail` reads backwards from
  the end, `-f` and full listings read in chunks and cut over-long lines.
- The store's write lock: read commands never wait for another process's write transaction.
"""

from __future__ import annotations

import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES
from sqlalchemy import delete, select

from detslurm import settings
from detslurm.store import LogEntry, TrialRun, open_store

CORE = EXAMPLES / "core_api"
MiB = 1 << 20


@pytest.fixture
def trial_log(det: Any) -> Path:
    """The output file of trial 1's run of a completed local experiment, whose controller notes
    are removed (so the last lines of `det t logs` are the file's)."""
    code, out, err = det("e", "create", "--local", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=0")
    assert code == 0, out + err
    store = open_store(settings.load().db_url)
    with store.tx() as s:
        s.execute(delete(LogEntry))
        return Path(s.scalars(select(TrialRun.log_path).where(TrialRun.trial_id == 1)).one())


def _write_log(path: Path, short_mib: int, long_mib: int, tail: bytes) -> None:
    line = b"an ordinary line of trial output, about sixty bytes long....\n"
    block = line * (MiB // len(line))
    with open(path, "wb") as f:
        f.write(b"first line\n")
        for _ in range(short_mib):
            f.write(block)
        for _ in range(long_mib):  # one line of long_mib MiB
            f.write(b"x" * MiB)
        f.write(b"\n" + tail)


def _measured(det: Any, *args: str) -> tuple[int, str, str, float, int]:
    """Run det in-process; its exit code, output, seconds taken and peak traced allocation."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        code, out, err = det(*args)
        took = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return code, out, err, took, peak


def test_tail_of_a_huge_log_reads_from_the_end(det: Any, trial_log: Path) -> None:
    _write_log(trial_log, short_mib=151, long_mib=50, tail=b"end 1\nend 2\nend 3\nend 4\n")
    assert trial_log.stat().st_size > 200 * MiB
    code, out, err, took, peak = _measured(det, "t", "logs", "1", "--tail", "5")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1:] == ["end 1", "end 2", "end 3", "end 4"]
    assert lines[0].startswith("xxxx") and lines[0].endswith(f" ... [line cut: {49 * MiB} more bytes]")
    assert len(lines[0]) < 2 * MiB
    assert peak < 32 * MiB, f"peak {peak / MiB:.1f} MiB"
    assert took < 45, f"{took:.1f} s"  # reading all 200 MiB would take minutes on a loaded machine
    code, out, err, _, peak = _measured(det, "t", "logs", "1", "--head", "2")
    assert code == 0 and out.splitlines()[1] == "first line" and peak < 32 * MiB, err


def test_follow_and_full_listing_cut_a_huge_line(det: Any, trial_log: Path) -> None:
    _write_log(trial_log, short_mib=0, long_mib=50, tail=b"end 1\nend 2\nno newline yet")
    for args in (("t", "logs", "-f", "1"), ("e", "logs", "1"), ("t", "logs", "1")):
        code, out, err, _, peak = _measured(det, *args)
        assert code == 0, err
        lines = [line for line in out.splitlines() if not line.startswith(("===", "Trial log stream"))]
        assert lines[0] == "first line" and lines[2:4] == ["end 1", "end 2"], (args, lines[:1], lines[2:])
        assert lines[1].endswith(f" ... [line cut: {49 * MiB} more bytes]")
        assert peak < 32 * MiB, f"{args}: peak {peak / MiB:.1f} MiB"
        # The unterminated last line is still being written: -f waits for its newline.
        assert ("no newline yet" in lines) == (args[2] != "-f"), args


_HOLD = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("UPDATE experiments SET description = 'held' WHERE id = 1")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("COMMIT")
"""


def test_read_commands_do_not_wait_for_a_writer(det: Any, trial_log: Path) -> None:
    db = settings.load().db_url.split("///", 1)[1]
    # Held far longer than SQLite's busy timeout (30 s): a command that waited for the writer would
    # fail with "database is locked" rather than succeed, however fast or slow the machine.
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, db, "600"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        for args in (("e", "list"), ("e", "describe", "1"), ("t", "logs", "1", "--tail", "2"), ("c", "list", "1")):
            code, out, err = det(*args)
            assert code == 0, (args, err)
            assert holder.poll() is None, args  # the write transaction was still open
    finally:
        holder.terminate()
        holder.wait()
