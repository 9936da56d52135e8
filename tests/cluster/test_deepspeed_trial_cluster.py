"""A DeepSpeedTrial under det.pytorch.deepspeed's Trainer, started by the DeepSpeed launcher on
two Slurm nodes (one slot each), trains like one process over the same global batches: the same
training loss at every batch and the same validation loss (tests/fixtures/ds_trial.py halves
each rank's micro batch when the ranks double). The API itself is tested off-cluster, in one
process, by tests/unit/pytorch/test_deepspeed_trial.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from helpers import store
from sqlalchemy import select

from detslurm.store import Metric

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
FIXTURE = Path(__file__).parents[1] / "fixtures" / "ds_trial.py"
CONFIG = (
    "entrypoint: python3 -m determined.launch.deepspeed python3 ds_trial.py\n"
    "searcher: {name: single, metric: val_loss}\nmax_restarts: 0\n"
)


def metrics(trial_id: int, group: str) -> dict[int, dict[str, Any]]:
    """The trial's reports of ``group``, by the batch they were reported at."""
    with store().tx() as s:
        rows = s.scalars(
            select(Metric)
            .where(Metric.trial_id == trial_id, Metric.group == group, Metric.archived.is_(False))
            .order_by(Metric.steps_completed)
        )
        return {m.steps_completed: dict(m.metrics) for m in rows}


@pytest.mark.slurm
@pytest.mark.torch
@pytest.mark.usefixtures("slurm_env")
@pytest.mark.late_build
@pytest.mark.full  # DeepSpeed's CPU op must be built (minutes of a core), and two runs of DeepSpeed start slowly
def test_two_nodes_train_like_one_process(det: Any, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    write(ctx / "ds_trial.py", FIXTURE.read_text())
    two = write(tmp_path / "two.yaml", CONFIG + "resources: {slots_per_trial: 2}\nslurm: {slots_per_node: 1}\n")
    code, out, err = det("e", "create", two, ctx, "-f")
    assert code == 0, out + err
    assert "ds_trial: rank 0 of 2 on c1" in out and "ds_trial: rank 1 of 2 on c2" in out, out[-3000:]
    one = write(tmp_path / "one.yaml", CONFIG + "resources: {slots_per_trial: 1}\n")
    code, out, err = det("e", "create", "--local", one, ctx)
    assert code == 0, out + err
    code, logs, err = det("trial", "logs", "2")
    assert code == 0 and "ds_trial: rank 0 of 1 on local" in logs, logs[-3000:] + err
    # Trials 1 (two nodes) and 2 (one process): 6 batches reported one by one, validated at 3 and 6.
    for group, steps in (("training", list(range(1, 7))), ("validation", [3, 6])):
        got, want = metrics(1, group), metrics(2, group)
        assert sorted(got) == sorted(want) == steps, (group, got, want)
        for step in steps:
            for name, value in want[step].items():
                # Two ranks sum their halves in another order than one process: about 1e-7 apart.
                assert math.isclose(got[step][name], value, rel_tol=1e-5), (group, step, name, got[step], value)
