"""`det e activate --detach` (and the dashboard's and the SDK's activate) of a local experiment:
a driver of its own in the background.

A local experiment has no daemon; the `det` that drives it is the only thing that starts its
trials (cli/local.py). Marking it ACTIVE and leaving would list it ACTIVE with nothing behind it,
so a detached activate starts a `det` of its own session (no terminal: a closed terminal or SSH
session does not reach it) that drives the experiment, its output in the experiment's dir, and
returns once that driver holds the experiment's driver lock. It ends as any driver ends: when
the experiment ends or is paused; a SIGKILL is settled by the next read (cli/undriven.py).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

from detslurm.cli.app import App
from detslurm.errors import StateError
from detslurm.util import printable

# The hidden command the background driver runs (cli/experiment.py declares it).
COMMAND = "drive-detached"
LOG = "driver.log"
# How long the new driver may take to import detslurm and take the lock: a guard, not a timing.
_START_TIMEOUT_S = 120.0


def start(app: App, exp_id: int, exp_dir: str) -> Path:
    """Start the background driver of ``exp_id``; its log. Raises StateError when it ended
    before it held the experiment's driver lock (its last log lines say why)."""
    log = Path(exp_dir) / LOG
    try:
        # Never through a link: anything the user's trials run could have put one there.
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise StateError(f"experiment {exp_id}: cannot open its driver's log {log}: {e.strerror}") from None
    ready_r, ready_w = os.pipe()
    try:
        with os.fdopen(fd, "ab") as out:
            proc = subprocess.Popen(
                # sys.executable: the same detslurm (same venv) as this `det`.
                [sys.executable, "-m", "detslurm.cli.main", "e", COMMAND, str(exp_id), "--ready-fd", str(ready_w)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(ready_w,),
                close_fds=True,
            )
    finally:
        os.close(ready_w)
    try:
        # One byte once the driver holds the lock; end of file when it exited first.
        readable, _, _ = select.select([ready_r], [], [], _START_TIMEOUT_S)
        said = os.read(ready_r, 1) if readable else b""
    finally:
        os.close(ready_r)
    if said == b"1":
        return log
    if not readable:
        proc.kill()
    proc.wait()
    tail = log.read_text(errors="replace").splitlines()[-5:] if log.exists() else []
    why = "; ".join(printable(line) for line in tail if line.strip()) or f"exit code {proc.returncode}"
    raise StateError(f"experiment {exp_id}: its background driver did not start ({why}); see {log}")


def drive(app: App, exp_id: int, ready_fd: int) -> None:
    """The background driver itself (the hidden `det e drive-detached EXP_ID --ready-fd N`): one
    byte on ``ready_fd`` once it holds the lock, then drive as `det e activate` would."""
    from detslurm.cli import local

    def ready() -> None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)

    local.drive(app, exp_id, quiet=True, on_driving=ready)
