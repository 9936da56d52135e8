"""launchers/_pidwait.py: a timed wait for a child that sleeps in the kernel."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from types import FrameType
from typing import Optional

from detslurm.launch._pidwait import ChildWait


def test_none_while_it_runs_then_its_code() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1.5); sys.exit(7)"])
    with ChildWait(proc) as child:
        assert child.wait(0.1) is None
        deadline = time.monotonic() + 600
        while (code := child.wait(0.5)) is None:
            assert time.monotonic() < deadline
    assert code == 7 and proc.returncode == 7


def test_a_child_killed_by_a_signal_and_one_gone_already() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    with ChildWait(proc) as child:
        proc.kill()
        assert child.wait(600) == -signal.SIGKILL
    done = subprocess.Popen(["true"])
    time.sleep(0.5)  # exited, not yet reaped: its pidfd is readable at once
    with ChildWait(done) as child:
        assert child.wait(600) == 0


def test_a_signal_runs_its_handler_and_the_wait_goes_on() -> None:
    """The launchers forward signals from their handlers while they wait."""
    got: list[int] = []

    def handler(signum: int, _frame: Optional[FrameType]) -> None:
        got.append(signum)

    old = signal.signal(signal.SIGUSR1, handler)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        with ChildWait(proc) as child:
            signal.setitimer(signal.ITIMER_REAL, 0.2)  # SIGALRM's default would end us: use USR1
            signal.signal(signal.SIGALRM, lambda *_: signal.raise_signal(signal.SIGUSR1))
            assert child.wait(1.0) is None
            assert got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, old)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        proc.kill()
        proc.wait()
