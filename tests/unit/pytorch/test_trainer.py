"""The PyTorch Trainer API and the Determined-compatible import path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT
from helpers import store
from sqlalchemy import select

from detslurm.store import Checkpoint, Metric, Trial

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
PT = EXAMPLES / "pytorch_trainer"
COMPAT = str(ROOT / "detslurm" / "_compat")


def test_units() -> None:
    from detslurm.pytorch import Batch, Epoch, TrainUnit

    assert Batch(10).hits(20, 7) and not Batch(10).hits(15, 7) and not Batch(0).hits(0, 7)
    assert Batch([2, 5]).hits(5, 100) and not Batch([2, 5]).hits(4, 100)
    assert Epoch(2).hits(14, 7) and not Epoch(2).hits(7, 7)
    # next_hit agrees with hits: the Trainer skips its bookkeeping on the batches in between.
    for unit in (Batch(10), Batch([2, 5]), Epoch(2), Batch(0), Epoch([1, 3])):
        for done in range(40):
            nxt = unit.next_hit(done, 7)
            hits_after = [b for b in range(done + 1, 60) if unit.hits(b, 7)]
            assert nxt == (hits_after[0] if hits_after else None), (unit, done)
    assert TrainUnit.from_values(batches=0) is None and TrainUnit.from_values(
        records=64, global_batch_size=32
    ) == Batch(2)
    with pytest.raises(ValueError, match="global_batch_size"):
        TrainUnit.from_values(records=64)


def run_script(tmp_path: Path, *cmd: str) -> subprocess.CompletedProcess[str]:
    work = tmp_path / "pt"
    shutil.copytree(PT, work, dirs_exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_", "SLURM_"))}
    env.update(PYTHONPATH=COMPAT, HOME=str(tmp_path), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *cmd], cwd=work, env=env, capture_output=True, text=True, timeout=300)


def test_seed_example_runs_locally_as_written(tmp_path: Path) -> None:
    r = run_script(tmp_path, "train.py")
    assert r.returncode == 0, r.stderr[-2000:]


def test_seed_example_under_torchrun_two_processes(tmp_path: Path) -> None:
    r = run_script(tmp_path, "-m", "torch.distributed.run", "--nproc_per_node=2", "train.py")
    assert r.returncode == 0, r.stderr[-3000:]


def val_metrics(exp_id: int) -> list[tuple[int, dict[str, Any]]]:
    with store().tx() as s:
        q = (
            select(Metric)
            .join(Trial)
            .where(Trial.experiment_id == exp_id)
            .where(Metric.group == "validation")
            .where(Metric.archived.is_(False))
            .order_by(Metric.steps_completed)
        )
        return [(m.steps_completed, m.metrics) for m in s.scalars(q)]


def train_losses(exp_id: int) -> list[tuple[int, Any]]:
    with store().tx() as s:
        q = (
            select(Metric)
            .join(Trial)
            .where(Trial.experiment_id == exp_id)
            .where(Metric.group == "training")
            .where(Metric.archived.is_(False))
            .order_by(Metric.steps_completed)
        )
        return [(m.steps_completed, m.metrics["loss"]) for m in s.scalars(q)]


def test_legacy_trial_harness_and_checkpoint_contents(det: Any, tmp_path: Path) -> None:
    code, out, err = det("e", "create", "--local", PT / "legacy.yaml", PT)
    assert code == 0, out + err
    vals = val_metrics(1)
    assert [s for s, _ in vals] == [16, 32]
    assert {"validation_loss", "accuracy", "batches", "epochs"} <= set(vals[-1][1])
    with store().tx() as s:
        ck = s.scalars(select(Checkpoint).where(Checkpoint.state == "COMPLETED")).one()
    assert set(ck.metadata_) == {"determined_version", "steps_completed", "framework", "format"}
    assert ck.metadata_["steps_completed"] == 32 and ck.metadata_["framework"].startswith("torch-")
    path = Path(ck.storage_path)
    assert {"state_dict.pth", "trial_state.pkl", "load_data.json", "metadata.json"} <= {p.name for p in path.iterdir()}
    assert (path / "code/model_def.py").exists()
    # Seed 003 step 6: load the trial class from the checkpoint's code with a CheckpointLoadContext.
    probe = (
        f"import determined as det, torch\nfrom determined import pytorch\n"
        f"with det.import_from_path({str(path / 'code')!r}):\n    import model_def\n"
        f"t = model_def.MyPyTorchTrial(pytorch.CheckpointLoadContext(), {{'lr': 0.1}})\n"
        f"sd = torch.load({str(path / 'state_dict.pth')!r}, weights_only=False)\n"
        f"t.model.load_state_dict(sd['models_state_dict'][0])\nimport sys\n"
        f"assert 'model_def' not in sys.modules\nprint('loaded')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe],
        env=dict(os.environ, PYTHONPATH=COMPAT),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr


def test_test_mode_runs_exactly_one_batch(det: Any) -> None:
    code, out, err = det("e", "create", "--local", "--test-mode", PT / "legacy.yaml", PT)
    assert code == 0 and "Model definition test succeeded" in out, out + err
    assert [s for s, _ in train_losses(1)] == [1]
    assert [s for s, _ in val_metrics(1)] == [1]


def test_kill_and_resume_reproduces_the_uninterrupted_run(det: Any) -> None:
    seed = ["--config", "reproducibility.experiment_seed=7"]
    assert det("e", "create", "--local", PT / "legacy.yaml", PT, *seed)[0] == 0
    code, out, err = det(
        "e",
        "create",
        "--local",
        PT / "legacy.yaml",
        PT,
        *seed,
        "--config",
        "environment.environment_variables=[EXAMPLE_CRASH_AT_BATCH=21]",
    )
    assert code == 0, out + err
    with store().tx() as s:
        crashed = s.scalars(select(Trial).where(Trial.experiment_id == 2)).one()
    assert crashed.restarts == 1 and crashed.run_count == 2
    assert val_metrics(2) == val_metrics(1)  # bit for bit: data order, dropout, optimizer state
    assert train_losses(2) == train_losses(1)


def test_missing_searcher_metric_fails_the_trial(det: Any) -> None:
    code, out, _ = det(
        "e",
        "create",
        "--local",
        PT / "legacy.yaml",
        PT,
        "--config",
        "searcher.metric=nope",
        "--config",
        "max_restarts=0",
    )
    assert code == 1
    code, out, _ = det("t", "logs", "1")
    assert "the searcher metric 'nope' is not in the validation metrics" in out


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_env")
def test_trainer_on_cluster_two_nodes(det: Any) -> None:
    code, out, err = det(
        "e",
        "create",
        PT / "const.yaml",
        PT,
        "--config",
        "resources.slots_per_trial=4",
        "--config",
        "searcher.max_length.batches=16",
        "-f",
    )
    assert code == 0, out + err
    vals = val_metrics(1)
    assert [s for s, _ in vals] == [10, 16]
    assert "Traceback" not in out
    assert all(isinstance(m["validation_loss"], float) for _, m in vals)
