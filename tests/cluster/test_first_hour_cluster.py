"""The first hour's failures on Slurm, as in local mode (tests/local/test_first_hour.py): a
misnamed searcher metric ends the experiment ERROR at once, with the message on the console of
`det e create --follow`, in `det e describe` and `det e wait`; a failing trial is told on the
console with its traceback's last lines and where the rest is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT, write
from test_first_hour import BOOM, EVERY_TEN

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
CORE = EXAMPLES / "core_api"


def _create_follow(*args: str | Path) -> str:
    """`det e create --follow` as a user runs it; its output once it returns (a hang fails)."""
    r = subprocess.run(
        [sys.executable, "-m", "detslurm.cli.main", "e", "create", "--follow", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,  # a guard against the old hang (STOPPING_ERROR for good), not a timing
    )
    return r.stdout + r.stderr


def test_misnamed_metric_ends_the_slurm_experiment_error_and_says_why(det: Any, tmp_path: Path) -> None:
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 train.py\nhyperparameters: {lr: 0.1, noise: 0.1, sleep: 0.0}\n"
        "searcher: {name: single, metric: val_los, max_length: {batches: 20}}\nmax_restarts: 0\n",
    )
    out = _create_follow(cfg, CORE)
    needle = "searcher metric 'val_los' is missing from the reported validation metrics (got: batches, validation_loss)"
    assert "Experiment 1 ERROR" in out and needle in out, out
    code, out, _ = det("e", "describe", "1")
    assert code == 0 and needle in out
    code, out, _ = det("e", "wait", "1")  # returns at once, and says why
    assert code == 1 and needle in out
    (row,) = json.loads(det("e", "list", "--json")[1])
    assert row["state"] == "ERROR"


def test_a_failing_trial_is_told_on_the_console(det: Any, tmp_path: Path) -> None:
    write(tmp_path / "ctx/boom.py", BOOM)
    cfg = write(
        tmp_path / "c.yaml", "entrypoint: python3 boom.py\nmax_restarts: 0\nsearcher: {name: single, metric: m}\n"
    )
    out = _create_follow(cfg, tmp_path / "ctx")
    # --follow streamed the trial's output (its traceback included), then says why it ended.
    assert "Experiment 1 ERROR" in out, out
    assert "Traceback (most recent call last):" in out and "RuntimeError: bad value" in out
    assert "trial 1: ERROR (trial exceeded max restarts (0); its last run failed with exit code 1)" in out
    # (The trial's escape bytes reach this pipe unchanged: only a terminal gets them cleaned,
    # detslurm/terminal.py, tests/unit/cli/test_terminal_guard.py.)
    code, out, _ = det("e", "wait", "1")
    assert code == 1 and "RuntimeError: bad value" in out and "det trial logs 1" in out
    (row,) = json.loads(det("e", "list", "--json")[1])
    assert row["state"] == "ERROR" and row["progress"] == pytest.approx(0.3)  # not 100%


def test_test_mode_on_slurm_says_what_was_missing(det: Any, tmp_path: Path) -> None:
    write(tmp_path / "ctx/every_ten.py", EVERY_TEN)
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 every_ten.py\nsearcher: {name: single, metric: m, max_length: {batches: 100}}\n",
    )
    code, out, err = det("e", "create", "--test", cfg, tmp_path / "ctx")
    assert code == 1 and "Model definition test failed" in err, out + err
    assert "it reported validation metrics (1). Missing: training metrics, a checkpoint." in err
    assert "searcher.max_length {batches: 1}" in err
