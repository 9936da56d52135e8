"""Issue 16 on the real test cluster: every way Slurm stops a trial ends with its checkpoint
written and acknowledged, the job gone within KillWait, and the next run resuming from it."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest
from sqlalchemy import select
from test_slurm_cluster import CORE, squeue_ids, steps, store, trials, wait_for

from detslurm.store import TrialRun

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
KILL_WAIT_S = 5  # scripts/test-cluster's KillWait


def _runs(trial_id: int) -> list[TrialRun]:
    with store().tx() as s:
        return list(s.scalars(select(TrialRun).where(TrialRun.trial_id == trial_id).order_by(TrialRun.run_id)))


def _start(det: Any, sleep: float = 0.2) -> None:
    code, _, err = det(
        "e",
        "create",
        CORE / "const.yaml",
        CORE,
        "--config",
        f"hyperparameters.sleep={sleep}",
        "--config",
        "slurm.sbatch_args=[--nodelist=c1]",
    )
    assert code == 0, err


def _running_job(trial_id: int, after_run: int = 0, exp: int = 1) -> str:
    """The Slurm job of the trial's newest run once it is running and has a checkpoint."""
    wait_for(lambda: len(_runs(trial_id)) > after_run and _runs(trial_id)[-1].job_id in squeue_ids())
    start = trials(exp)[0].steps_completed
    wait_for(lambda: trials(exp)[0].latest_checkpoint is not None and trials(exp)[0].steps_completed > start)
    return str(_runs(trial_id)[-1].job_id)


def _gone_within_kill_wait(job: str, since: float) -> None:
    wait_for(lambda: job not in squeue_ids(), KILL_WAIT_S + 10)
    # Squeue only drops the job after the epilog; the margin covers that, not a SIGKILL.
    assert time.monotonic() - since < KILL_WAIT_S + 10


def _assert_resumed_without_loss(det: Any, exp: int = 1) -> TrialRun:
    code, out, err = det("e", "wait", str(exp))
    assert code == 0, out + err
    (t,) = trials(exp)
    assert t.run_count >= 2 and t.restarts == 0  # stopping by Slurm is not the trial's failure
    assert [s for s, _ in steps(t.id)] == list(range(1, 41))  # nothing lost, nothing counted twice
    first = _runs(t.id)[0]
    assert first.preempt_acked  # the trial saw the signal, checkpointed and acknowledged
    return first


def test_scancel_signal_term_checkpoints_and_resumes(det: Any) -> None:
    _start(det)
    job = _running_job(1)
    # --full: without it scancel signals only the job's srun steps, and a one-node trial runs in
    # the batch step itself (see templates/trial.sbatch.j2).
    t0 = time.monotonic()
    subprocess.run(["scancel", "--full", "--signal=TERM", job], check=True, capture_output=True)
    _gone_within_kill_wait(job, t0)
    _assert_resumed_without_loss(det)


def _preempt_until_done(det: Any, exp: int) -> int:
    """Preempt experiment ``exp``'s one trial by the high partition while it has work left."""
    _start(det)
    trial_id = trials(exp)[0].id
    done = 0
    while trials(exp)[0].steps_completed < 30:  # nearer the end the run may finish first
        job = _running_job(trial_id, done, exp)
        t0 = time.monotonic()
        subprocess.run(
            ["sbatch", "-p", "high", "-w", "c1", "-c", "2", "-o", "/dev/null", "--wrap", "sleep 1"],
            check=True,
            capture_output=True,
        )
        _gone_within_kill_wait(job, t0)
        done += 1
    _assert_resumed_without_loss(det, exp)
    runs = [(r.run_id, r.job_id, r.preempt_acked, r.exit_reason) for r in _runs(trial_id)]
    # Every run but the last was stopped by Slurm and acknowledged first; the last one may have
    # finished the trial just before its preemption landed.
    assert all(acked for _, _, acked, _ in runs[:-1]), (done, runs)
    return done


@pytest.mark.fault
def test_repeated_preemption_stress(det: Any) -> None:
    """DETSLURM_STRESS_PREEMPTIONS (default 30) preemptions by the high partition, over as many
    one-node trials as it takes: no hang (each job gone within KillWait), no lost or repeated
    step, no restart charged."""
    n = int(os.environ.get("DETSLURM_STRESS_PREEMPTIONS", "30"))
    started = time.monotonic()
    done, exp = 0, 0
    while done < n:
        exp += 1
        done += _preempt_until_done(det, exp)
    print(f"{done} preemptions over {exp} trials in {time.monotonic() - started:.0f} s")
