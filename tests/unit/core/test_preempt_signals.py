"""The trial's preemption signal handler (docs/design/preemption.md): it never hangs and never loses the checkpoint.

Each case runs in a fresh interpreter, so the handlers it installs and the signals it sends
cannot touch pytest's own process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SETUP = """
import os, signal, sys, time
from pathlib import Path
from detslurm.core import DummyDistributedContext
from detslurm.core._preempt import PreemptContext
acks = []
ctx = PreemptContext(DummyDistributedContext(), Path(sys.argv[1]) / "control.json", lambda: acks.append(1))
ctx.start()
def term():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary
"""


def _run(tmp_path: Path, body: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    code = SETUP + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=timeout)


def test_handler_takes_no_lock_the_interrupted_code_may_hold(tmp_path: Path) -> None:
    # The main thread is inside the flag's own (non-reentrant) lock when SIGTERM arrives: a
    # handler that called Event.set() would wait on that lock forever.
    res = _run(
        tmp_path,
        """
        with ctx._flag._cond:
            term()
        print("answer", ctx.should_preempt(), len(acks))
        """,
        timeout=10,
    )
    assert res.returncode == 0, res.stderr
    assert "answer True 1" in res.stdout


def test_repeated_sigterm_before_the_ack_does_not_kill_the_trial(tmp_path: Path) -> None:
    # Slurm's SIGTERM and the launcher's forwarded one, seen seconds apart by a main thread
    # that was busy (e.g. in fsync): the trial must live on to checkpoint and acknowledge.
    res = _run(
        tmp_path,
        """
        term()
        time.sleep(2.5)
        term()
        print("alive", ctx.should_preempt(), len(acks))
        """,
    )
    assert res.returncode == 0, res.stderr
    assert "alive True 1" in res.stdout


def test_a_later_sigterm_after_the_ack_stops_at_once(tmp_path: Path) -> None:
    res = _run(
        tmp_path,
        """
        term()
        assert ctx.should_preempt() and acks == [1]
        time.sleep(2.5)
        term()
        print("still running")
        """,
    )
    assert res.returncode == -15, (res.returncode, res.stdout, res.stderr)
    assert "still running" not in res.stdout


def test_warning_signal_and_duplicates_ack_once(tmp_path: Path) -> None:
    res = _run(
        tmp_path,
        """
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        term()
        term()
        print("answers", ctx.should_preempt(), ctx.should_preempt(), len(acks))
        ctx.close()
        print("restored", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        """,
    )
    assert res.returncode == 0, res.stderr
    assert "answers True True 1" in res.stdout and "restored True" in res.stdout


def test_the_first_signal_s_arrival_is_kept_for_the_stop_time(tmp_path: Path) -> None:
    # Stop time: the acknowledgement reports when the first signal arrived (wall clock),
    # not when the trial got round to looking, and a repeat does not move it.
    res = _run(
        tmp_path,
        """
        before = time.time()
        term()
        first = ctx.signal_time
        time.sleep(0.3)
        term()
        print("kept", before <= first <= time.time() - 0.3, ctx.signal_time == first)
        """,
    )
    assert res.returncode == 0, res.stderr
    assert "kept True True" in res.stdout


def test_a_warning_signal_after_close_does_not_kill_the_finished_trial(tmp_path: Path) -> None:
    """Seen in the stress test: a trial had finished its work and closed its context when the
    time limit's warning (USR2) arrived; its default action killed the process, and a finished
    run was counted as failed and charged a restart."""
    res = _run(
        tmp_path,
        """
        ctx.close()
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        print("alive", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        """,
    )
    assert res.returncode == 0, res.stderr
    assert "alive True" in res.stdout
