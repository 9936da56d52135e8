"""Trainer.fit's options, run off-cluster by the real determined 0.38.1's Trainer and by ours.

tests/fixtures/onevar_trial.py (written against Determined's API only) runs five fits in one
process on each side (one shared run for all the tests here), recording every callback call
with its arguments and Determined's deprecation notices in order among them:
0. evaluate_batch(batch, batch_idx) with one evaluation reducer per metric (AVG, SUM, MAX, MIN)
   and values that are not one number (a vector, a matrix, a numpy array, an int), a training
   metric that is a vector, callbacks with both legacy signatures (on_training_epoch_start(self)
   and the deprecated on_checkpoint_end), checkpoint hooks and callback state;
1. evaluate_full_dataset with a vector and a string among its metrics, gradient clipping,
   max_length and validation_period in epochs, a torch loader built from
   determined.pytorch.samplers;
2. torch's AMP driven by hand as Determined documents wrap_scaler (a CPU GradScaler, bfloat16
   autocast; the trial scales, steps through and updates the scaler);
3. aggregation_frequency=2 with STEP_EVERY_OPTIMIZER_STEP;
4. test_mode.
The conversion of a length in records (the searcher's ``max_length: {records: N}``) is compared
too. Determined's own AMP switch, ``use_amp()``, is CUDA's there (float32 on a CPU) and
bfloat16 here: docs/user/determined-compat.md says why; it is not compared.
"""

from __future__ import annotations

from typing import Any

import pytest
from determined_oracle import first_difference, onevar_runs, same

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

BASE = {"global_batch_size": 8, "lr": 0.1, "shuffle_seed": 5, "step_mode": 2}
FIT = {"validation_period": ["batches", 3], "reporting_period": ["batches", 3], "checkpoint_policy": "none"}
SCENARIOS = {
    "reducers": {
        "hparams": {**BASE, "dataloader_type": "determined", "evaluate": "reducers", "legacy_callback": True},
        "fit": {
            **FIT,
            "max_length": ["batches", 6],
            "reporting_period": ["batches", 2],
            "checkpoint_period": ["batches", 4],
        },
    },
    "full": {
        "hparams": {**BASE, "dataloader_type": "torch", "evaluate": "full", "clip": 0.05},
        "fit": {
            **FIT,
            "max_length": ["epochs", 2],
            "validation_period": ["epochs", 1],
            "reporting_period": ["batches", 5],
        },
    },
    "amp": {
        "hparams": {**BASE, "dataloader_type": "determined", "amp": "manual"},
        "fit": {**FIT, "max_length": ["batches", 6]},
    },
    "aggregation": {
        "hparams": {**BASE, "dataloader_type": "torch", "step_mode": 4},
        "aggregation_frequency": 2,
        "fit": {**FIT, "max_length": ["batches", 7], "validation_period": ["batches", 4]},
    },
    "test_mode": {
        "hparams": {**BASE, "dataloader_type": "determined"},
        "fit": {**FIT, "max_length": ["batches", 6], "test_mode": True},
    },
    "records": {"records": [[20, 8], [8, 8], [5, 8], [64, 8], [65, 8], [1000, 3]]},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """Each scenario's (Determined's record, ours)."""
    theirs, ours = onevar_runs(list(SCENARIOS.values()), tmp_path_factory.mktemp("fit"))
    return {name: (theirs[i], ours[i]) for i, name in enumerate(SCENARIOS)}


def compared(runs: dict[str, tuple[Any, Any]], name: str) -> list[Any]:
    theirs, ours = runs[name]
    assert same(theirs, ours), f"{name}: {first_difference(theirs, ours)}"
    return list(ours)


def events(record: list[Any], kind: str) -> list[Any]:
    return [e for e in record if e[0] == kind]


def test_validation_reduces_each_metric_with_its_reducer_over_all_values(runs: dict[str, Any]) -> None:
    got = compared(runs, "reducers")
    (outputs, *_), (metrics, *_) = (
        events(got, "on_validation_epoch_end")[0][1:],
        events(got, "on_validation_end")[0][1:],
    )
    # The callbacks see each batch's values as the trial returned them (a vector stays a vector)...
    assert outputs[1]["vec_avg"] == [1.0, 2.0] and outputs[1]["mat_max"] == [[1.0, -1.0], [0.0, 2.0]]
    # ... and each reducer runs over every value of every batch (8 validation batches).
    assert (metrics["idx_sum"], metrics["idx_max"], metrics["idx_min"]) == (28.0, 7, 0.5)
    assert (metrics["vec_avg"], metrics["vec_sum"], metrics["mat_max"]) == (5.25, 36.0, 7.0)
    # A training metric of several values is kept per batch and averaged over all of them.
    window = events(got, "on_training_workload_end")[0]
    assert window[2][1]["vec"] == [1.0, 1.0] and window[1]["vec"] == 0.75


def test_callbacks_run_in_determineds_order_with_its_deprecation_notices(runs: dict[str, Any]) -> None:
    got = compared(runs, "reducers")
    kinds = [e[0] for e in got]
    # on_checkpoint_end is deprecated once, when the Trainer starts; the old epoch-start
    # signature is logged as deprecated at each call, just before it.
    assert got[0] == ["warning", "FutureWarning", "on_checkpoint_end"]
    assert kinds.count("legacy_epoch_start") == 1 and kinds[kinds.index("legacy_epoch_start") - 1] == "log"
    # A checkpoint: save_start, then callback by callback the deprecated hook and write_end
    # (the recorder, then the legacy callback's on_checkpoint_end), then upload_end.
    ckpt = kinds.index("on_checkpoint_save_start")
    assert kinds[ckpt : ckpt + 4] == [
        "on_checkpoint_save_start",
        "on_checkpoint_write_end",
        "legacy_checkpoint_end",
        "on_checkpoint_upload_end",
    ]
    assert got[ckpt + 1][2] == ["load_data.json", "state_dict.pth", "trial_state.pkl"]
    assert got[ckpt + 1][1] == got[ckpt + 2][1] == got[ckpt + 3][1]  # the same checkpoint
    assert kinds.count("on_checkpoint_upload_end") == 2  # at batch 4 (the period) and at the end


def test_evaluate_full_dataset_epochs_and_gradient_clipping(runs: dict[str, Any]) -> None:
    got = compared(runs, "full")
    validations = events(got, "on_validation_end")
    assert len(validations) == 2  # Epoch(1) periods of an Epoch(2) length: 8 batches an epoch
    assert validations[0][1]["batches_seen"] == 8 and validations[0][1]["note"] == "full"
    assert len(validations[0][1]["per_batch"]) == 8  # a tensor of 8 values reported as they are
    steps = [b["w_after"] - b["w_before"] for w in events(got, "on_training_workload_end") for b in w[2]]
    # Clipped: an unclipped first step would be lr * 2 = 0.2.
    assert len(steps) == 16 and steps[0] == pytest.approx(0.1 * 0.05)


def test_amp_driven_by_hand_through_a_wrapped_scaler(runs: dict[str, Any]) -> None:
    got = compared(runs, "amp")
    batches = [b for w in events(got, "on_training_workload_end") for b in w[2]]
    assert [b["scale"] for b in batches] == [16.0, 16.0, 32.0, 32.0, 32.0, 64.0]  # grows every 3 steps
    assert batches[-1]["w_after"] > batches[0]["w_after"] > 0


def test_aggregation_frequency_steps_every_second_batch(runs: dict[str, Any]) -> None:
    got = compared(runs, "aggregation")
    batches = [b for w in events(got, "on_training_workload_end") for b in w[2]]
    moved = [b["w_after"] != b["w_before"] for b in batches]
    assert moved == [False, True, False, True, False, True, False]
    assert [b["lr"] for b in batches] == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025, 0.0125]


def test_test_mode_trains_and_validates_one_batch(runs: dict[str, Any]) -> None:
    got = compared(runs, "test_mode")
    (window,) = events(got, "on_training_workload_end")
    assert len(window[2]) == 1
    (outputs,) = events(got, "on_validation_epoch_end")
    assert len(outputs[1]) == 1  # one validation batch of 8
    assert len(events(got, "on_checkpoint_upload_end")) == 1


def test_a_length_in_records_is_whole_global_batches(runs: dict[str, Any]) -> None:
    got = compared(runs, "records")
    assert got == [["Batch", 2], ["Batch", 1], ["Batch", 1], ["Batch", 8], ["Batch", 8], ["Batch", 333]]
