"""Detached mode without Slurm: core_v2 in plain processes, the records, and their ingest."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from detslurm import settings
from detslurm.controller.detached import DetachedIngest, StepResult
from detslurm.controller.executor import ExitCause, JobState, JobStatus, SchedulerUnavailable
from detslurm.core._detached import default_identity, env_rank, storage_base
from detslurm.identity import os_user
from detslurm.protocol import BadRecord, RunPaths, trial_env
from detslurm.protocol.detached import (
    DetachedError,
    DetachedLayout,
    DetachedRun,
    RunClosed,
    allocate_run,
    check_private_dir,
    detached_root,
    scan,
)
from detslurm.store import Experiment, Metric, TrialRun, open_store

FIXTURES = Path(__file__).parents[2] / "fixtures"


# -- pure logic ---------------------------------------------------------------------------------
def test_default_ids_follow_slurm() -> None:
    array = {"SLURM_CLUSTER_NAME": "hpc", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2", "SLURM_JOB_ID": "42"}
    assert default_identity(array, None, None).__dict__ == {"experiment": "hpc-40", "trial": "40_2", "job_id": "40_2"}
    plain = {"SLURM_JOB_ID": "7"}
    assert default_identity(plain, None, None).__dict__ == {"experiment": "slurm-7", "trial": "7", "job_id": "7"}
    # A named experiment run from several sbatch calls: one trial per job, so a requeue continues its own.
    assert default_identity(plain, "mnist", None).trial == "7"
    assert default_identity(plain, "mnist", "lr-0.1").__dict__ == {
        "experiment": "mnist",
        "trial": "lr-0.1",
        "job_id": "7",
    }
    # Outside Slurm: an unnamed run is a new experiment each time; a named one gets a new trial each time.
    a, b = default_identity({}, None, None), default_identity({}, None, None)
    assert a.experiment != b.experiment and a.job_id == ""
    assert default_identity({}, "mnist", None).trial != default_identity({}, "mnist", None).trial


def test_rank_prefers_torchrun_over_srun() -> None:
    # Under srun + torchrun, SLURM_PROCID numbers the nodes; RANK is the worker's own rank.
    assert env_rank({"RANK": "3", "SLURM_PROCID": "1"}) == 3
    assert env_rank({"SLURM_PROCID": "1"}) == 1
    assert env_rank({}) == 0


def test_checkpoint_storage_forms(tmp_path: Path) -> None:
    assert storage_base(None, tmp_path) == tmp_path
    assert storage_base("file:///data/ck", tmp_path) == Path("/data/ck")
    assert storage_base({"type": "shared_fs", "host_path": "/h", "storage_path": "s"}, tmp_path) == Path("/h/s")
    assert storage_base({"type": "directory", "container_path": "/c"}, tmp_path) == Path("/c")
    with pytest.raises(ValueError, match="not built for detached runs"):
        storage_base({"type": "s3", "bucket": "b"}, tmp_path)


@pytest.mark.parametrize(
    "record",
    [
        [],
        {"external_experiment_id": "e", "external_trial_id": "t", "name": "n"},  # no checkpoint_base
        {"external_experiment_id": "", "external_trial_id": "t", "name": "n", "checkpoint_base": "/c"},
        {"external_experiment_id": "x" * 300, "external_trial_id": "t", "name": "n", "checkpoint_base": "/c"},
        {"external_experiment_id": "e", "external_trial_id": "t", "name": "n", "checkpoint_base": "/c", "labels": "a"},
        {"external_experiment_id": "e\x00", "external_trial_id": "t", "name": "n", "checkpoint_base": "/c"},
        {"external_experiment_id": "e", "external_trial_id": "t", "name": "n", "checkpoint_base": "/c", "pid": -1},
    ],
)
def test_hostile_registration_is_refused(record: Any) -> None:
    with pytest.raises(BadRecord):
        DetachedRun.decode(record)


def test_layout_names_hide_the_ids(tmp_path: Path) -> None:
    layout = DetachedLayout.open(tmp_path / "detached")
    assert (tmp_path / "detached").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "detached" / ".key").stat().st_mode & 0o777 == 0o600
    exp = layout.exp_dir("slurm-123")
    assert "123" not in exp.name and exp.parent == layout.root
    # A path-shaped id stays a name under the root.
    assert layout.exp_dir("../../etc").parent == layout.root
    # The same key (another job opening the same root) gives the same names; another root does not.
    assert DetachedLayout.open(tmp_path / "detached").exp_dir("slurm-123") == exp
    assert DetachedLayout.open(tmp_path / "other").exp_dir("slurm-123").name != exp.name
    assert layout.trial_key("e", "1") != layout.trial_key("e", "2")


def test_root_open_to_others_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "detached"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with pytest.raises(DetachedError, match="open to other users"):
        check_private_dir(root)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(DetachedError, match="not a directory owned by you"):
        check_private_dir(link)


def test_runs_are_numbered_and_scanned(tmp_path: Path) -> None:
    layout = DetachedLayout.open(tmp_path / "d")
    exp = layout.exp_dir("e")
    first, second = allocate_run(exp, 5), allocate_run(exp, 5)
    assert (first.run_id, second.run_id) == (1, 2)
    DetachedRun("e", "t", "n", "/c").write(first)
    (exp / "trials" / "5" / "runs" / "junk").mkdir()  # not ours: skipped
    (layout.root / "notes").mkdir()
    assert list(scan(layout.root)) == [first]  # the second has no registration yet


# -- plain processes: core_v2 end to end ----------------------------------------------------------
def _run(det_env: Path, script: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DET_"))}
    full.update(env)
    return subprocess.run(
        [sys.executable, str(FIXTURES / script)], env=full, capture_output=True, text=True, timeout=timeout
    )


def _ingest(poll: Any = None) -> tuple[DetachedIngest, StepResult]:
    s = settings.load()
    ingest = DetachedIngest(open_store(s.db_url), detached_root(s.experiments_dir), os_user(), poll)
    return ingest, ingest.step()


def _experiments() -> list[tuple[str, str, list[tuple[str, int, int]]]]:
    with open_store(settings.load().db_url).read() as s:
        return [
            (e.name, e.state.value, [(t.state.value, t.steps_completed, len(t.runs)) for t in e.trials])
            for e in s.scalars(select(Experiment).order_by(Experiment.id))
        ]


def test_rerun_with_the_same_ids_continues_the_trial(det_env: Path) -> None:
    ids = {"EXP_NAME": "rerun", "SLURM_JOB_ID": "900"}
    first = _run(det_env, "detached_train.py", **ids, STEPS="2")
    assert first.returncode == 0, first.stderr
    _, result = _ingest()
    assert result.recorded == 1
    assert _experiments() == [("rerun", "COMPLETED", [("COMPLETED", 2, 1)])]
    # The same job id again (what a requeue or rerun looks like): the same trial, resumed at step 2.
    again = _run(det_env, "detached_train.py", **ids, STEPS="3")
    assert "starting at step 2" in again.stdout, again.stderr
    _ingest()
    assert _experiments() == [("rerun", "COMPLETED", [("COMPLETED", 3, 2)])]
    with open_store(settings.load().db_url).read() as s:
        steps = [m.steps_completed for m in s.scalars(select(Metric).where(Metric.group == "training"))]
    assert steps == [1, 2, 3]


def test_a_failing_script_exits_promptly_and_errors(det_env: Path) -> None:
    start = time.monotonic()
    proc = _run(det_env, "detached_fail.py", timeout=30, EXP_NAME="boom", FAIL="1")
    assert time.monotonic() - start < 25  # not its 30 s timeout
    assert proc.returncode == 1 and "RuntimeError: the model diverged" in proc.stderr
    _ingest()
    assert _experiments() == [("boom", "ERROR", [("ERROR", 0, 1)])]


def test_managed_trials_keep_their_yaml(det_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a managed trial the experiment's yaml wins: the Config's name and storage are ignored."""
    from detslurm.core import v2

    exp = det_env / "exps" / "exp-1-x"
    env = trial_env(
        experiment_id=1,
        trial_id=2,
        run_id=1,
        seed=1,
        hparams={"lr": 0.5},
        config={"name": "from-yaml"},
        latest_checkpoint=None,
        steps_completed=0,
        run_dir=exp / "trials/2/runs/1",
        trial_dir=exp / "trials/2",
        exp_dir=exp,
        checkpoint_base=str(det_env / "yaml-ckpts"),
        resources_type="slurm-job",
        slot_ids=[0],
        container_addrs=["127.0.0.1"],
        user="u",
    )
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    v2.init(config=v2.Config(name="ignored", hparams={"lr": 9}, checkpoint_storage=str(det_env / "nope")))
    try:
        assert v2.info is not None and v2.info.trial.hparams == {"lr": 0.5}
        assert v2.checkpoint is not None and v2.checkpoint.base == det_env / "yaml-ckpts"
        assert v2.train is not None
        v2.train.report_training_metrics(1, {"loss": 1.0})
    finally:
        v2.close()
    assert v2.train is None
    assert (exp / "trials/2/runs/1/events/rank-0.jsonl").read_text().count('"type": "metrics"') == 1
    assert not detached_root(det_env / "exps").exists()  # nothing registered as detached


# -- ingest decisions, with an injected poll ---------------------------------------------------------
def _registered(det_env: Path, job: str, run_of: RunPaths | None = None) -> RunPaths:
    layout = DetachedLayout.open(detached_root(det_env / "exps"))
    paths = allocate_run(layout.exp_dir("e1"), layout.trial_key("e1", "t1"))
    DetachedRun("e1", "t1", "ingest", str(det_env / "ck"), job_id=job, start=time.time()).write(paths)
    return paths


def _poll(states: Mapping[str, JobStatus]) -> Any:
    def poll(jobs: Mapping[str, Path]) -> dict[str, JobStatus]:
        return {j: states.get(j, JobStatus(JobState.UNKNOWN, None, ExitCause.LOST)) for j in jobs}

    return poll


def _run_states() -> list[tuple[int, str, str | None]]:
    with open_store(settings.load().db_url).read() as s:
        return [(r.run_id, r.state.value, r.exit_reason) for r in s.scalars(select(TrialRun).order_by(TrialRun.id))]


def test_a_killed_job_ends_in_error_only_once_gone(det_env: Path) -> None:
    _registered(det_env, "77")
    _, result = _ingest(_poll({"77": JobStatus(JobState.RUNNING)}))
    assert result.active and _experiments() == [("ingest", "ACTIVE", [("ACTIVE", 0, 1)])]

    def unreachable(jobs: Mapping[str, Path]) -> dict[str, JobStatus]:
        raise SchedulerUnavailable("slurmctld down")

    _ingest(unreachable)  # no answer from Slurm: never guess the job is gone
    assert _experiments()[0][1] == "ACTIVE"
    _ingest(_poll({}))  # neither in squeue nor closed: killed (scancel, SIGKILL, node failure)
    assert _experiments() == [("ingest", "ERROR", [("ERROR", 0, 1)])]


def test_a_requeued_job_supersedes_its_unclosed_run(det_env: Path) -> None:
    _registered(det_env, "88")
    _ingest(_poll({"88": JobStatus(JobState.QUEUED)}))
    assert _run_states() == [(1, "QUEUED", None)]
    second = _registered(det_env, "88")
    RunClosed("COMPLETED").write(second)
    _ingest(_poll({"88": JobStatus(JobState.EXITED, 0, ExitCause.COMPLETED)}))
    assert _run_states() == [(1, "EXITED", "requeued"), (2, "EXITED", "completed")]
    assert _experiments() == [("ingest", "COMPLETED", [("COMPLETED", 0, 2)])]


def test_a_stopped_run_is_canceled_and_revived_by_its_next_run(det_env: Path) -> None:
    first = _registered(det_env, "")
    RunClosed("STOPPED").write(first)
    _ingest()
    assert _experiments() == [("ingest", "CANCELED", [("CANCELED", 0, 1)])]
    _registered(det_env, "")  # a plain process on this host: its pid (0 here) is not alive
    _ingest()
    assert _experiments()[0][2] == [("ACTIVE", 0, 2)]


def test_unreadable_registrations_are_skipped(det_env: Path) -> None:
    good = _registered(det_env, "")
    RunClosed("COMPLETED").write(good)
    layout = DetachedLayout.open(detached_root(det_env / "exps"))
    bad = allocate_run(layout.exp_dir("e2"), 1)
    (bad.dir / "detached.json").write_text('{"external_experiment_id": 5}')
    _, result = _ingest()
    assert result.recorded == 1
    assert [name for name, _, _ in _experiments()] == ["ingest"]


def test_a_stuck_event_writer_does_not_hold_the_exit(tmp_path: Path) -> None:
    """The writer thread blocked on its file (a hung filesystem, here a FIFO nobody reads):
    a bounded flush and close give up in time instead of keeping the script alive."""
    from detslurm.core._events import EventWriter
    from detslurm.protocol import Progress

    fifo = tmp_path / "events" / "rank-0.jsonl"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    writer = EventWriter(fifo)
    writer.emit(Progress(progress=0.5))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish"):
        writer.flush(0.5)
    writer.close(0.5)
    assert time.monotonic() - start < 20  # a blocked FIFO would hold it for ever
    # The thread stays blocked (a daemon thread: it holds nothing at the interpreter's exit).
    assert writer._thread.daemon and writer._thread.is_alive()


def test_cli_shows_detached_runs_and_refuses_what_it_cannot_do(det_env: Path, det: Any) -> None:
    proc = _run(det_env, "detached_train.py", EXP_NAME="cli", STEPS="1")
    assert proc.returncode == 0, proc.stderr
    code, out, _ = det("e", "list")  # the read's own step records the run
    assert code == 0 and "cli" in out and "COMPLETED" in out
    code, out, _ = det("e", "wait", "1")
    assert code == 0 and "COMPLETED" in out
    code, _, err = det("e", "kill", "1")
    assert code != 0 and "detached" in err and "scancel" in err
    code, _, err = det("t", "kill", "1")
    assert code != 0 and "detached" in err
    code, out, _ = det("t", "logs", "1")
    assert code == 0 and "run 1 ended: completed" in out


def test_sigterm_ends_a_script_that_never_asks_should_preempt(det_env: Path) -> None:
    """scancel's SIGTERM: a detached script that never polls should_preempt() dies at once (no
    close record: the daemon marks it ERROR) instead of lingering until Slurm's SIGKILL."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DET_"))}
    full.update(EXP_NAME="term", HANG="1")
    proc = subprocess.Popen(
        [sys.executable, str(FIXTURES / "detached_fail.py")], env=full, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "reported"
    proc.terminate()
    assert proc.wait(timeout=10) == -15
    _ingest()  # the process is gone and never closed its run
    assert _experiments() == [("term", "ERROR", [("ERROR", 0, 1)])]


def test_a_detached_job_chooses_no_dir_that_det_e_delete_removes(det_env: Path, det: Any) -> None:
    """The job wrote its record's checkpoint base (a home dir) and reported the uuid `projects`:
    `det e delete` removes nothing there. A run on the configured checkpoint dir is cleaned up."""
    home = det_env / "home"
    (home / "projects").mkdir(parents=True)
    (home / "projects" / "keep.txt").write_text("mine")
    proc = _run(det_env, "detached_thief.py", HOME_BASE=str(home))
    assert proc.returncode == 0, proc.stderr
    _ingest()
    proc = _run(det_env, "detached_train.py", EXP_NAME="ok", STEPS="1")
    assert proc.returncode == 0, proc.stderr
    _ingest()
    assert [name for name, _, _ in _experiments()] == ["thief", "ok"]
    in_home = sorted(p.name for p in home.iterdir())
    assert len(in_home) == 2  # projects and the real checkpoint
    code, out, err = det("e", "delete", "--yes", "1")
    assert code == 0, out + err
    assert (home / "projects" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in home.iterdir()) == in_home  # the record's base is not the one deletes use
    ckpts = det_env / "ckpts"
    assert len(list(ckpts.iterdir())) == 1
    code, out, err = det("e", "delete", "--yes", "2")
    assert code == 0, out + err
    assert list(ckpts.iterdir()) == []
