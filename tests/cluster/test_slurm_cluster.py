"""On the project's real Slurm cluster: experiments as Slurm jobs, driven by the daemon."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, write
from helpers import store, wait_for
from sqlalchemy import select

from detslurm import daemon, settings
from detslurm.store import Metric, Trial, TrialRun

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
CORE = EXAMPLES / "core_api"
FIXTURES = Path(__file__).parents[1] / "fixtures"


def trials(exp_id: int) -> list[Trial]:
    with store().tx() as s:
        return list(s.scalars(select(Trial).where(Trial.experiment_id == exp_id).order_by(Trial.id)))


def steps(trial_id: int, group: str = "training") -> list[tuple[int, int]]:
    with store().tx() as s:
        q = (
            select(Metric.steps_completed, Metric.run_id)
            .where(Metric.trial_id == trial_id)
            .where(Metric.group == group)
            .where(Metric.archived.is_(False))
            .order_by(Metric.steps_completed)
        )
        return [(a, b) for a, b in s.execute(q)]


def squeue_ids() -> set[str]:
    return set(subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout.split())


@pytest.mark.slurm24_smoke
def test_resource_pools(det: Any) -> None:
    code, out, err = det("resource-pool", "list")
    assert code == 0, err
    lines = {ln.split("|")[0].strip(): ln for ln in out.splitlines()[2:]}
    assert set(lines) == {"cpu", "gpu", "high"}
    assert "| 0/4" in lines["gpu"] and "gpu" in lines["gpu"] and "| 0/8" in lines["high"]


@pytest.mark.slurm24_smoke
def test_partitions_and_site_timing_probed() -> None:
    """The probes the refusals and the preemption budget use, against the live controller."""
    from detslurm.slurm.client import client_from_env

    client = client_from_env()
    parts = {p.name: p for p in client.partitions()}
    assert parts["cpu"].default and parts["cpu"].total_nodes == 2 and parts["high"].priority_tier == 10
    caps = client.capabilities()
    assert caps.kill_wait_s == 15 and caps.preempt_mode == "REQUEUE" and caps.preemption


def test_dry_run_and_bad_input_submit_nothing(det: Any, tmp_path: Path) -> None:
    before = squeue_ids()
    code, out, _ = det("e", "create", "--dry-run", CORE / "adaptive.yaml", CORE)
    assert code == 0 and "\nsbatch --parsable" in out and "--partition=cpu" in out
    code, _, err = det("e", "create", CORE / "const.yaml", CORE, "--config", "resources.resource_pool=nope")
    assert code == 1 and "resource pool 'nope' does not exist; valid pools: cpu, gpu, high" in err
    code, _, err = det("e", "create", CORE / "const.yaml", CORE, "--config", "slurm.sbatch_args=[-N4]")
    assert code == 1 and ": slurm.sbatch_args[0]: slurm option -N is not configurable" in err
    assert squeue_ids() == before and det("e", "list", "--json")[1].strip() == "[]"


def test_adaptive_asha_on_slurm(det: Any) -> None:
    code, out, err = det("e", "create", CORE / "adaptive.yaml", CORE, "--config", "hyperparameters.sleep=0.1")
    assert code == 0 and "Created experiment 1" in out, err
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    ts = trials(1)
    assert len(ts) >= 8 and all(t.state == "COMPLETED" for t in ts)
    assert any(t.early_stopped for t in ts)
    assert any(max(s for s, _ in steps(t.id)) < 40 for t in ts)
    with store().tx() as s:
        jobs = s.scalars(select(TrialRun.job_id)).all()
    # The first trials start together: one job array (ids ARRAY_TASK); later ones single jobs.
    assert all(j and re.fullmatch(r"\d+(_\d+)?", j) for j in jobs) and len(set(jobs)) == len(jobs)
    assert any("_" in j for j in jobs)


def test_two_node_trial(det: Any, tmp_path: Path) -> None:
    write(tmp_path / "ctx/two_node.py", (FIXTURES / "two_node.py").read_text())
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 two_node.py\nsearcher: {name: single, metric: loss}\nresources: {slots_per_trial: 4}\n",
    )
    code, out, err = det("e", "create", cfg, tmp_path / "ctx", "-f")
    assert code == 0, out + err
    assert "rank 0 of 2 on c1" in out and "peers ['c1', 'c2']" in out
    (t,) = trials(1)
    assert t.state == "COMPLETED"
    with store().tx() as s:
        m = s.scalars(select(Metric).where(Metric.group == "validation")).one()
    assert m.metrics["nodes"] == 2 and m.metrics["ranks"] == 2


def test_pause_activate_on_slurm(det: Any) -> None:
    assert det("e", "create", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=1.0")[0] == 0
    wait_for(lambda: bool(trials(1)) and trials(1)[0].latest_checkpoint is not None)
    assert det("e", "pause", "1")[0] == 0
    wait_for(lambda: trials(1)[0].state == "PAUSED")
    paused_at = trials(1)[0].steps_completed
    assert 0 < paused_at < 40 and not squeue_ids()
    code, out, _ = det("e", "activate", "1")
    assert code == 0 and "Activated experiment 1" in out
    assert det("e", "wait", "1")[0] == 0
    (t,) = trials(1)
    assert t.run_count == 2 and t.restarts == 0
    train = steps(t.id)
    assert [s for s, _ in train] == list(range(1, 41))
    assert min(s for s, r in train if r == 2) == paused_at + 1


@pytest.mark.fault
@pytest.mark.slurm24_smoke
def test_preemption_by_high_partition_loses_no_steps(det: Any) -> None:
    code, _, err = det(
        "e",
        "create",
        CORE / "const.yaml",
        CORE,
        "--config",
        "hyperparameters.sleep=1.0",
        "--config",
        "slurm.sbatch_args=[--nodelist=c1]",
    )
    assert code == 0, err
    wait_for(lambda: bool(trials(1)) and trials(1)[0].latest_checkpoint is not None)
    subprocess.run(
        ["sbatch", "-p", "high", "-w", "c1", "-c", "2", "-o", "/dev/null", "--wrap", "sleep 2"],
        check=True,
        capture_output=True,
    )
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    (t,) = trials(1)
    assert t.run_count >= 2 and t.restarts == 0  # preemption is not the trial's failure
    train = steps(t.id)
    assert [s for s, _ in train] == list(range(1, 41))  # nothing lost, nothing counted twice
    with store().tx() as s:
        first = s.scalars(select(TrialRun).where(TrialRun.trial_id == t.id).order_by(TrialRun.run_id)).first()
    assert first is not None and first.preempt_acked
    assert first.exit_reason == "preempted"
    code, out, _ = det("t", "logs", str(t.id))
    assert "preempted" in out


@pytest.mark.fault
def test_daemon_sigkill_loses_and_duplicates_nothing(det: Any) -> None:
    code, _, err = det("e", "create", CORE / "adaptive.yaml", CORE, "--config", "hyperparameters.sleep=0.05")
    assert code == 0, err
    s = settings.load()
    for _ in range(4):
        time.sleep(1.5)
        pid = daemon.running_pid(s)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: daemon.running_pid(s) is None, 60)
        daemon.start(s)
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    ts = trials(1)
    assert len(ts) == 8 and len({t.request_id for t in ts}) == 8
    for t in ts:
        got = [st for st, _ in steps(t.id)]
        assert got == list(range(1, len(got) + 1))
        assert t.run_count == 1
    with store().tx() as session:
        jobs = session.scalars(select(TrialRun.job_id)).all()
    assert len(jobs) == 8 and len(set(jobs)) == 8


def _job_of(trial_id: int) -> str:
    with store().tx() as s:
        runs = s.scalars(select(TrialRun).where(TrialRun.trial_id == trial_id).order_by(TrialRun.run_id)).all()
    return str(runs[-1].job_id) if runs and runs[-1].job_id else ""


def test_time_limit_warning_signal_checkpoints_and_resubmits(det: Any) -> None:
    """The site's warning signal (USR2 before the time limit) reaches the trial through the batch
    shell and srun; it checkpoints, exits, and is resubmitted with nothing lost."""
    assert det("e", "create", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=1.0")[0] == 0
    wait_for(lambda: bool(trials(1)) and trials(1)[0].latest_checkpoint is not None and _job_of(trials(1)[0].id) != "")
    job = _job_of(trials(1)[0].id)
    subprocess.run(["scancel", "--signal=USR2", "--batch", job], check=True)
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    (t,) = trials(1)
    assert t.run_count == 2 and t.restarts == 0
    assert [s for s, _ in steps(t.id)] == list(range(1, 41))
    with store().tx() as s:
        first = s.scalars(select(TrialRun).where(TrialRun.trial_id == t.id).order_by(TrialRun.run_id)).first()
    assert first is not None and first.preempt_acked
    assert "USR2" in (Path(first.run_dir) / "signals").read_text()


def test_external_scancel_is_a_user_cancel(det: Any) -> None:
    assert det("e", "create", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=1.0")[0] == 0
    wait_for(lambda: bool(trials(1)) and _job_of(trials(1)[0].id) != "" and bool(steps(trials(1)[0].id)))
    subprocess.run(["scancel", _job_of(trials(1)[0].id)], check=True)
    code, out, _ = det("e", "wait", "1")
    assert code == 1 and "Experiment 1 CANCELED" in out
    (t,) = trials(1)
    assert t.state == "CANCELED" and t.run_count == 1 and "canceled outside detslurm" in (t.exit_reason or "")
    code, out, _ = det("t", "describe", str(t.id))
    assert "canceled" in out


def test_test_mode_and_follow_on_slurm(det: Any, tmp_path: Path) -> None:
    code, out, err = det("e", "create", "--test-mode", CORE / "adaptive.yaml", CORE)
    assert code == 0 and "Model definition test succeeded! 🎉" in out, out + err
    # A job on both cpu nodes holds the trial's job in the queue until the follow has said why
    # it waits. (A blocker of a fixed `sleep 4` had ended before the submission on a loaded
    # machine: the job ran at once, and there was no waiting to report.)
    go = tmp_path / "go"
    hold = f"for i in $(seq 1500); do [ -e {shlex.quote(str(go))} ] && exit 0; sleep 0.2; done"
    blocker = subprocess.run(
        ["sbatch", "--parsable", "-p", "cpu", "-N2", "-c", "2", "-o", "/dev/null", "--wrap", hold],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    wait_for(lambda: _squeue_state(blocker) == "RUNNING")
    argv = [str(Path(sys.executable).parent / "det"), "e", "create", "-f", str(CORE / "const.yaml"), str(CORE)]
    with (tmp_path / "stderr").open("w+") as err_file:
        follow = subprocess.Popen(
            [*argv, "--config", "hyperparameters.sleep=0"], stdout=subprocess.PIPE, stderr=err_file, text=True
        )
        lines = []
        try:
            assert follow.stdout is not None
            for line in follow.stdout:
                lines.append(line)
                if line.startswith("HPC job waiting to be scheduled: "):
                    go.touch()
            code = follow.wait(timeout=60)
        finally:
            go.touch()
            follow.kill()
        err_file.seek(0)
        err = err_file.read()
    out = "".join(lines)
    assert code == 0, out + err
    assert "HPC job waiting to be scheduled: waiting" in out, out
    assert "done: w=" in out, out


def _squeue_state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def test_crash_between_sbatch_and_commit_is_adopted_by_comment(det: Any) -> None:
    """Contract 4: a controller killed after sbatch but before recording the job id does not
    submit the run again; the next one finds the job by its --comment."""
    from detslurm.controller import ops

    code, out, err = det("e", "create", "--paused", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=0")
    assert code == 0, err
    ops.activate(store(), 1)
    ctl = daemon.make_controller(settings.load())
    real_execute = ctl.executor.execute  # type: ignore[attr-defined]

    def crash_after_sbatch(sub: Any) -> str:
        real_execute(sub)
        raise KeyboardInterrupt("the controller dies right after sbatch")

    ctl.executor.execute = crash_after_sbatch  # type: ignore[attr-defined]
    with pytest.raises(KeyboardInterrupt):
        ctl.tick()
    with store().tx() as s:
        (run,) = s.scalars(select(TrialRun)).all()
        assert run.job_id is None  # the crash lost the job id
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    with store().tx() as s:
        runs = s.scalars(select(TrialRun)).all()
    assert len(runs) == 1 and runs[0].job_id
    from detslurm.slurm.parse import experiment_tag, trial_comment

    with store().tx() as s:
        exp_dir = s.scalars(select(Trial)).one().experiment.exp_dir
    comments = subprocess.run(
        ["squeue", "-h", "--states=all", "-o", "%k"], capture_output=True, text=True
    ).stdout.split()
    assert comments.count(trial_comment(1, 1, 1, experiment_tag(exp_dir))) == 1  # submitted exactly once


@pytest.fixture(scope="module")
def dbd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    state = tmp_path_factory.mktemp("slurm-dbd")
    # Beside the main cluster's ports (test_accounting_cluster uses +100, test_rate_limit +300),
    # so parallel runs with their own TEST_CLUSTER_PORT never share it.
    port = str(int(os.environ.get("TEST_CLUSTER_PORT", "17817")) + 200)
    env = dict(os.environ, TEST_CLUSTER_PORT=port, TEST_CLUSTER_DBD="1")
    subprocess.run([str(Path(__file__).parents[2] / "scripts/test-cluster"), "up", str(state)], check=True, env=env)
    yield state
    subprocess.run([str(Path(__file__).parents[2] / "scripts/test-cluster"), "down", str(state)], check=False, env=env)


def test_accounting_cluster_sacct(dbd_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from detslurm.slurm.client import SlurmClient

    monkeypatch.setenv("SLURM_CONF", str(dbd_cluster / "etc/slurm.conf"))
    client = SlurmClient()
    assert client.capabilities().accounting
    job = client.sbatch(["-o", "/dev/null"], "#!/bin/bash\nexit 4\n")
    wait_for(lambda: client.sacct([job]).get(job) is not None and client.sacct([job])[job].state.is_terminal, 120)
    acct = client.sacct([job])[job]
    assert acct.state.value == "FAILED" and acct.exit_code == 4


@pytest.mark.fault
def test_node_failure_resumes_elsewhere_from_checkpoint(det: Any, slurm_cluster: Path) -> None:
    """Kill the slurmd of the node running a trial: Slurm marks the node down and the job
    NODE_FAIL; the trial resumes on another node from its checkpoint without using a restart."""
    # Long enough (80 batches x 0.5 s) that Slurm notices the dead node (SlurmdTimeout 10 s)
    # well before the trial could finish on its own.
    code, _, err = det(
        "e",
        "create",
        CORE / "const.yaml",
        CORE,
        "--config",
        "hyperparameters.sleep=0.5",
        "--config",
        "max_restarts=0",
        "--config",
        "environment.environment_variables=[EXAMPLE_TOTAL_BATCHES=80]",
    )
    assert code == 0, err
    wait_for(lambda: bool(trials(1)) and trials(1)[0].latest_checkpoint is not None and _job_of(trials(1)[0].id) != "")
    job = _job_of(trials(1)[0].id)
    node = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True).stdout.strip()
    pid = int((slurm_cluster / "run" / f"slurmd-{node}.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    try:
        code, out, err = det("e", "wait", "1")
        assert code == 0, out + err
        (t,) = trials(1)
        assert t.run_count >= 2 and t.restarts == 0
        with store().tx() as s:
            first = s.scalars(select(TrialRun).where(TrialRun.trial_id == t.id).order_by(TrialRun.run_id)).first()
        assert first is not None and first.exit_reason == "node failure"
        got = [st for st, _ in steps(t.id)]
        assert got == list(range(1, 81))
    finally:
        env = dict(os.environ, TEST_CLUSTER_PORT=os.environ.get("TEST_CLUSTER_PORT", "17817"))
        subprocess.run(
            [str(Path(__file__).parents[2] / "scripts/test-cluster"), "up", str(slurm_cluster)],
            check=True,
            env=env,
            capture_output=True,
        )
