from __future__ import annotations

from typing import Any

import pytest
from conftest import EXAMPLES
from sqlalchemy import select

from detslurm import settings
from detslurm.store import Metric, Trial, open_store

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.torch]


# 234 s in CI's local line (2026-11-27): after the tests of seconds.
@pytest.mark.heavy
def test_torch_example_trains_and_learns(det: Any) -> None:
    code, out, err = det(
        "e", "create", "--local", EXAMPLES / "torch_synthetic/const.yaml", EXAMPLES / "torch_synthetic"
    )
    assert code == 0, err + out
    store = open_store(settings.load().db_url)
    with store.tx() as s:
        (t,) = s.scalars(select(Trial)).all()
        vals = [
            m.metrics["validation_loss"]
            for m in s.scalars(
                select(Metric)
                .where(Metric.trial_id == t.id)
                .where(Metric.group == "validation")
                .order_by(Metric.steps_completed)
            )
        ]
    assert t.state == "COMPLETED" and len(vals) == 6
    assert vals[-1] < vals[0] / 2  # it learned
    state = torch.load(
        __import__("pathlib").Path(settings.load().checkpoint_dir) / t.latest_checkpoint / "state.pt", weights_only=True
    )
    assert state["step"] == 60
