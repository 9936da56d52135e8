"""A slurmctld outage on the real cluster: while slurmctld is down, pause and kill still reach
running trials (their control files are written by the daemon's tick, which only logs that the
scheduler is unreachable); the trials checkpoint and exit, and after slurmctld is back
everything settles with no restart charged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES
from helpers import wait_for
from sqlalchemy import select
from test_faults_slurm import ctld

from detslurm import settings
from detslurm.protocol import RunPaths, exit_record_of
from detslurm.store import Experiment, Trial, TrialRun, open_store

pytestmark = [pytest.mark.slurm, pytest.mark.fault, pytest.mark.usefixtures("slurm_env")]
CORE = EXAMPLES / "core_api"


def run_dir(exp_id: int) -> Path | None:
    with open_store(settings.load().db_url).tx() as s:
        q = select(TrialRun).join(Trial).where(Trial.experiment_id == exp_id).where(TrialRun.state == "RUNNING")
        run = s.scalars(q).first()
        return Path(run.run_dir) if run else None


def trial_states() -> dict[int, str]:
    """The paused experiment's (1) trials' states, by trial id."""
    with open_store(settings.load().db_url).tx() as s:
        return {t.id: str(t.state) for t in s.scalars(select(Trial).where(Trial.experiment_id == 1))}


def exp_state(exp_id: int) -> str:
    with open_store(settings.load().db_url).tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        return exp.state


def test_pause_and_kill_reach_trials_while_slurmctld_is_down(det: Any, slurm_cluster: Path) -> None:
    for _ in range(2):  # 40 batches of 1 s, a checkpoint every 5: running long after the pause
        code, _, err = det("e", "create", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=1.0")
        assert code == 0, err
    wait_for(lambda: run_dir(1) is not None and run_dir(2) is not None)
    dirs = {1: run_dir(1), 2: run_dir(2)}
    ctld(slurm_cluster, "stop")
    try:
        assert det("e", "pause", "1")[0] == 0
        assert det("e", "kill", "2")[0] == 0
        for exp_id, reason in ((1, "pause"), (2, "kill")):
            d = dirs[exp_id]
            assert d is not None
            control = RunPaths.from_run_dir(d).control
            wait_for(control.exists)  # written by a tick that could not reach Slurm
            assert f'"reason": "{reason}"' in control.read_text()
        # The trials react with no Slurm at all: checkpoint, exit, and the batch shell records it.
        for d in dirs.values():
            assert d is not None
            wait_for(exit_record_of(d).exists)
        log = (settings.load().data_dir / "daemon.log").read_text()
        assert "scheduler unreachable" in log
    finally:
        ctld(slurm_cluster, "start")
    # A pause sets the experiment's state at once; its trial turns PAUSED only once the tick has
    # read that the run ended (slurmctld is back by then): wait for the trials, not the experiments.
    wait_for(
        lambda: exp_state(1) == "PAUSED" and exp_state(2) == "CANCELED" and set(trial_states().values()) == {"PAUSED"},
        90,
    )
    with open_store(settings.load().db_url).tx() as s:
        for t in s.scalars(select(Trial)):
            assert t.restarts == 0 and t.run_count == 1, (t.id, t.restarts, t.run_count)
            assert t.state == ("PAUSED" if t.experiment_id == 1 else "CANCELED")
            # Stopped early, at a checkpoint (1 s a batch, 40 batches: the pause came long before the end).
            assert t.latest_checkpoint is not None and 0 < t.steps_completed < 40, t.steps_completed
