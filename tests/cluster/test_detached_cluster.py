"""Detached mode on the real cluster: sbatch scripts written as a user would write them, using
core_v2, are recorded by detslurm (det e list/describe, det checkpoint list, det t logs)."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conftest import Det, write
from sqlalchemy import select

from detslurm import settings
from detslurm.store import Checkpoint, Experiment, Metric, Trial, open_store

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
FIXTURES = Path(__file__).parents[1] / "fixtures"
T = TypeVar("T")


def sbatch(tmp_path: Path, name: str, body: str, *args: str) -> str:
    """Submit a batch script the way a user does (their own #SBATCH lines); the job id."""
    script = write(
        tmp_path / f"{name}.sbatch", f"#!/bin/bash\n#SBATCH -J {name}\n#SBATCH -o {tmp_path}/{name}-%j.out\n{body}"
    )
    out = subprocess.run(["sbatch", "--parsable", *args, str(script)], capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


def py(script: str) -> str:
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(FIXTURES / script))}"


def until(det: Det, check: Callable[[], T | None], timeout: float = 90, what: str = "") -> T:
    """Run `det e list` (one reconcile step, as a user's read does) until ``check`` holds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        code, _, err = det("e", "list")
        assert code == 0, err
        result = check()
        if result is not None:
            return result
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def experiments(name: str) -> list[dict[str, Any]]:
    with open_store(settings.load().db_url).read() as s:
        out = []
        for e in s.scalars(select(Experiment).where(Experiment.name == name)):
            trials = sorted(e.trials, key=lambda t: t.id)
            out.append(
                {
                    "id": e.id,
                    "state": e.state.value,
                    "executor": e.executor,
                    "trials": [(t.state.value, t.steps_completed, [r.run_id for r in t.runs]) for t in trials],
                    "trial_ids": [t.id for t in trials],
                }
            )
        return out


def ended(name: str, trials: int = 1) -> list[dict[str, Any]] | None:
    """The one experiment of this name once it has ``trials`` trials and has ended (an array's
    experiment may end before its last task starts, and comes back to life when it does)."""
    exps = experiments(name)
    done = len(exps) == 1 and all(e["state"] in ("COMPLETED", "ERROR", "CANCELED") for e in exps)
    return exps if done and len(exps[0]["trials"]) == trials else None


def metric_rows(trial_id: int) -> list[tuple[str, int, dict[str, Any]]]:
    with open_store(settings.load().db_url).read() as s:
        q = select(Metric).where(Metric.trial_id == trial_id).order_by(Metric.id)
        return [(m.group, m.steps_completed, m.metrics) for m in s.scalars(q)]


def test_own_sbatch_script_is_recorded(tmp_path: Path, det: Det) -> None:
    job = sbatch(tmp_path, "plain", f"#SBATCH -n 1\nsrun {py('detached_train.py')}\n")
    (exp,) = until(det, lambda: ended("byo"), what="the plain script's experiment to end")
    assert exp["executor"] == "detached"
    assert exp["state"] == "COMPLETED", exp
    assert exp["trials"] == [("COMPLETED", 3, [1])]
    tid = exp["trial_ids"][0]
    assert [(g, n) for g, n, _ in metric_rows(tid)] == [
        ("training", 1),
        ("training", 2),
        ("training", 3),
        ("validation", 3),
    ]
    code, out, _ = det("checkpoint", "list", str(exp["id"]))
    assert code == 0 and out.count("COMPLETED") == 3
    code, out, _ = det("e", "describe", str(exp["id"]))
    assert code == 0 and "byo" in out
    # The job's own output file (its #SBATCH -o) is the trial's log.
    code, out, _ = det("t", "logs", str(tid))
    assert code == 0 and "starting at step 0" in out and "done" in out and f"Slurm job {job}" in out


def test_requeue_continues_from_latest_checkpoint(tmp_path: Path, det: Det) -> None:
    env = "export EXP_NAME=requeue STEPS=4 WAIT_AT=2\n"
    job = sbatch(tmp_path, "requeue", f"#SBATCH --requeue\n{env}srun {py('detached_train.py')}\n")
    out_file = tmp_path / f"requeue-{job}.out"
    until(det, lambda: "waiting after step 2" in _read(out_file) or None, what="the first run to checkpoint step 2")
    # While it runs, the queue view names the job after its detached experiment.
    code, out, _ = det("job", "list")
    assert code == 0 and "requeue" in out and "(detached)" in out
    subprocess.run(["scontrol", "requeue", job], check=True)
    (exp,) = until(det, lambda: ended("requeue") if _runs("requeue") == 2 else None, 120, "the requeued run to end")
    assert exp["state"] == "COMPLETED", exp
    # One trial (the same job id), two runs; the second resumed from step 2's checkpoint.
    assert exp["trials"] == [("COMPLETED", 4, [1, 2])]
    assert "starting at step 2" in _read(out_file)
    steps = [n for g, n, _ in metric_rows(exp["trial_ids"][0]) if g == "training"]
    assert steps == [1, 2, 3, 4]


def test_array_is_one_experiment_with_a_trial_per_task(tmp_path: Path, det: Det) -> None:
    sbatch(tmp_path, "array", f"#SBATCH --array=0-2\nexport EXP_NAME=array STEPS=2\nsrun {py('detached_train.py')}\n")
    (exp,) = until(det, lambda: ended("array", trials=3), what="the array's experiment to end")
    assert exp["state"] == "COMPLETED"
    assert exp["trials"] == [("COMPLETED", 2, [1])] * 3
    with open_store(settings.load().db_url).read() as s:
        hps = sorted(t.hparams["x"] for t in s.scalars(select(Trial).where(Trial.id.in_(exp["trial_ids"]))))
    assert hps == [0, 1, 2]


@pytest.mark.torch  # torchrun comes with torch
def test_two_node_torchrun_batch_script(tmp_path: Path, det: Det) -> None:
    run = (
        f"exec {shlex.quote(sys.executable)} -m torch.distributed.run --nnodes 2 --nproc-per-node 1 "
        '--node-rank "$SLURM_NODEID" --master-addr "$head" --master-port "$port" '
        f"{shlex.quote(str(FIXTURES / 'detached_torchrun.py'))}"
    )
    body = (
        "#SBATCH --nodes=2 --ntasks-per-node=1 -p cpu\n"
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
        "port=$((20000 + SLURM_JOB_ID % 20000))\n"
        f"export head port\nsrun bash -c {shlex.quote(run)}\n"
    )
    job = sbatch(tmp_path, "torchrun", body)
    (exp,) = until(det, lambda: ended("torchrun-2-node"), 150, "the torchrun job's experiment to end")
    log = _read(tmp_path / f"torchrun-{job}.out")
    assert exp["state"] == "COMPLETED", (exp, log)
    tid = exp["trial_ids"][0]
    # Both ranks reported; only the chief's reports were recorded (one row per step).
    rows = metric_rows(tid)
    assert [(g, n, m["rank"], m["world"], m["sum"]) for g, n, m in rows] == [
        ("training", 1, 0, 2, 3.0),
        ("training", 2, 0, 2, 3.0),
    ]
    with open_store(settings.load().db_url).read() as s:
        (ck,) = s.scalars(select(Checkpoint).where(Checkpoint.trial_id == tid))
        files = sorted(p.name for p in Path(ck.storage_path).iterdir())
    assert files == [".detslurm-checkpoint", "metadata.json", "rank0", "rank1"]  # with its run's mark
    assert "rank 1 on c2" in log or "rank 1 on c1" in log


def test_error_and_kill_end_in_error(tmp_path: Path, det: Det) -> None:
    sbatch(tmp_path, "fails", f"export EXP_NAME=fails FAIL=1\nsrun {py('detached_fail.py')}\n")
    hang = sbatch(tmp_path, "killed", f"export EXP_NAME=killed HANG=1\nsrun {py('detached_fail.py')}\n")
    out_file = tmp_path / f"killed-{hang}.out"
    until(det, lambda: "reported" in _read(out_file) or None, what="the hanging script to start")
    subprocess.run(["scancel", hang], check=True)
    (failed,) = until(det, lambda: ended("fails"), what="the failing script's experiment to end")
    (killed,) = until(det, lambda: ended("killed"), what="the killed script's experiment to end")
    assert failed["state"] == "ERROR" and killed["state"] == "ERROR"
    code, out, _ = det("t", "logs", str(failed["trial_ids"][0]))
    assert "RuntimeError: the model diverged" in out
    code, out, _ = det("t", "logs", str(killed["trial_ids"][0]))
    assert "ended without core_v2.close()" in out


def _runs(name: str) -> int:
    exps = experiments(name)
    return sum(len(t[2]) for e in exps for t in e["trials"])


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
