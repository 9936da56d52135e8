"""What a new user meets in the first hour, in local mode: a misnamed searcher metric, Ctrl-C
twice, a trial that fails, a test-mode script that reports too little. Each ends at once, says
why on the console, and leaves no state that nothing will change."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import EXAMPLES, ROOT, write
from helpers import store, wait_for
from sqlalchemy import select

from detslurm.cli import outcome
from detslurm.cli.app import App
from detslurm.store import Experiment, Trial, TrialRun

pytestmark = pytest.mark.e2e
CORE = EXAMPLES / "core_api"
FIXTURES = Path(__file__).parents[1] / "fixtures"

# Ignores preemption: a pause (the first Ctrl-C) waits for it, so only a kill stops it.
STUBBORN = """
import time

import determined as det

with det.core.init() as ctx:
    for i in range(1, 3000):
        ctx.train.report_training_metrics(steps_completed=i, metrics={"loss": 1.0})
        if i % 5 == 0:
            ctx.train.report_progress(i / 3000)
        time.sleep(0.05)
"""

BOOM = """
import determined as det

with det.core.init() as ctx:
    ctx.train.report_training_metrics(steps_completed=1, metrics={"loss": 1.0})
    ctx.train.report_progress(0.3)
    print("last words before the failure", flush=True)

    def inner():
        raise RuntimeError("bad value \\x1b[2J\\x1b]0;owned\\x07 in the data")

    inner()
"""

# 0.37 style: trains op.length batches but reports training metrics only every 10.
EVERY_TEN = """
import determined as det

with det.core.init() as ctx:
    for op in ctx.searcher.operations():
        for b in range(1, op.length + 1):
            if b % 10 == 0:
                ctx.train.report_training_metrics(steps_completed=b, metrics={"loss": 1.0})
        ctx.train.report_validation_metrics(steps_completed=op.length, metrics={"m": 0.5})
        op.report_completed(0.5)
"""


def experiment(exp_id: int) -> Experiment:
    with store().read() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        s.expunge(exp)
        return exp


def trials(exp_id: int) -> list[Trial]:
    with store().read() as s:
        return list(s.scalars(select(Trial).where(Trial.experiment_id == exp_id).order_by(Trial.id)))


def _spawn(*args: str | Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "detslurm.cli.main", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 180) -> str:
    """The process's output once it exits; a process still running after ``timeout`` (a hang)
    is killed and fails the test."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"still running after {timeout} s (a hang):\n{out}") from None
    return out


def test_misnamed_metric_errors_the_asha_experiment_at_once(det: Any, tmp_path: Path) -> None:
    cfg = write(
        tmp_path / "c.yaml",
        """
entrypoint: python3 train.py
hyperparameters: {lr: 0.1, noise: 0.1, sleep: 0.0}
searcher: {name: adaptive_asha, metric: val_los, max_trials: 2, max_time: 40, time_metric: batches,
           max_concurrent_trials: 2}
max_restarts: 0
""",
    )
    out = _finish(_spawn("e", "create", "--local", cfg, CORE))  # before: STOPPING_ERROR for good
    needle = "searcher metric 'val_los' is missing from the reported validation metrics (got: batches, validation_loss)"
    assert "Experiment 1 ERROR" in out and needle in out, out
    # A trial that finished in the step that failed the search is COMPLETED; none is left live.
    states = [t.state for t in trials(1)]
    assert experiment(1).state == "ERROR" and set(states) <= {"ERROR", "COMPLETED"}
    code, out, _ = det("e", "describe", "1")
    assert code == 0 and needle in out and "searcher.metric" in out
    code, out, _ = det("e", "wait", "1")  # returns at once, and says why
    assert code == 1 and needle in out
    # What `det e create --follow` prints (on Slurm) once the first trial's stream ended.
    *first, told = outcome.after_follow(App(), 1)
    if states[0] == "ERROR":
        assert first == ["trial 1: ERROR (stopped: experiment 1 failed (det experiment describe 1 says why))"]
    assert told.startswith("Experiment 1 ERROR: the search failed on a report of trial") and needle in told


def test_misnamed_metric_037_style_errors_too(det: Any, tmp_path: Path) -> None:
    write(tmp_path / "ctx/ops_037.py", (FIXTURES / "ops_037.py").read_text())
    cfg = write(
        tmp_path / "c.yaml",
        """
entrypoint: python3 ops_037.py
hyperparameters: {lr: 0.1}
searcher: {name: single, metric: los, max_length: {batches: 4}}
max_restarts: 0
""",
    )
    code, out, _ = det("e", "create", "--local", cfg, tmp_path / "ctx")  # before: COMPLETED
    assert code == 1 and "Experiment 1 ERROR" in out
    assert "searcher metric 'los' is missing from the reported validation metrics (got: loss)" in out


def test_second_ctrl_c_is_a_kill_not_a_failure(det: Any, tmp_path: Path) -> None:
    write(tmp_path / "ctx/stubborn.py", STUBBORN)
    cfg = write(tmp_path / "c.yaml", "entrypoint: python3 stubborn.py\nsearcher: {name: single, metric: m}\n")
    proc = _spawn("e", "create", "--local", cfg, tmp_path / "ctx")
    wait_for(lambda: bool(trials(1)) and trials(1)[0].progress > 0, what="the trial's first progress report")
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: experiment(1).state == "PAUSED", what="the pause of the first Ctrl-C")
    proc.send_signal(signal.SIGINT)
    out = _finish(proc)
    assert "Experiment 1 CANCELED" in out, out
    (t,) = trials(1)
    # Before: PAUSED with the trial ACTIVE and its run RUNNING, and the next activate failed it
    # ("exceeded max restarts (0); last exit code None").
    assert t.state == "CANCELED" and t.restarts == 0 and experiment(1).state == "CANCELED"
    with store().read() as s:
        runs = list(s.scalars(select(TrialRun).where(TrialRun.trial_id == t.id)))
    assert [r.state for r in runs] != ["RUNNING"] and all(r.state.is_terminal for r in runs)
    pids = [int(str(r.job_id).split("@")[0]) for r in runs]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    code, out, _ = det("t", "logs", str(t.id))
    assert code == 0 and "trial killed" in out and "None" not in out


def test_failure_is_told_on_the_console(det: Any, tmp_path: Path) -> None:
    write(tmp_path / "ctx/boom.py", BOOM)
    cfg = write(
        tmp_path / "c.yaml", "entrypoint: python3 boom.py\nmax_restarts: 0\nsearcher: {name: single, metric: m}\n"
    )
    code, out, _ = det("e", "create", "--local", cfg, tmp_path / "ctx")
    assert code == 1 and "Experiment 1 ERROR" in out
    # Why, the traceback's last lines (its exception last), and where the rest is.
    assert "trial 1: ERROR (trial exceeded max restarts (0); its last run failed with exit code 1)" in out
    assert "Traceback (most recent call last):" in out and "RuntimeError: bad value" in out
    assert "det trial logs 1" in out
    assert "\x1b" not in out and "\x07" not in out  # trial output cannot drive the terminal
    rows = json.loads(det("e", "list", "--json")[1])
    assert rows[0]["state"] == "ERROR" and rows[0]["progress"] == pytest.approx(0.3)  # not 100%
    code, out, _ = det("e", "wait", "1")
    assert code == 1 and "RuntimeError: bad value" in out and "det trial logs 1" in out


def test_paused_experiment_shows_its_progress(det: Any) -> None:
    proc = _spawn("e", "create", "--local", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=0.1")
    wait_for(lambda: bool(trials(1)) and trials(1)[0].latest_checkpoint is not None, what="a checkpoint")
    assert det("e", "pause", "1")[0] == 0
    assert "Experiment 1 PAUSED" in _finish(proc)
    (row,) = json.loads(det("e", "list", "--json")[1])
    assert row["state"] == "PAUSED" and 0 < row["progress"] < 1  # before: 0% until the trial ended


def test_test_mode_says_what_was_missing(det: Any, tmp_path: Path) -> None:
    write(tmp_path / "ctx/every_ten.py", EVERY_TEN)
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 every_ten.py\nsearcher: {name: single, metric: m, max_length: {batches: 100}}\n",
    )
    code, out, err = det("e", "create", "--local", "--test", cfg, tmp_path / "ctx")
    assert code == 1 and "Model definition test failed" in err
    assert "it reported validation metrics (1). Missing: training metrics, a checkpoint." in err
    assert "searcher.max_length {batches: 1}" in err and "op.length" in err  # how test mode decides the length
