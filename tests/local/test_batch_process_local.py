"""torch_batch_process in real trials (det e create --local): two slots under the
torch_distributed launcher, each rank processing its shard of the dataset, and a pause
(Determined's preemption) after which the activated trial processes only what was left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, write
from helpers import store, wait_for
from sqlalchemy import select

from detslurm.store import Checkpoint, Metric, Trial

pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.torch]
FIXTURE = Path(__file__).parents[1] / "fixtures" / "batch_infer.py"
RECORDS, BATCH, SLOTS = 37, 2, 2

CONFIG = (
    "name: batch-infer\n"
    "entrypoint: python3 -m determined.launch.torch_distributed python3 batch_infer.py\n"
    "searcher: {name: single, metric: records}\n"
    f"resources: {{slots_per_trial: {SLOTS}}}\n"
    "max_restarts: 0\n"
)


def experiment(tmp_path: Path, env: str = "") -> tuple[Path, Path]:
    write(tmp_path / "ctx" / "batch_infer.py", FIXTURE.read_text())
    extra = f"environment: {{environment_variables: [{env}]}}\n" if env else ""
    return write(tmp_path / "c.yaml", CONFIG + extra), tmp_path / "ctx"


def seen(tmp_path: Path) -> list[dict[str, Any]]:
    """Every line the ranks wrote to their upload_path(), rank by rank, in order."""
    files = sorted(tmp_path.rglob("rank_*/seen.jsonl"))
    assert [f.parent.name for f in files] == [f"rank_{r}" for r in range(SLOTS)], files
    assert len({f.parent.parent for f in files}) == 1  # one output uuid for the trial
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def trial() -> Trial:
    with store().tx() as s:
        (t,) = s.scalars(select(Trial))
        return t


def validation() -> list[dict[str, Any]]:
    with store().tx() as s:
        rows = s.scalars(select(Metric).where(Metric.group == "validation").order_by(Metric.id))
        return [dict(m.metrics, steps=m.steps_completed) for m in rows]


def assert_each_batch_once_on_its_rank(lines: list[dict[str, Any]]) -> None:
    batches = [row for row in lines if "ids" in row]
    # Batch i of BATCH records goes to rank i % SLOTS: rank r's batch_idx k is global batch k*SLOTS+r.
    for row in batches:
        first = (row["batch_idx"] * SLOTS + row["rank"]) * BATCH
        assert row["ids"] == list(range(first, min(first + BATCH, RECORDS))), row
    ids = sorted(i for row in batches for i in row["ids"])
    assert ids == list(range(RECORDS))  # every record exactly once


def test_two_slots_process_their_shards_and_reduce_across_ranks(det: Any, tmp_path: Path) -> None:
    cfg, ctx = experiment(tmp_path)
    code, out, err = det("e", "create", "--local", cfg, ctx)
    assert code == 0, out + err
    assert trial().state == "COMPLETED"
    lines = seen(tmp_path)
    assert_each_batch_once_on_its_rank(lines)
    # 19 batches: 10 steps per rank (rank 1's last is empty), a checkpoint every 3 and at the end.
    per_rank = [[row for row in lines if row["rank"] == r] for r in range(SLOTS)]
    assert [len([x for x in rows if "ids" in x]) for rows in per_rank] == [10, 9]
    assert all(len([x for x in rows if x.get("checkpoint")]) == 4 for rows in per_rank)
    with store().tx() as s:
        assert sorted(c.steps_completed for c in s.scalars(select(Checkpoint))) == [3, 6, 9, 10]
    assert validation() == [{"records": RECORDS, "id_sum": sum(range(RECORDS)), "steps": 10}]


def test_a_paused_trial_resumes_after_its_last_checkpoint(det: Any, tmp_path: Path) -> None:
    # 1.5 s a batch: the pause has over 10 s to reach the ranks before they would finish.
    cfg, ctx = experiment(tmp_path, env="BP_SLEEP=1.5, BP_INTERVAL=2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "detslurm.cli.main", "e", "create", "--local", str(cfg), str(ctx)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    wait_for(lambda: trial_or_none() is not None and trial().latest_checkpoint is not None, what="a checkpoint")
    assert det("e", "pause", "1")[0] == 0
    stdout, _ = proc.communicate(timeout=600)
    assert "Experiment 1 PAUSED" in stdout, stdout[-3000:]
    paused = trial()
    assert paused.state == "PAUSED" and 0 < paused.steps_completed < 10
    for r in range(SLOTS):  # every rank stopped right after a checkpoint
        assert [row for row in seen(tmp_path) if row["rank"] == r][-1] == {"rank": r, "checkpoint": True}
    code, out, err = det("e", "activate", "1")
    assert code == 0 and "Experiment 1 COMPLETED" in out, out + err
    t = trial()
    assert t.run_count == 2 and t.state == "COMPLETED"
    assert_each_batch_once_on_its_rank(seen(tmp_path))  # nothing processed twice, nothing skipped
    # Each run reported its reducers where it stopped; together they saw every record once.
    first, second = validation()
    assert first["steps"] == paused.steps_completed and second["steps"] == 10
    assert first["records"] + second["records"] == RECORDS
    assert first["id_sum"] + second["id_sum"] == sum(range(RECORDS))


def trial_or_none() -> Trial | None:
    with store().tx() as s:
        return s.scalars(select(Trial)).first()
