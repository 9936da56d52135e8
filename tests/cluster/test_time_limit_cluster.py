"""Preemption (docs/design/preemption.md): a trial whose job really reaches its Slurm time limit (``--time=2`` through
``slurm.sbatch_args``), not a warning signal sent by hand. Slurm's own warning signal (the
site's ``signal_lead_s`` before the limit), or where the site gives no lead the SIGTERM at the
limit, must end in an acknowledged checkpoint, the job gone within KillWait of the limit, and
the trial resubmitted until it finishes with no step lost or repeated and no restart charged.

Slurm checks time limits (and sends ``--signal`` warnings) every 30 s, so a 2-minute job ends
120-150 s after it starts, and a warning may come up to 60 s before its lead (sbatch(1),
--signal). With a 1-minute limit and a 30 s lead the warning could land in the job's first
second, before the launcher had installed its handler: the limit is 2 minutes so that the
warning comes at least 30 s in. Each case takes a few minutes."""

from __future__ import annotations

import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, write
from helpers import wait_for
from test_preemption_multinode import finish_and_check, runs, start_two_by_two
from test_slurm_cluster import CORE, squeue_ids, steps, trials

from detslurm.store import TrialRun

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
KILL_WAIT_S = 15  # scripts/test-cluster's KillWait
LIMIT_S = 120  # --time=2
CHECK_S = 30  # slurmctld's periodic time-limit check: the limit is enforced up to this late
# 300 batches take 150 s, more than one job's time limit; the example checkpoints every 5 (2.5 s),
# well inside KillWait, which is all the time a trial has after the SIGTERM at the limit.
BATCHES = 300
BATCH_S = 0.5


def use_lead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lead_s: int) -> None:
    """The test cluster's site config with the warning ``lead_s`` before the time limit."""
    text = (ROOT / "site-configs/test-cluster.yaml").read_text()
    assert "signal_lead_s: 60" in text
    site = write(tmp_path / "site.yaml", text.replace("signal_lead_s: 60", f"signal_lead_s: {lead_s}"))
    monkeypatch.setenv("DETSLURM_SITE_CONFIG", str(site))


def start_time(job: str) -> float:
    """When the job started running (squeue's %S, the controller's local time)."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%S"], capture_output=True, text=True, check=True)
    return datetime.fromisoformat(out.stdout.strip()).timestamp()


# CI's run has the warning's case; the SIGTERM at the limit (a few minutes more) is in the whole
# suite: the trial's side of it is scancel's SIGTERM, which CI's run checks (test_preemption_cluster).
@pytest.mark.parametrize(
    "lead_s", [30, pytest.param(0, marks=pytest.mark.full)], ids=["warning-signal", "sigterm-at-limit"]
)
def test_real_time_limit_checkpoints_and_resumes(
    det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lead_s: int
) -> None:
    use_lead(tmp_path, monkeypatch, lead_s)
    code, _, err = det(
        "e",
        "create",
        CORE / "const.yaml",
        CORE,
        "--config",
        f"hyperparameters.sleep={BATCH_S}",
        "--config",
        "slurm.sbatch_args=[--nodelist=c1, --time=2]",
        "--config",
        f"environment.environment_variables=[EXAMPLE_TOTAL_BATCHES={BATCHES}]",
        "--config",
        "max_restarts=0",
    )
    assert code == 0, err
    first, signals = first_run_ends_by_the_limit()
    if lead_s:
        # Slurm's own warning reached the batch shell, and the trial stopped before the limit.
        assert signals[:1] == ["USR2"] and first.exit_code == 0
    else:
        # No warning: Slurm's SIGTERM at the limit; the job is Slurm's TIMEOUT.
        assert "TERM" in signals and first.exit_reason == "time limit"
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    (t,) = trials(1)
    assert t.state == "COMPLETED" and t.run_count >= 2 and t.restarts == 0
    assert [s for s, _ in steps(t.id)] == list(range(1, BATCHES + 1))  # nothing lost, nothing twice
    assert all(r.preempt_acked for r in runs(t.id)[:-1])


def first_run_ends_by_the_limit() -> tuple[TrialRun, list[str]]:
    """Experiment 1's first run, once its job has gone: within KillWait of the limit, with its
    checkpoint acknowledged; and the signals its batch shell recorded."""
    wait_for(lambda: bool(trials(1)) and bool(runs(trials(1)[0].id)), 300)
    tid = trials(1)[0].id
    wait_for(lambda: runs(tid)[0].job_id in squeue_ids() and _state(str(runs(tid)[0].job_id)) == "R", 300)
    job = str(runs(tid)[0].job_id)
    started = start_time(job)
    wait_for(lambda: job not in squeue_ids(), LIMIT_S + CHECK_S + KILL_WAIT_S + 30)
    # Gone within KillWait of the limit (plus the check's granularity and the epilog), never
    # left running to SIGKILL-less overtime.
    assert time.time() - started < LIMIT_S + CHECK_S + KILL_WAIT_S + 10
    wait_for(lambda: runs(tid)[0].end_time is not None, 120)
    first = runs(tid)[0]
    signals = (Path(first.run_dir) / "signals").read_text().split()
    assert first.preempt_acked, (first.exit_reason, first.exit_code, signals)
    return first, signals


@pytest.mark.torch
@pytest.mark.full  # minutes; CI's run has the real limit on one node and the warning signal on 2 x 2 nodes
def test_real_time_limit_on_two_nodes(det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 nodes x 2 ranks under torch_distributed: Slurm's warning reaches only the batch shell,
    which passes it to srun's step; every rank stops at the same checkpoint."""
    use_lead(tmp_path, monkeypatch, 30)
    extra = "slurm: {sbatch_args: [--time=2]}\n"
    start_two_by_two(det, tmp_path / "ctx", "core", total=160, step_s=0.5, extra=extra)
    first, signals = first_run_ends_by_the_limit()
    assert signals[:1] == ["USR2"] and first.exit_code == 0
    # What is tested ends here; the rest resumes. A 2 x 2 torch start took over a minute on CI's
    # loaded 2-core machine (2026-11-27: the second run reached its 1-minute limit before its
    # first checkpoint, which rightly spends a restart), so the next run gets time to finish.
    lift_time_limit(runs(first.trial_id), minutes=10)
    finish_and_check(det, 1, total=160)


def lift_time_limit(trial_runs: list[TrialRun], minutes: int) -> None:
    """The time limit of the job of the run after ``trial_runs``, once the daemon submitted it."""
    tid, n = trial_runs[0].trial_id, len(trial_runs)
    wait_for(lambda: len(runs(tid)) > n and runs(tid)[n].job_id is not None, 120)
    job = str(runs(tid)[n].job_id)
    subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"], check=True, capture_output=True)


def _state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%t"], capture_output=True, text=True)
    return out.stdout.strip()
