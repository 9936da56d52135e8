"""Preemption (docs/design/preemption.md) on two nodes x two ranks (torch_distributed with DDP, and the Core API under the
torch_distributed launcher): every way Slurm stops a multi-node trial ends with its checkpoint
written and acknowledged, the job gone within KillWait, and the next run resuming from it with
no step lost or repeated.

The hazard these tests guard: srun turns a SIGTERM it receives into SIGKILL for its whole step
("srun: forcing job termination"); templates/trial.sbatch.j2 keeps srun out of the batch step's
signals, and these tests fail if a rank is SIGKILLed before it checkpoints."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from helpers import store, wait_for
from sqlalchemy import select
from test_slurm_cluster import FIXTURES, squeue_ids, steps, trials

from detslurm.protocol import exit_record_of
from detslurm.store import TrialRun

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.heavy, pytest.mark.usefixtures("slurm_env")]
TOTAL_STEPS = 60
FIXTURE = {"ddp": "ddp_preempt.py", "core": "core_dist_preempt.py"}


def start_two_by_two(
    det: Any,
    ctx: Path,
    kind: str,
    total: int = TOTAL_STEPS,
    launcher: str = "torch_distributed",
    step_s: float = 0.1,
    extra: str = "",
) -> None:
    """A trial of 4 slots: two nodes (c1, c2) with two ranks each, ``total`` steps long, started
    by ``determined.launch.<launcher>`` (the Core API fixture runs under any of them and takes
    ``step_s`` per step: it looks for a preemption every 5 steps). ``extra``: more config lines."""
    write(ctx / FIXTURE[kind], (FIXTURES / FIXTURE[kind]).read_text())
    cfg = write(
        ctx.parent / f"{kind}.yaml",
        f"entrypoint: python3 -m determined.launch.{launcher} python3 {FIXTURE[kind]}\n"
        "searcher: {name: single, metric: loss}\nresources: {slots_per_trial: 4}\nmax_restarts: 0\n"
        f"environment: {{environment_variables: [FIXTURE_TOTAL_STEPS={total}, FIXTURE_STEP_S={step_s}]}}\n{extra}",
    )
    code, out, err = det("e", "create", cfg, ctx)
    assert code == 0, out + err


def runs(trial_id: int) -> list[TrialRun]:
    with store().tx() as s:
        return list(s.scalars(select(TrialRun).where(TrialRun.trial_id == trial_id).order_by(TrialRun.run_id)))


def ended_on_its_own(job: str, trial_id: int) -> None:
    """The stopped job leaves the queue, and it ended by itself: its batch shell recorded exit
    code 0. A trial still checkpointing at KillWait is SIGKILLed, and the launcher's code (or the
    killed batch shell's missing record) shows it. The test's own clock is no judge of that: on a
    loaded 2-core machine squeue dropped a job that had exited in time only after 20 s."""
    wait_for(lambda: job not in squeue_ids(), 180)
    (run,) = [r for r in runs(trial_id) if str(r.job_id) == job]
    record = exit_record_of(Path(run.run_dir))
    # A requeued job is back in the queue (and cancelled by the daemon) while its stopped start
    # still winds down: the record may come a little after.
    deadline = time.monotonic() + 60
    while not record.exists():
        assert time.monotonic() < deadline, f"job {job} left no exit record: its batch shell was killed"
        time.sleep(0.2)
    assert json.loads(record.read_text())["code"] == 0, record.read_text()


def running_job(exp: int, after_run: int = 0) -> str:
    """The job of the trial's newest run once it runs and has checkpointed past where it began."""
    wait_for(lambda: bool(trials(exp)), 300)
    tid = trials(exp)[0].id
    # Guards, not timings: a 2 x 2 DDP start on a loaded 2-core machine took over 2 min.
    wait_for(lambda: len(runs(tid)) > after_run and runs(tid)[-1].job_id in squeue_ids(), 600)
    start = trials(exp)[0].steps_completed
    wait_for(lambda: trials(exp)[0].latest_checkpoint is not None and trials(exp)[0].steps_completed > start + 5, 600)
    return str(runs(tid)[-1].job_id)


def signal_job(args: list[str], job: str) -> bool:
    """``scancel ARGS JOB``; False when the job had already ended: the trial finished its work
    between the test's look at the queue and the signal (a race of the test, not a stop)."""
    res = subprocess.run(["scancel", *args, job], capture_output=True, text=True)
    if res.returncode == 0:
        return True
    if "already completing or completed" in res.stderr or "Invalid job id" in res.stderr:
        return False
    raise AssertionError(f"scancel {' '.join(args)} {job}: {res.stderr.strip()}")


def preempt_by_high(job: str) -> bool:
    subprocess.run(
        ["sbatch", "-p", "high", "-N2", "-w", "c1,c2", "-c", "2", "-o", "/dev/null", "--wrap", "sleep 1"],
        check=True,
        capture_output=True,
    )
    return True


def warning_signal(job: str) -> bool:
    # What --signal=B:USR2@lead delivers before the time limit: the batch shell only.
    return signal_job(["--signal=USR2", "--batch"], job)


def scancel_term(job: str) -> bool:
    return signal_job(["--signal=TERM"], job)


def scancel_full_term(job: str) -> bool:
    # --full also signals the batch step, where srun runs: the case srun used to turn into SIGKILL.
    return signal_job(["--full", "--signal=TERM"], job)


def scontrol_requeue(job: str) -> bool:
    """An admin's requeue: Slurm stops the job (SIGTERM, SIGKILL after KillWait) and queues it
    again; the daemon cancels it and resubmits the trial. False when the job is no longer
    running: Slurm requeues even a job that has completed, so that is looked at first."""
    state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout
    if state.strip() != "RUNNING":
        return False
    res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if res.returncode == 0:
        return True
    if "Invalid job id" in res.stderr or "completed" in res.stderr:
        return False
    raise AssertionError(f"scontrol requeue {job}: {res.stderr.strip()}")


STOPS: dict[str, Callable[[str], bool]] = {
    "high-partition": preempt_by_high,
    "warning-signal": warning_signal,
    "scancel-term": scancel_term,
    "scancel-full-term": scancel_full_term,
    "scontrol-requeue": scontrol_requeue,
}


def stop_and_check(det: Any, exp: int, how: str, after_run: int = 0) -> bool:
    """Stop the trial's running job ``how``; the job must end by itself (within KillWait), acknowledged.
    False when the job had ended before the signal (nothing to check)."""
    job = running_job(exp, after_run)
    if not STOPS[how](job):
        return False
    tid = trials(exp)[0].id
    # Not ended_on_its_own: on several nodes Slurm may SIGKILL the batch shell at KillWait after
    # the ranks checkpointed and acknowledged (no exit record then); the acknowledgement below and
    # finish_and_check's "nothing lost" are what a stop must keep.
    wait_for(lambda: job not in squeue_ids(), 180)
    wait_for(lambda: len(runs(tid)) > after_run and runs(tid)[after_run].end_time is not None, 120)
    run = runs(tid)[after_run]
    assert run.preempt_acked, (how, run.exit_reason)
    return True


def finish_and_check(det: Any, exp: int, total: int = TOTAL_STEPS) -> None:
    code, out, err = det("e", "wait", str(exp))
    assert code == 0, out + err
    (t,) = trials(exp)
    # Stopped by Slurm is not the trial's failure: no restart charged (max_restarts is 0).
    assert t.state == "COMPLETED" and t.run_count >= 2 and t.restarts == 0
    assert [s for s, _ in steps(t.id)] == list(range(1, total + 1))
    assert all(r.preempt_acked for r in runs(t.id)[:-1])
    code, out, _ = det("t", "logs", str(t.id))
    saw = {line.split("]")[0] for line in out.splitlines() if "saw the preemption" in line}
    assert {f"[rank={r}" for r in range(4)} <= saw  # every rank of the first run stopped cleanly


# Every way of stopping, for the Core API trial and DDP (the same launcher path with torch's
# start-up on top), in the whole suite. CI's run (marker `full` for the rest, minutes each on a
# loaded 2-core machine) keeps the ways whose signal reaches two nodes' steps by another path:
# the batch shell only (warning signal), the steps only (scancel), both (scancel --full); the
# high partition for DDP (and for the Core API with GraceTime, below). scontrol requeue stops a
# job as scancel --full does; one node's requeue runs in CI (test_preemption_cluster).
IN_CI = {("ddp", "high-partition"), ("core", "warning-signal"), ("core", "scancel-term"), ("core", "scancel-full-term")}


@pytest.mark.parametrize(
    "kind,how",
    [
        pytest.param(kind, how, marks=() if (kind, how) in IN_CI else pytest.mark.full)
        for how in sorted(STOPS)
        for kind in ("ddp", "core")
    ],
)
def test_two_by_two_stops_checkpoint_and_resume(det: Any, tmp_path: Path, kind: str, how: str) -> None:
    start_two_by_two(det, tmp_path / "ctx", kind)
    stop_and_check(det, 1, how)
    finish_and_check(det, 1)


def test_preemption_with_grace_time_signals_the_ranks_only(det: Any, tmp_path: Path) -> None:
    """With a partition GraceTime, Slurm signals the job's steps at the start of the grace time
    (not the batch shell, nor srun): the ranks stop within it, and the measured stop time fits
    the budget the partition's GraceTime + KillWait gives, so describe warns about nothing."""
    subprocess.run(["scontrol", "update", "PartitionName=cpu", "GraceTime=10"], check=True, capture_output=True)
    try:
        start_two_by_two(det, tmp_path / "ctx", "core")
        stop_and_check(det, 1, "high-partition")
        finish_and_check(det, 1)
    finally:
        subprocess.run(["scontrol", "update", "PartitionName=cpu", "GraceTime=0"], check=True, capture_output=True)
    (t,) = trials(1)
    first = runs(t.id)[0]
    assert first.preempt_stop_s is not None and first.preempt_stop_s < 15
    signals = Path(first.run_dir) / "signals"
    # The batch shell, and so srun, got no SIGTERM at all: only the ranks' own steps did.
    assert not signals.exists() or "TERM" not in signals.read_text()
    code, _, err = det("e", "describe", "1")
    assert code == 0 and "warning:" not in err
