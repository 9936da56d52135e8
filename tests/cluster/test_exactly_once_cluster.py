"""Exactly-once submission on the real cluster: a reply of sbatch that
never comes back, a job id that cannot be noted in the run dir, and a disk that fills up under
the checkpoints each end with one Slurm job per run, no resubmission and no restart charged."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, write
from helpers import store
from sqlalchemy import select
from test_faults_local import FIXTURES, tiny_fs  # noqa: F401  (a fixture, used by name)
from test_faults_slurm import check_exactly_once, recording_sbatch
from test_slurm_arrays import grid

from detslurm import daemon, settings
from detslurm.controller import ops
from detslurm.controller.executor import ExitCause
from detslurm.protocol import ExpPaths
from detslurm.slurm.client import client_from_env
from detslurm.slurm.parse import experiment_tag
from detslurm.store import Experiment, Trial, TrialRun

pytestmark = [pytest.mark.slurm, pytest.mark.fault, pytest.mark.usefixtures("slurm_env")]
CORE = EXAMPLES / "core_api"
SLOW_S = 40  # sbatch's reply comes this late: far past the client's timeout below
TIMEOUT_S = 5


def slow_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The real sbatch, whose answer comes SLOW_S seconds after Slurm queued the job: what a
    busy slurmctld does. Records every job id Slurm accepted."""
    real = subprocess.run(["which", "sbatch"], capture_output=True, text=True, check=True).stdout.strip()
    log = tmp_path / "submitted"
    write(
        tmp_path / "slow/sbatch",
        f'#!/bin/bash\nout=$({shlex.quote(real)} "$@")\nrc=$?\n'
        f'[ $rc = 0 ] && echo "$out" >> {shlex.quote(str(log))}\nsleep {SLOW_S}\necho "$out"\nexit $rc\n',
    ).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'slow'}:{os.environ['PATH']}")
    return log


def jobs_by_comment(exp_id: int) -> dict[str, list[str]]:
    """Every job Slurm has (running or ended) for this experiment, by comment: found by the
    experiment dir's tag, so other tests' jobs on the shared cluster never count."""
    with store().tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        tag = experiment_tag(exp.exp_dir)
    out = subprocess.run(
        ["squeue", "-h", "-r", "--states=all", "-o", "%i %k"], capture_output=True, text=True, check=True
    ).stdout
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        job, _, comment = line.partition(" ")
        if comment.endswith(f",tag={tag}"):
            found.setdefault(comment, []).append(job)
    return found


def runs_of(exp_id: int) -> list[TrialRun]:
    with store().tx() as s:
        q = select(TrialRun).join(Trial).where(Trial.experiment_id == exp_id).order_by(TrialRun.trial_id)
        return list(s.scalars(q))


def test_sbatch_reply_lost_is_adopted_not_resubmitted(
    det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DETSLURM_SLURM_TIMEOUT_S", str(TIMEOUT_S))
    assert client_from_env().timeout_s == TIMEOUT_S
    cfg, ctx = grid(tmp_path, 3)
    assert det("e", "create", "--paused", cfg, ctx)[0] == 0  # exp 1: one array of 3 tasks
    assert det("e", "create", "--paused", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=0")[0] == 0
    submitted = slow_sbatch(tmp_path, monkeypatch)
    ops.activate(store(), 1)
    ops.activate(store(), 2)
    ctl = daemon.make_controller(settings.load())
    ctl.tick()  # both sbatch calls time out on our side; Slurm has queued both
    accepted = submitted.read_text().split()
    assert len(accepted) == 2
    for exp_id in (1, 2):
        for run in runs_of(exp_id):
            # Not forgotten, not failed: "submit unknown" until the queue has been read.
            assert (run.state, run.job_id) == ("PENDING", None)
            assert ExitCause.parse(run.exit_reason) is ExitCause.SUBMIT_UNKNOWN
    ctl.tick()  # reads the queue: each run adopts its job, found by identity and tag
    array, single = sorted(accepted)
    assert [r.job_id for r in runs_of(1)] == [f"{array}_{i}" for i in range(3)]
    assert [r.job_id for r in runs_of(2)] == [single]
    for exp_id in (1, 2):
        code, out, err = det("e", "wait", str(exp_id))
        assert code == 0, out + err
    assert sorted(submitted.read_text().split()) == [array, single]  # nothing was submitted again
    for exp_id, expect in ((1, 3), (2, 1)):
        ts = check_exactly_once(exp_id, submitted)
        assert len(ts) == expect and all(t.run_count == 1 for t in ts)
        per_comment = jobs_by_comment(exp_id)
        assert sum(len(j) for j in per_comment.values()) == expect, per_comment
        code, out, _ = det("t", "logs", str(ts[0].id))
        assert "submission not confirmed; looking for the job before retrying" in out


def test_job_id_marker_write_failing_keeps_the_job(det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = det("e", "create", "--paused", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=0")
    assert code == 0, err
    with store().tx() as s:
        (t,) = s.scalars(select(Trial)).all()
        run_paths = ExpPaths(Path(t.experiment.exp_dir)).run(t.id, 1)
    # The marker cannot be written: a directory holds its name (as a full quota would fail it).
    run_paths.job_id_marker.mkdir(parents=True)
    submitted = recording_sbatch(tmp_path, monkeypatch)
    ops.activate(store(), 1)
    ctl = daemon.make_controller(settings.load())
    ctl.tick()
    (job,) = submitted.read_text().split()
    (run,) = runs_of(1)
    assert (run.job_id, run.state, run.exit_reason) == (job, "QUEUED", None)
    # A controller that died before its store commit: the run has no job id and the marker is
    # unreadable. The next tick finds the job by its identity instead of submitting again.
    with store().tx() as s:
        r = s.get(TrialRun, run.id)
        assert r is not None
        r.job_id, r.state = None, "PENDING"
    ctl.tick()
    assert runs_of(1)[0].job_id == job
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    (t,) = check_exactly_once(1, submitted)
    assert t.run_count == 1 and len(jobs_by_comment(1)) == 1


def test_full_checkpoint_disk_on_slurm_submits_each_run_once(
    det: Any,
    tmp_path: Path,
    tiny_fs: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checkpoint storage fills up mid-save: run 1 fails, run 2 resumes from the last good
    checkpoint, and Slurm saw exactly one job per run."""
    submitted = recording_sbatch(tmp_path, monkeypatch)
    ctx = tmp_path / "ctx"
    write(ctx / "ckpt_fill.py", (FIXTURES / "ckpt_fill.py").read_text())
    cfg = write(
        tmp_path / "c.yaml",
        f"""
name: full-disk-slurm
entrypoint: python3 ckpt_fill.py
searcher: {{name: single, metric: validation_loss, max_length: {{batches: 12}}}}
checkpoint_storage: {{type: shared_fs, host_path: {tiny_fs}, save_trial_latest: 5}}
environment: {{environment_variables: [CKPT_BIG_BYTES=4000000]}}
max_restarts: 1
""",
    )
    code, out, err = det("e", "create", cfg, ctx)
    assert code == 0, out + err
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    with store().tx() as s:
        (trial,) = s.scalars(select(Trial)).all()
        assert trial.state == "COMPLETED" and trial.restarts == 1 and trial.run_count == 2
        jobs = sorted(r.job_id for r in trial.runs)
    assert sorted(submitted.read_text().split()) == jobs and len(set(jobs)) == 2
    assert sum(len(j) for j in jobs_by_comment(1).values()) == 2
    assert not [p for p in tiny_fs.iterdir() if p.name.endswith(".partial")]
