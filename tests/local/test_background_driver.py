"""A detached activate of a local experiment (`det e activate --detach`, the dashboard's button,
the SDK's `Experiment.activate()`): a driver of its own in the background, never an experiment
listed ACTIVE with nothing behind it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES
from helpers import wait_for
from test_first_hour import experiment, trials

from detslurm.cli.undriven import driver_lock, is_driven

pytestmark = pytest.mark.e2e
CORE = EXAMPLES / "core_api"


def _paused_local(det: Any, *config: str) -> int:
    code, out, err = det("e", "create", "--local", "--paused", CORE / "const.yaml", CORE, *config)
    assert code == 0 and "Created experiment 1" in out, out + err
    return 1


def _driven(exp_id: int) -> bool:
    return is_driven(experiment(exp_id).exp_dir)


def test_activate_detach_runs_a_local_experiment_to_its_end_in_the_background(det: Any) -> None:
    exp_id = _paused_local(det)
    code, out, err = det("e", "activate", "--detach", str(exp_id))
    assert code == 0, out + err
    log = Path(experiment(exp_id).exp_dir) / "driver.log"
    assert f"Experiment {exp_id}: it runs in the background; its driver's output: {log}" in out
    # It returns once the driver holds the experiment: a read meanwhile never pauses it as undriven.
    assert _driven(exp_id)
    code, out, _ = det("e", "list", "--json")
    assert code == 0 and json.loads(out)[0]["state"] in ("ACTIVE", "COMPLETED")
    # `det e wait` watches the driver's work (it does not drive it a second time).
    code, out, err = det("e", "wait", str(exp_id))
    assert code == 0 and f"Experiment {exp_id} COMPLETED" in out, out + err
    (t,) = trials(exp_id)
    assert t.state == "COMPLETED" and t.restarts == 0
    # The driver ends with the experiment (it saw the end a moment before or after the waiter).
    wait_for(lambda: not _driven(exp_id), what="the background driver to end")
    assert log.exists()


def test_the_dashboard_buttons_act_as_det_e_pause_activate_kill(det: Any) -> None:
    from detslurm.cli.app import App
    from detslurm.cli.dashboard import _sources

    # A long trial: the kill below reaches it while it runs.
    exp_id = _paused_local(det, "--config", "hyperparameters.sleep=1")
    act = _sources(App(), allow_actions=True).act
    assert act is not None and _sources(App(), allow_actions=False).act is None
    act("activate", exp_id)
    assert str(experiment(exp_id).state) == "ACTIVE" and _driven(exp_id)
    act("kill", exp_id)
    code, out, err = det("e", "wait", str(exp_id))
    assert code == 1 and f"Experiment {exp_id} CANCELED" in out, out + err
    wait_for(lambda: not _driven(exp_id), what="the background driver to end")


def test_a_driver_that_cannot_start_is_an_error_not_an_active_experiment(det: Any, tmp_path: Path) -> None:
    exp_id = _paused_local(det)
    # Another process drives it already: the background driver cannot take the lock.
    lock = driver_lock(experiment(exp_id).exp_dir)
    lock.acquire(timeout=0)
    try:
        code, out, err = det("e", "activate", "--detach", str(exp_id))
    finally:
        lock.release()
    assert code == 1, out + err
    assert "its background driver did not start" in err and "already being run by another detslurm process" in err
    assert os.path.exists(Path(experiment(exp_id).exp_dir) / "driver.log")
    # Another driver holds it: its state is that driver's to change.
    assert str(experiment(exp_id).state) == "ACTIVE"


def test_a_driver_that_fails_to_start_puts_the_experiment_back_to_paused(
    det: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    exp_id = _paused_local(det)
    # The background driver's Python cannot even start detslurm.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent / "no-such-dir"))
    monkeypatch.setattr("sys.executable", "/bin/false")
    code, out, err = det("e", "activate", "--detach", str(exp_id))
    assert code == 1 and "its background driver did not start (exit code 1)" in err, out + err
    assert str(experiment(exp_id).state) == "PAUSED"


def test_a_link_planted_as_the_drivers_log_is_not_followed(det: Any, tmp_path: Path) -> None:
    exp_id = _paused_local(det)
    target = tmp_path / "not-the-log"
    target.write_text("untouched\n")
    (Path(experiment(exp_id).exp_dir) / "driver.log").symlink_to(target)
    code, out, err = det("e", "activate", "--detach", str(exp_id))
    assert code == 1 and "cannot open its driver's log" in err and "Traceback" not in err, out + err
    assert target.read_text() == "untouched\n"
    assert str(experiment(exp_id).state) == "PAUSED"
