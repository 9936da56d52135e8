"""Job arrays on the real cluster: trials that share resources go in one sbatch, and each
trial keeps its own identity, log, restarts and queue operations on its array task id."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from sqlalchemy import select

from detslurm import settings
from detslurm.store import Metric, Trial, TrialRun, open_store

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
FIXTURES = Path(__file__).parents[1] / "fixtures"


def grid(tmp_path: Path, count: int, **extra: Any) -> tuple[Path, Path]:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "array_trial.py").write_text((FIXTURES / "array_trial.py").read_text())
    hp = "\n".join(f"  {k}: {v}" for k, v in extra.pop("hparams", {}).items())
    lines = "\n".join(f"{k}: {v}" for k, v in extra.items())
    cfg = write(
        tmp_path / "grid.yaml",
        f"""
name: array-grid
entrypoint: python3 array_trial.py
hyperparameters:
  x: {{type: int, minval: 0, maxval: {count - 1}, count: {count}}}
{hp}
searcher: {{name: grid, metric: validation_loss, max_length: {{batches: 3}}, max_concurrent_trials: {count}}}
{lines}
""",
    )
    return cfg, ctx


def sbatch_shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An sbatch on PATH that logs each submission (its argv) and runs the real one. The
    create's one ``sbatch --test-only`` (it queues nothing) is not logged."""
    real = subprocess.run(["which", "sbatch"], capture_output=True, text=True, check=True).stdout.strip()
    bindir, log = tmp_path / "shim", tmp_path / "sbatch-calls.log"
    logged = f'[ "$1" = --test-only ] || echo "$*" >> {shlex.quote(str(log))}'
    write(bindir / "sbatch", f'#!/bin/bash\n{logged}\nexec {shlex.quote(real)} "$@"\n').chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return log


def runs(exp_id: int) -> list[tuple[Trial, list[TrialRun]]]:
    with open_store(settings.load().db_url).tx() as s:
        ts = list(s.scalars(select(Trial).where(Trial.experiment_id == exp_id).order_by(Trial.id)))
        return [(t, sorted(t.runs, key=lambda r: r.run_id)) for t in ts]


@pytest.mark.slurm24_smoke
def test_grid_goes_as_one_array_and_trials_keep_their_identity(
    det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = sbatch_shim(tmp_path, monkeypatch)
    cfg, ctx = grid(tmp_path, 6, hparams={"fail": 2}, max_restarts=1)
    code, out, err = det("e", "create", cfg, ctx)
    assert code == 0, err
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    lines = calls.read_text().splitlines()
    # One sbatch for the six trials; the trial whose first run failed restarts alone.
    assert len(lines) == 2 and "--array=0-5" in lines[0] and "--array" not in lines[1], lines
    got = runs(1)
    base = got[0][0].id
    array_id = got[0][1][0].job_id.split("_")[0]
    with open_store(settings.load().db_url).tx() as s:
        for t, rs in got:
            assert t.state == "COMPLETED"
            assert rs[0].job_id == f"{array_id}_{t.id - base}"
            log = Path(rs[0].log_path).read_text()  # Slurm wrote each task's log to its own run dir
            assert f"array-trial trial={t.id} x={t.hparams['x']} task={rs[0].job_id}" in log
            vals = list(
                s.scalars(
                    select(Metric.steps_completed)
                    .where(Metric.trial_id == t.id)
                    .where(Metric.group == "validation")
                    .where(Metric.archived.is_(False))
                )
            )
            assert vals == [3]
            if t.hparams["x"] == 2:
                assert len(rs) == 2 and rs[0].exit_code == 3 and "_" not in str(rs[1].job_id) and t.restarts == 1
            else:
                assert len(rs) == 1


def squeue_task(job_id: str) -> tuple[str, str]:
    out = subprocess.run(["squeue", "-h", "-r", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True).stdout
    state, _, reason = out.strip().partition("|")
    return state, reason


def test_queue_operations_on_array_tasks(det: Any, tmp_path: Path) -> None:
    cfg, ctx = grid(tmp_path, 4, hparams={"sleep": 1.5}, resources="{max_slots: 1}")
    code, out, err = det("e", "create", cfg, ctx)
    assert code == 0, err
    deadline = time.time() + 60
    while time.time() < deadline and not all(rs and rs[0].job_id for _, rs in runs(1)):
        time.sleep(0.2)
    got = runs(1)
    jobs = [rs[0].job_id for _, rs in got]
    assert all(j and "_" in j for j in jobs) and len({j.split("_")[0] for j in jobs}) == 1
    held, killed = got[3], got[2]
    code, out, err = det("job", "list")
    assert code == 0 and f"array-grid (1) trial {held[0].id}" in out, out + err
    # Queue operations name one task: only that trial is touched.
    code, _, err = det("job", "update", held[1][0].job_id, "--hold")
    assert code == 0, err
    code, _, err = det("job", "update", held[1][0].job_id, "--priority", "60")
    assert code == 0, err
    state, reason = squeue_task(held[1][0].job_id)  # root's holds are admin holds
    assert state == "PENDING" and reason in ("JobHeldUser", "JobHeldAdmin")
    nice = subprocess.run(["squeue", "-h", "-r", "-j", held[1][0].job_id, "-o", "%y"], capture_output=True, text=True)
    assert int(nice.stdout) > 0  # the lower priority reached this task
    code, _, err = det("trial", "kill", str(killed[0].id))
    assert code == 0, err
    deadline = time.time() + 60
    while time.time() < deadline and {t.id: t.state for t, _ in runs(1)}.get(killed[0].id) != "CANCELED":
        time.sleep(0.2)
    states = {t.id: t.state for t, _ in runs(1)}
    assert states[killed[0].id] == "CANCELED" and states[held[0].id] == "ACTIVE"
    code, _, err = det("job", "update", held[1][0].job_id, "--release")
    assert code == 0, err
    code, out, err = det("e", "wait", "1")
    final = {t.id: (t.state, len(rs)) for t, rs in runs(1)}
    assert final == {
        got[0][0].id: ("COMPLETED", 1),
        got[1][0].id: ("COMPLETED", 1),
        killed[0].id: ("CANCELED", 1),
        held[0].id: ("COMPLETED", 1),
    }, out + err


def test_crash_after_array_sbatch_adopts_every_task(det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A controller killed after an array's sbatch, before any job id was recorded: the next
    one finds each trial's task by the array's comment and submits nothing again."""
    from detslurm import daemon
    from detslurm.controller import ops

    calls = sbatch_shim(tmp_path, monkeypatch)
    cfg, ctx = grid(tmp_path, 3)
    code, _, err = det("e", "create", "--paused", cfg, ctx)
    assert code == 0, err
    ops.activate(open_store(settings.load().db_url), 1)
    ctl = daemon.make_controller(settings.load())
    real = ctl.executor.execute  # type: ignore[attr-defined]

    def crash_after_sbatch(sub: Any) -> str:
        real(sub)
        raise KeyboardInterrupt("the controller dies right after sbatch")

    ctl.executor.execute = crash_after_sbatch  # type: ignore[attr-defined]
    with pytest.raises(KeyboardInterrupt):
        ctl.tick()
    assert all(rs[0].job_id is None for _, rs in runs(1))  # the crash lost every job id
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    got = runs(1)
    assert len(calls.read_text().splitlines()) == 1  # submitted exactly once
    assert all(t.state == "COMPLETED" and len(rs) == 1 and "_" in str(rs[0].job_id) for t, rs in got)
