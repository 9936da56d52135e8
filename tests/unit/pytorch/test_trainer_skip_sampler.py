"""A plain torch loader that skips the trained batches itself (``SkipBatchSampler`` with
``context.get_initial_batch()``, as Determined's docs say) resumes at the checkpoint's batch:
the Trainer does not skip them a second time (Determined's Trainer never skips a plain torch
loader's batches; it is the user's to do)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import write

pytest.importorskip("torch")
pytestmark = pytest.mark.torch
FIXTURE = Path(__file__).parents[2] / "fixtures" / "skip_sampler_trial.py"


@pytest.mark.parametrize("resume", [True, False], ids=["latest_checkpoint", "no_checkpoint_given"])
def test_a_self_skipping_torch_loader_resumes_at_the_checkpoint(det: Any, tmp_path: Path, resume: bool) -> None:
    ctx = tmp_path / "ctx"
    write(ctx / "skip_sampler_trial.py", FIXTURE.read_text())
    seen = tmp_path / "seen.jsonl"
    env = f"CRASH_AT=7, CKPT_EVERY=5, SEEN_FILE={seen}, CRASH_MARKER={tmp_path / 'crashed'}"
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 skip_sampler_trial.py\n"
        "hyperparameters: {global_batch_size: 4}\n"
        "searcher: {name: single, metric: validation_loss, max_length: {batches: 12}}\n"
        "max_restarts: 1\n"
        f"environment: {{environment_variables: [{env}{'' if resume else ', NO_RESUME=1'}]}}\n",
    )
    code, out, err = det("e", "create", "--local", cfg, ctx)
    assert code == 0 and "Experiment 1 COMPLETED" in out, out + err
    rows = [json.loads(line) for line in seen.read_text().splitlines()]
    # Run 1 trained batches 0-6 and crashed at 7; run 2 resumed from the checkpoint at 5, or,
    # given no checkpoint, started over at 0 with get_initial_batch() 0, as Determined's does.
    # Batch b holds records 4b..4b+3 (10 batches a pass): batch 10 wraps to record 0.
    second = range(5, 12) if resume else range(12)
    assert [r["batch"] for r in rows] == [*range(7), *second]
    assert [r["first"] for r in rows] == [4 * (b % 10) for b in [*range(7), *second]]
