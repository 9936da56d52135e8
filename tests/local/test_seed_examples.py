"""Seed 004's Core API tutorial stages, as written (synthetic MNIST), locally and on the cluster."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import EXAMPLES
from sqlalchemy import select

from detslurm import settings
from detslurm.store import Metric, Trial, open_store

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
MNIST = EXAMPLES / "core_api_pytorch_mnist"


def trials(exp_id: int) -> list[Trial]:
    with open_store(settings.load().db_url).tx() as s:
        return list(s.scalars(select(Trial).where(Trial.experiment_id == exp_id).order_by(Trial.id)))


def epochs(trial_id: int) -> list[int]:
    with open_store(settings.load().db_url).tx() as s:
        q = (
            select(Metric)
            .where(Metric.trial_id == trial_id)
            .where(Metric.group == "validation")
            .where(Metric.archived.is_(False))
            .order_by(Metric.steps_completed)
        )
        return [int(m.metrics["epoch"]) for m in s.scalars(q)]


def test_checkpoints_stage_and_continue_trial(det: Any) -> None:
    code, out, err = det("e", "create", "--local", MNIST / "checkpoints.yaml", MNIST)
    assert code == 0, out + err
    (t,) = trials(1)
    assert epochs(t.id) == [0, 1, 2] and t.latest_checkpoint
    # "Continue Trial": a new experiment warm-started from trial 1 keeps the weights but, per
    # the tutorial's trial-id check, restarts the epoch count.
    code, out, err = det(
        "e", "create", "--local", MNIST / "checkpoints.yaml", MNIST, "--config", f"searcher.source_trial_id={t.id}"
    )
    assert code == 0, out + err
    (t2,) = trials(2)
    assert t2.warm_start_checkpoint == t.latest_checkpoint and epochs(t2.id) == [0, 1, 2]


def test_adaptive_stage_locally(det: Any) -> None:
    code, out, err = det("e", "create", "--local", MNIST / "adaptive.yaml", MNIST)
    assert code == 0, out + err
    ts = trials(1)
    assert len(ts) == 6 and all(t.state == "COMPLETED" for t in ts)
    assert {len(t.searcher_ops) for t in ts} >= {1, 2}  # promotions happened


def test_distributed_stage_locally(det: Any) -> None:
    code, out, err = det(
        "e", "create", "--local", MNIST / "distributed.yaml", MNIST, "--config", "resources.slots_per_trial=2"
    )
    assert code == 0, out + err
    (t,) = trials(1)
    assert epochs(t.id) == [0, 1]


@pytest.mark.heavy
@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_env")
def test_distributed_and_adaptive_stages_on_cluster(det: Any) -> None:
    code, out, err = det("e", "create", MNIST / "distributed.yaml", MNIST, "-f")
    assert code == 0, out + err
    assert epochs(trials(1)[0].id) == [0, 1]
    code, out, err = det("e", "create", MNIST / "adaptive.yaml", MNIST, "--config", "searcher.max_trials=4")
    assert code == 0, err
    code, out, err = det("e", "wait", "2")
    assert code == 0, out + err
    assert len(trials(2)) == 4
