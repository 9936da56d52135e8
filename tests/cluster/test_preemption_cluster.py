"""Preemption (docs/design/preemption.md) on the real test cluster: every way Slurm stops a trial ends with its checkpoint
written and acknowledged, the job gone within KillWait, and the next run resuming from it."""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from helpers import store, wait_for
from sqlalchemy import select
from test_preemption_multinode import (
    STOPS,
    ended_on_its_own,
    finish_and_check,
    scontrol_requeue,
    signal_job,
    start_two_by_two,
    stop_and_check,
)
from test_slurm_cluster import CORE, FIXTURES, squeue_ids, steps, trials

from detslurm.protocol import exit_record_of
from detslurm.store import TrialRun

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]


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
    # Guards, not timings (a loaded 2-core machine starts jobs slowly).
    wait_for(lambda: len(_runs(trial_id)) > after_run and _runs(trial_id)[-1].job_id in squeue_ids(), 600)
    start = trials(exp)[0].steps_completed
    wait_for(lambda: trials(exp)[0].latest_checkpoint is not None and trials(exp)[0].steps_completed > start, 600)
    return str(_runs(trial_id)[-1].job_id)


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
    subprocess.run(["scancel", "--full", "--signal=TERM", job], check=True, capture_output=True)
    ended_on_its_own(job, 1)
    _assert_resumed_without_loss(det)


def _sbatch_high_on_c1(job: str) -> bool:
    subprocess.run(
        ["sbatch", "-p", "high", "-w", "c1", "-c", "2", "-o", "/dev/null", "--wrap", "sleep 1"],
        check=True,
        capture_output=True,
    )
    return True


def _scancel(*args: str) -> Callable[[str], bool]:
    def stop(job: str) -> bool:
        return signal_job(list(args), job)

    return stop


# Every way Slurm stops a one-node trial. (Plain `scancel --signal=TERM` signals only srun steps,
# and a one-node trial has none: it runs in the batch step, see templates/trial.sbatch.j2.)
ONE_NODE_STOPS: dict[str, Callable[[str], bool]] = {
    "high-partition": _sbatch_high_on_c1,
    "warning-signal": _scancel("--signal=USR2", "--batch"),  # what --signal=B:USR2@lead sends
    "scancel-full-term": _scancel("--full", "--signal=TERM"),
    "scancel-batch-term": _scancel("--batch", "--signal=TERM"),  # the batch shell relays it
    "scontrol-requeue": scontrol_requeue,
}


def _preempt_until_done(det: Any, exp: int, hows: Iterator[str] | None = None) -> int:
    """Stop experiment ``exp``'s one trial (each time the next way from ``hows``; by default by
    the high partition) while it has work left."""
    _start(det)
    trial_id = trials(exp)[0].id
    done = 0
    while trials(exp)[0].steps_completed < 30:  # nearer the end the run may finish first
        job = _running_job(trial_id, done, exp)
        if not ONE_NODE_STOPS[next(hows) if hows else "high-partition"](job):
            continue  # the run finished its work just before the signal: the loop looks again
        ended_on_its_own(job, trial_id)
        done += 1
    _assert_resumed_without_loss(det, exp)
    runs = [(r.run_id, r.job_id, r.preempt_acked, r.exit_reason) for r in _runs(trial_id)]
    # Every run but the last was stopped by Slurm and acknowledged first; the last one may have
    # finished the trial just before its preemption landed.
    assert all(acked for _, _, acked, _ in runs[:-1]), (done, runs)
    return done


MULTI_TOTAL = 90  # steps of each two-node trial in the stress test (0.1 s each)


def _two_by_two_until_done(det: Any, exp: int, kind: str, ctx: Path, hows: Iterator[str]) -> int:
    start_two_by_two(det, ctx, kind, MULTI_TOTAL)
    done = 0
    wait_for(lambda: bool(trials(exp)), 300)
    while trials(exp)[0].steps_completed < MULTI_TOTAL - 25:
        if stop_and_check(det, exp, next(hows), after_run=done):
            done += 1
    finish_and_check(det, exp, MULTI_TOTAL)
    return done


@pytest.mark.fault
@pytest.mark.torch
@pytest.mark.full  # each way of stopping runs once in CI's run (above); this repeats them for minutes
def test_repeated_preemption_stress(det: Any, tmp_path: Path) -> None:
    """DETSLURM_STRESS_PREEMPTIONS (default 30) consecutive stops, every way Slurm stops a trial
    (high-partition preemption, the time limit's warning signal, scancel --signal=TERM with and
    without --full/--batch), over two-node x two-rank trials (torch DDP and the Core API) and as
    many one-node trials as it takes: no hang (each job gone within KillWait), no lost or
    repeated step, no restart charged."""
    n = int(os.environ.get("DETSLURM_STRESS_PREEMPTIONS", "30"))
    started = time.monotonic()
    multi_hows, one_hows = itertools.cycle(sorted(STOPS)), itertools.cycle(sorted(ONE_NODE_STOPS))
    done, exp, multi = 0, 0, 0
    for kind in ("ddp", "core"):
        exp += 1
        multi += _two_by_two_until_done(det, exp, kind, tmp_path / f"ctx-{kind}", multi_hows)
    done = multi
    while done < n:
        exp += 1
        done += _preempt_until_done(det, exp, one_hows)
    print(f"{done} stops ({multi} of two-node trials) over {exp} trials in {time.monotonic() - started:.0f} s")


def test_scontrol_requeue_checkpoints_and_resumes(det: Any) -> None:
    """An admin's `scontrol requeue` is a stop like a preemption: the trial checkpoints and
    acknowledges, the requeued job is cancelled by the daemon (before Slurm's start of it runs
    anything) and the trial resumes from its checkpoint as a new run, with
    a new job; the stopped start's exit record and signals file are as it left them."""
    _start(det)
    job = _running_job(trials(1)[0].id)
    assert scontrol_requeue(job)
    ended_on_its_own(job, trials(1)[0].id)
    first = _assert_resumed_without_loss(det)
    assert first.job_id == job and first.exit_reason == "preempted" and first.exit_code == 0
    assert job not in {r.job_id for r in _runs(first.trial_id)[1:]}  # resumed by a fresh submission
    run_dir = Path(first.run_dir)
    assert (run_dir / "signals").read_text() == "TERM\n"
    assert f'"code": 0, "source": "batch", "job": "{job}"' in exit_record_of(run_dir).read_text()
    # Slurm's start of the requeued job (if the daemon's scancel came after it) ran nothing.
    state = subprocess.run(
        ["squeue", "-h", "--states=all", "-j", job, "-O", "State,RestartCnt"], text=True, capture_output=True
    ).stdout.split()
    assert state[:1] in ([], ["CANCELLED"], ["COMPLETED"]) and state[1:] in ([], ["1"]), state


def test_slow_stop_is_measured_and_describe_warns(det: Any, tmp_path: Path) -> None:
    """Stop time: the trial's time from the signal to its checkpoint is measured, and
    `det e describe` / `det t describe` warn when it is over the site's budget (here KillWait 15 s,
    no GraceTime). The warning signal is used because Slurm itself then kills nothing."""
    write(tmp_path / "ctx/slow_stop.py", (FIXTURES / "slow_stop.py").read_text())
    cfg = write(tmp_path / "c.yaml", "entrypoint: python3 slow_stop.py\nsearcher: {name: single, metric: loss}\n")
    assert det("e", "create", cfg, tmp_path / "ctx", "--config", "slurm.sbatch_args=[--nodelist=c1]")[0] == 0
    job = _running_job(trials(1)[0].id)
    subprocess.run(["scancel", "--signal=USR2", "--batch", job], check=True, capture_output=True)
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    (t,) = trials(1)
    first = _runs(t.id)[0]
    assert first.preempt_acked and first.preempt_stop_s is not None and 18 <= first.preempt_stop_s < 45
    assert [s for s, _ in steps(t.id)] == list(range(1, 31)) and t.restarts == 0
    for cmd in (("e", "describe", "1"), ("t", "describe", str(t.id))):
        code, out, err = det(*cmd)
        assert code == 0
        assert f"warning: trial {t.id} run 1 took {first.preempt_stop_s:.1f} s" in err, err
        assert "more than the 15 s the site allows" in err and "KillWait 15" in err
    # A run that stopped within the budget, or was not stopped by a signal, gets no line.
    assert f"run {_runs(t.id)[-1].run_id} took" not in err
