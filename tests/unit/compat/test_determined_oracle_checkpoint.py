"""Checkpoints cross between the real determined 0.38.1's Trainer and ours, both ways.

Users arrive with checkpoints Determined's Trainer wrote and may leave with ours. Three
processes of tests/fixtures/onevar_trial.py, one after another, share one checkpoint dir
(Determined's off-cluster one, ``$HOME/.local/share/determined``, is DETSLURM_CHECKPOINT_DIR
for ours): a torch loader built from determined.pytorch.samplers (it skips
``get_initial_batch()`` batches), an LR stepped every batch and a callback with state.
1. Determined trains 8 batches, checkpointing at 4, then resumes its checkpoint at 4.
2. Ours resumes Determined's checkpoint at 4: it must record what Determined's resume did.
   Ours then trains the same 8 batches and resumes its own checkpoint at 4; and loads
   Determined's checkpoint with ``load_trial_from_checkpoint_path``.
3. Determined resumes our checkpoint at 4, which must record what our resume did, and loads
   it with its ``load_trial_from_checkpoint_path``.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from determined_oracle import first_difference, onevar_start, onevar_wait, oracle_python, same

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

HPARAMS = {"global_batch_size": 8, "lr": 0.1, "shuffle_seed": 5, "step_mode": 2, "dataloader_type": "torch"}
FIT = {"max_length": ["batches", 8], "validation_period": ["batches", 4], "reporting_period": ["batches", 2]}
TRAIN = {"hparams": HPARAMS, "fit": {**FIT, "checkpoint_period": ["batches", 4], "checkpoint_policy": "none"}}


def resume(ref: Any) -> dict[str, Any]:
    return {"hparams": HPARAMS, "fit": {**FIT, "checkpoint_policy": "none", "latest_checkpoint": ref}}


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("ckpt")
    home = work / "home"
    env = {"HOME": str(home), "DETSLURM_CHECKPOINT_DIR": str(home / ".local/share/determined")}
    # Determined 0.38.1 calls torch.load without weights_only, which torch >= 2.6 defaults to True:
    # it cannot read back even its own checkpoints (numpy's RNG state in them) unless told so.
    old_torch = {**env, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    load = {"hparams": HPARAMS, "load": 0, "checkpoint_dir": env["DETSLURM_CHECKPOINT_DIR"]}

    spec: dict[str, Any] = {"runs": [TRAIN, resume(["run", 0, 0])]}
    d1 = onevar_wait(onevar_start(oracle_python(), spec, work, "d1", old_torch), work, "d1")
    spec = {"uuids": [d1["new"][0][0]], "runs": [resume(0), TRAIN, resume(["run", 1, 0]), load]}
    o1 = onevar_wait(onevar_start(sys.executable, spec, work, "o1", env), work, "o1")
    spec = {"uuids": [o1["new"][1][0]], "runs": [resume(0), load]}
    d2 = onevar_wait(onevar_start(oracle_python(), spec, work, "d2", old_torch), work, "d2")
    return {
        "determined_train": d1["events"][0],
        "determined_resumes_determined": d1["events"][1],
        "detslurm_resumes_determined": o1["events"][0],
        "detslurm_train": o1["events"][1],
        "detslurm_resumes_detslurm": o1["events"][2],
        "detslurm_loads_determined": o1["events"][3],
        "determined_resumes_detslurm": d2["events"][0],
        "determined_loads_detslurm": d2["events"][1],
    }


def assert_same(theirs: list[Any], ours: list[Any]) -> None:
    assert same(theirs, ours), first_difference(theirs, ours)


def weight_at_4(train: list[Any]) -> float:
    """The weight after batch 4, from the training windows' per-batch metrics."""
    batches = [b for e in train if e[0] == "on_training_workload_end" for b in e[2]]
    return float(batches[3]["w_after"])


BY_BATCH_IDX = ("cls_reducer", "cls_per_slot", "fn_reducer")  # the fixture's reducers sum label * batch_idx


def off_cluster_resume(determined: list[Any], detslurm: list[Any]) -> tuple[list[Any], list[Any]]:
    """The two records of a resume off-cluster, with the one difference docs/user/determined-compat.md
    gives checked and set aside: Determined takes the batch a run resumes at from its master, so
    off-cluster its on_trial_startup says 0 and train_batch's batch_idx counts from 0 again (the
    weights, LR, metrics and "batches" are the checkpoint's in both)."""
    assert determined[0] == ["on_trial_startup", 0, "source"] and detslurm[0] == ["on_trial_startup", 4, "source"]
    windows = [[e for e in r if e[0] == "on_training_workload_end"] for r in (determined, detslurm)]
    # Batches 4 and 5 of 8 records: Determined's batch_idx 0 and 1, ours 4 and 5.
    assert [w[0][1]["cls_reducer"] for w in windows] == [8.0 * (0 + 1), 8.0 * (4 + 5)]
    for w in windows[0] + windows[1]:
        for key in BY_BATCH_IDX:
            del w[1][key]
    return determined[1:], detslurm[1:]


def test_a_checkpoint_of_determineds_resumes_here_with_the_same_next_metrics(records: dict[str, Any]) -> None:
    theirs, ours = off_cluster_resume(records["determined_resumes_determined"], records["detslurm_resumes_determined"])
    assert_same(theirs, ours)
    # Not vacuous: the resume loads the callback's saved state and trains 4 more batches.
    assert [e[0] for e in theirs[:2]] == ["on_checkpoint_load_start", "load_state_dict"]
    batches = [b for e in theirs if e[0] == "on_training_workload_end" for b in e[2]]
    assert len(batches) == 4 and batches[0]["lr"] == 0.1 * 0.5**4
    # ... and it is the uninterrupted run's continuation.
    assert batches[0]["w_before"] == pytest.approx(weight_at_4(records["determined_train"]))


def test_both_trainers_train_and_checkpoint_alike(records: dict[str, Any]) -> None:
    assert_same(records["determined_train"], records["detslurm_train"])


def test_a_checkpoint_of_ours_resumes_under_determined_with_the_same_next_metrics(records: dict[str, Any]) -> None:
    theirs, ours = off_cluster_resume(records["determined_resumes_detslurm"], records["detslurm_resumes_detslurm"])
    assert_same(theirs, ours)
    assert [e[0] for e in ours[:2]] == ["on_checkpoint_load_start", "load_state_dict"]


def test_load_trial_from_checkpoint_path_reads_the_others_checkpoints(records: dict[str, Any]) -> None:
    (theirs,) = records["determined_loads_detslurm"]
    (ours,) = records["detslurm_loads_determined"]
    assert theirs[:2] == ours[:2] == ["loaded", "OneVarTrial"]
    assert theirs[2] == pytest.approx(weight_at_4(records["detslurm_train"]))
    assert ours[2] == pytest.approx(weight_at_4(records["determined_train"]))
    assert theirs[3] == ours[3] == HPARAMS
