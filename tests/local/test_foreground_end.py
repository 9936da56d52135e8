"""`det e create --local` when its foreground ends without a Ctrl-C: a hang-up (a closed
terminal, an SSH drop), a closed output pipe (`| head`), SIGKILL. Each pauses the experiment
once its trial has checkpointed, leaves no trial process behind, never leaves it ACTIVE with
nothing driving it, and `det e activate` finishes it without losing a step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import psutil
import pytest
from conftest import EXAMPLES
from helpers import store, wait_for
from sqlalchemy import select
from test_first_hour import _finish, _spawn, experiment, trials

from detslurm.cli.app import App
from detslurm.store import TrialRun

pytestmark = pytest.mark.e2e
CORE = EXAMPLES / "core_api"
STEPS = 40  # the example's batches; it checkpoints every 5


def _start() -> tuple[subprocess.Popen[str], set[int]]:
    """`det e create --local` of the Core API example (max_restarts 0: a restart spent on the
    foreground's end would fail it), and the trial's processes once it has checkpointed."""
    proc = _spawn(
        "e", "create", "--local", CORE / "const.yaml", CORE,
        "--config", "hyperparameters.sleep=0.2", "--config", "max_restarts=0",
    )  # fmt: skip
    wait_for(lambda: bool(trials(1)) and trials(1)[0].latest_checkpoint is not None, what="the first checkpoint")
    with store().read() as s:
        (job,) = s.scalars(select(TrialRun.job_id))
    launcher = psutil.Process(int(str(job).split("@")[0]))
    return proc, {launcher.pid, *(p.pid for p in launcher.children(recursive=True))}


def _alive(pids: set[int]) -> list[psutil.Process]:
    """Processes (not zombies) with one of ``pids`` or in one of their process groups: the
    entrypoint runs in a session of its own, and what it started stays in its group."""
    out = []
    for p in psutil.process_iter():
        try:
            if (p.pid in pids or os.getpgid(p.pid) in pids) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return out


def _listed_state(det: Any) -> str:
    code, out, _ = det("e", "list", "--json")
    assert code == 0
    (row,) = json.loads(out)
    return str(row["state"])


def _resumes_without_lost_steps(det: Any) -> None:
    code, out, err = det("e", "activate", "1")
    assert code == 0 and "Experiment 1 COMPLETED" in out, out + err
    (t,) = trials(1)
    assert t.state == "COMPLETED" and t.restarts == 0 and t.steps_completed == STEPS
    steps = [m["steps_completed"] for m in App().reads.metrics(t.id) if m["group"] == "training"]
    # Every batch trained once: the second run began after the first one's last checkpoint.
    assert sorted(steps) == list(range(1, STEPS + 1))
    with store().read() as s:
        runs = list(s.scalars(select(TrialRun).where(TrialRun.trial_id == t.id).order_by(TrialRun.run_id)))
    assert len(runs) == 2 and runs[0].exit_code == 0 and runs[0].preempt_acked


def _ends_paused(det: Any, end: Callable[[subprocess.Popen[str]], None]) -> str:
    """The driver's own pause: it stops the trial, waits for its checkpoint, and exits 0."""
    proc, pids = _start()
    end(proc)
    out = _finish(proc) if proc.stdout is not None and not proc.stdout.closed else ""
    assert proc.wait(timeout=120) == 0, out
    assert not _alive(pids)
    assert experiment(1).state == "PAUSED" and [t.state for t in trials(1)] == ["PAUSED"]
    assert _listed_state(det) == "PAUSED"
    _resumes_without_lost_steps(det)
    return out


def test_hang_up_pauses_with_a_checkpoint(det: Any) -> None:
    # Before: the trial ran on with parent 1, and the experiment stayed ACTIVE with nothing driving it.
    out = _ends_paused(det, lambda proc: proc.send_signal(signal.SIGHUP))
    assert "Ctrl-C, closing the terminal or the SSH session, or ending this process pauses it" in out
    assert "This process is ending (it got SIGHUP): pausing experiment 1" in out


def test_closed_output_pipe_pauses_with_a_checkpoint(det: Any) -> None:
    def close(proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        proc.stdout.close()  # `| head` has read what it wanted

    _ends_paused(det, close)


def test_sigterm_pauses_with_a_checkpoint(det: Any) -> None:
    out = _ends_paused(det, lambda proc: proc.send_signal(signal.SIGTERM))
    assert "(it got SIGTERM)" in out


def test_killed_foreground_leaves_nothing_running_and_reads_pause_it(det: Any) -> None:
    proc, pids = _start()
    proc.kill()
    proc.wait()
    # The kernel told the trial's launcher (the preemption signal): it checkpoints and exits.
    wait_for(lambda: not _alive(pids), what="the trial's processes to end after their driver's SIGKILL")
    # The first read finds no driver: PAUSED, not ACTIVE with nothing behind it, and not ERROR.
    assert _listed_state(det) == "PAUSED"
    assert [t.state for t in trials(1)] == ["PAUSED"]
    code, out, _ = det("t", "logs", "1")
    assert code == 0 and "the det process that ran experiment 1 ended: paused (det e activate 1 resumes it)" in out
    _resumes_without_lost_steps(det)


def test_the_dashboard_reads_a_killed_foreground_as_paused(det: Any) -> None:
    """The dashboard settles an undriven experiment as a `det` read does: its first read after
    the driver's SIGKILL shows it PAUSED, not ACTIVE with nothing behind it."""
    from test_dashboard import get

    from detslurm.cli.dashboard import _sources
    from detslurm.dashboard.testing import running_dashboard

    proc, pids = _start()
    proc.kill()
    proc.wait()
    wait_for(lambda: not _alive(pids), what="the trial's processes to end after their driver's SIGKILL")
    app = App()
    with running_dashboard(app.store, _sources(app, allow_actions=False)) as (base, cookie):
        code, rows = get(base, "/api/experiments", {"Cookie": cookie})
    assert code == 200 and [r["state"] for r in rows] == ["PAUSED"], rows
    assert [t.state for t in trials(1)] == ["PAUSED"]
    _resumes_without_lost_steps(det)


def test_activate_help_names_an_ended_foreground(det: Any) -> None:
    code, out, _ = det("e", "activate", "--help")
    assert code == 0 and "resumes a local experiment whose foreground ended" in " ".join(out.split())
