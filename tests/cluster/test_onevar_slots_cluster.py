"""The differential suite's trial (tests/fixtures/onevar_trial.py, written against Determined's
API only) with 2 slots on the Slurm test cluster trains like one process over the same global
batches: the same training reports (window averages, each batch's metrics averaged over the
ranks, custom reducers) and the same validation metrics. Off-cluster, the same trial is compared
with the real determined 0.38.1 on one slot and on two (tests/unit/compat/test_determined_oracle_*.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from helpers import store
from sqlalchemy import select

from detslurm.store import Metric

pytest.importorskip("torch")
FIXTURE = Path(__file__).parents[1] / "fixtures" / "onevar_trial.py"
# Labels 0, 1, 2, ... so that each rank's half of a global batch differs; per-slot batches of 4.
SPEC = {
    "hparams": {"global_batch_size": 8, "lr": 0.1, "shuffle_seed": 5, "step_mode": 2},
    "fit": {
        "max_length": ["batches", 6],
        "validation_period": ["batches", 3],
        "reporting_period": ["batches", 2],
        "checkpoint_policy": "none",
    },
}
SPEC["hparams"] |= {"dataloader_type": "determined", "labels": "steps"}
CONFIG = (
    "entrypoint: python3 -m determined.launch.torch_distributed python3 onevar_trial.py out.json @spec.json\n"
    "searcher: {name: single, metric: val_loss}\nmax_restarts: 0\n"
)
# What depends on the slots by construction: the class reducer's list of per-slot values (one
# per rank), and in validation the function reducer, which weighs each update by its position
# among all updates (two slots make 16 validation batches of 4, one process 8 of 8).
PER_SLOT = ("cls_per_slot",)
PER_SLOT_IN_VALIDATION = ("cls_per_slot", "fn_reducer")


def reports(trial_id: int, group: str) -> dict[int, tuple[dict[str, Any], Any]]:
    """The trial's reports of ``group`` by batch: (metrics, batch metrics)."""
    with store().tx() as s:
        rows = s.scalars(
            select(Metric)
            .where(Metric.trial_id == trial_id, Metric.group == group, Metric.archived.is_(False))
            .order_by(Metric.steps_completed)
        )
        return {m.steps_completed: (dict(m.metrics), m.batch_metrics) for m in rows}


def close(got: Any, want: Any, skip: tuple[str, ...] = PER_SLOT) -> bool:
    if isinstance(got, dict) and isinstance(want, dict):
        keys = set(want) - set(skip)
        return keys == set(got) - set(skip) and all(close(got[k], want[k]) for k in keys)
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(close(a, b, skip) for a, b in zip(got, want, strict=True))
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        # Two ranks sum their halves in another order than one process: about 1e-7 apart.
        return math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-9)
    return bool(got == want)


@pytest.mark.slurm
@pytest.mark.torch
@pytest.mark.usefixtures("slurm_env")
def test_two_slots_train_like_one_process(det: Any, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    write(ctx / "onevar_trial.py", FIXTURE.read_text())
    write(ctx / "spec.json", json.dumps(SPEC))
    two = write(tmp_path / "two.yaml", CONFIG + "resources: {slots_per_trial: 2}\n")
    code, out, err = det("e", "create", two, ctx, "-f")
    assert code == 0, out + err
    one = write(tmp_path / "one.yaml", CONFIG + "resources: {slots_per_trial: 1}\n")
    code, out, err = det("e", "create", "--local", one, ctx)
    assert code == 0, out + err
    # Trials 1 (two slots) and 2 (one process): windows of 2 batches, validated at 3 and 6.
    for group, steps, skip in (("training", [2, 3, 4, 6], PER_SLOT), ("validation", [3, 6], PER_SLOT_IN_VALIDATION)):
        got, want = reports(1, group), reports(2, group)
        assert sorted(got) == sorted(want) == steps, (group, sorted(got), sorted(want))
        for step in steps:
            assert close(got[step], want[step], skip), (group, step, got[step], want[step])
    # Not vacuous: the slots saw different labels (one per-slot value each), and the weights moved.
    (metrics, batches) = reports(1, "training")[2]
    assert len(metrics["cls_per_slot"]) == 2 and len(set(metrics["cls_per_slot"])) == 2
    assert batches[1]["w_after"] > batches[0]["w_after"] > 0
