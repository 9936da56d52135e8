"""Fault injection without Slurm: a checkpoint write that fails midway on a full filesystem."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from sqlalchemy import select

from detslurm import settings
from detslurm.store import Checkpoint, Metric, Trial, open_store

pytestmark = [pytest.mark.fault, pytest.mark.e2e]
FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Any:
    """A 1 MiB tmpfs: the checkpoint storage that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tiny tmpfs needs root (CI runs as root)")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_checkpoint_failing_midway_leaves_previous_intact_and_used(det: Any, tmp_path: Path, tiny_fs: Path) -> None:
    ctx = tmp_path / "ctx"
    write(ctx / "ckpt_fill.py", (FIXTURES / "ckpt_fill.py").read_text())
    cfg = write(
        tmp_path / "c.yaml",
        f"""
name: full-disk
entrypoint: python3 ckpt_fill.py
searcher: {{name: single, metric: validation_loss, max_length: {{batches: 12}}}}
checkpoint_storage: {{type: shared_fs, host_path: {tiny_fs}, save_trial_latest: 5}}
environment: {{environment_variables: [CKPT_BIG_BYTES=4000000]}}
max_restarts: 1
""",
    )
    code, out, err = det("e", "create", "--local", cfg, ctx)
    assert code == 0, out + err
    with open_store(settings.load().db_url).tx() as s:
        (t,) = s.scalars(select(Trial)).all()
        cks = list(
            s.scalars(select(Checkpoint).where(Checkpoint.trial_id == t.id).order_by(Checkpoint.steps_completed))
        )
        steps = sorted(
            s.scalars(
                select(Metric.steps_completed)
                .where(Metric.trial_id == t.id)
                .where(Metric.group == "training")
                .where(Metric.archived.is_(False))
            )
        )
        assert t.state == "COMPLETED" and t.restarts == 1
        assert [c.steps_completed for c in cks] == [5, 10]  # the failed step-10 save of run 1 is not there
        first = cks[0]
    assert steps == list(range(1, 13))  # resumed at 5: every step exactly once
    blob = (tiny_fs / first.uuid / "blob").read_bytes()
    code, out, _ = det("t", "logs", str(t.id))
    # Run 2 resumed from the step-5 checkpoint, byte for byte what run 1 wrote.
    assert f"resumed from {first.uuid} at step 5 sha={hashlib.sha256(blob).hexdigest()}" in out
    assert "No space left on device" in out
    assert not [p for p in tiny_fs.iterdir() if p.name.endswith(".partial")]  # no half checkpoint fills the disk
