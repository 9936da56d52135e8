"""Pilot workers (controller/pilots.py, slurm/pilot_job.py, docs/user/allocation.md): the config,
the workers' array and script, and how many workers the pool keeps for what the runs need."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import pytest
from fake_runner import FakeRunner
from test_refusals import SITE
from test_step_executor import END, SHOW

from detslurm.controller.executor import Demand, ExpRef, HoldingEnded
from detslurm.controller.pilots import PilotPool
from detslurm.controller.slurm_executor import SlurmExecutor
from detslurm.controller.step_executor import StepExecutor, StepRun
from detslurm.errors import ConfigError
from detslurm.expconf import ExperimentConfig, validate
from detslurm.slurm.allocation import Share
from detslurm.slurm.client import Result, SlurmClient
from detslurm.slurm.parse import (
    REC_END,
    SEP,
    SQUEUE_FIELDS,
    QueuedJob,
    experiment_tag,
    parse_comment,
    trial_comment,
)
from detslurm.slurm.pilot_job import (
    lease_path,
    plan_workers,
    shape_errors,
    worker_comment,
    worker_config,
    worker_of,
)
from detslurm.slurm.render import resource_plan
from detslurm.slurm.states import SlurmState

NOW = datetime.fromisoformat("2026-11-28T22:53:00").timestamp()  # while the captured job runs


def config(count: int = 2, trial_slots: int = 1, pool: str = "gpu", **pilots: Any) -> ExperimentConfig:
    raw = {
        "entrypoint": "python3 train.py",
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
        "resources": {"slots_per_trial": trial_slots, "resource_pool": pool},
        "slurm": {"pilots": {"count": count, **pilots}},
    }
    return validate(raw, {"type": "shared_fs", "host_path": "/tmp"})


def test_the_config_and_its_refusals() -> None:
    assert config(3).slurm.pilots is not None and config(3).slurm.pilots.time_limit == 60
    with pytest.raises(ConfigError) as e:
        validate(
            {
                "entrypoint": "x",
                "searcher": {"name": "single", "metric": "loss", "max_length": 1},
                "slurm": {"pilots": {"count": 1}, "in_allocation": True},
            },
            {"type": "shared_fs", "host_path": "/tmp"},
        )
    assert "pilots and in_allocation exclude each other" in str(e.value)
    assert shape_errors(config(1, trial_slots=2, slots=1), SITE) == [
        "<config>.slurm.pilots.slots: a worker of 1 slots cannot run a trial of resources.slots_per_trial 2"
    ]
    assert "leaves no time to run" in shape_errors(config(1, time_limit=1), SITE)[0]  # the site's lead is 60 s
    assert shape_errors(config(1, slots=4), SITE) == []


def test_workers_comment_is_no_trials() -> None:
    comment = worker_comment(7, "abc123")
    assert worker_of(comment) == (7, "abc123")
    assert parse_comment(comment) is None  # never read as a trial run's job
    assert worker_of(trial_comment(7, 1, 1, "abc123")) is None


def test_the_workers_array(tmp_path: Path) -> None:
    exp_dir = tmp_path / "50%" / "exp"
    cfg = config(2, slots=2, time_limit=30, idle_timeout=20)
    wcfg = worker_config(cfg)
    assert wcfg.resources.slots_per_trial == 2 and cfg.resources.slots_per_trial == 1
    req = plan_workers(config=cfg, res=resource_plan(wcfg, SITE), exp_id=5, exp_dir=exp_dir, tag="ab", count=2)
    args = req.args
    assert "--array=0-1" in args and "--time=30" in args and "--gres=gpu:2" in args
    assert f"--comment={worker_comment(5, 'ab')}" in args and "--job-name=det-e5-pilot" in args
    assert f"--output={tmp_path}/50%%/exp/pilots/worker-%A_%a.log" in args  # sbatch's % doubled
    # Two 1-slot trials per GPU node of the worker: a CPU for each.
    assert "--cpus-per-task=2" in args
    # The script reads only its lease's time, and runs nothing it reads.
    assert str(lease_path(exp_dir)) in req.script and "eval" not in req.script and "source" not in req.script
    assert "-le 20 ]" in req.script


class Slurm(FakeRunner):
    """scontrol answers with a running 2-node job (every worker looks the same); sbatch and
    scancel succeed; the lease must exist before any worker is submitted."""

    def __init__(self, lease: Path) -> None:
        super().__init__()
        self.lease = lease

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        if argv[:4] == ["scontrol", "-d", "show", "job"]:
            return Result(0, SHOW, "")
        if argv[0] == "sbatch":
            assert self.lease.exists(), "a worker submitted before its lease"
            return Result(0, "300\n", "")
        if argv[0] == "scancel":
            return Result(0, "", "")
        return Result(1, "", f"{argv[0]}: unexpected")


def queued(task: str, raw: int, state: SlurmState, exp: int, tag: str) -> QueuedJob:
    return QueuedJob(
        job_id=task, raw_id=raw, array_job_id=200, array_task_id=int(task.split("_")[1]), state=state,
        state_text=state.value, partition="gpu", user="root", priority=1, reason="None", nodelist="",
        num_nodes=1, num_cpus=1, gres="", submit_time="", start_time="", time_limit="", nice=0,
        name=f"det-e{exp}-pilot", comment=worker_comment(exp, tag),
    )  # fmt: skip


def pool(tmp_path: Path, jobs: list[QueuedJob]) -> tuple[PilotPool, Slurm, ExpRef]:
    exp = ExpRef(1, tmp_path / "exp")
    exp.dir.mkdir(parents=True)
    fake = Slurm(lease_path(exp.dir))
    client = SlurmClient(fake, user="root")
    steps = StepExecutor(client, SITE, clock=lambda: NOW)
    return PilotPool(client, steps, lambda: {j.job_id: j for j in jobs}, lambda _: False, clock=lambda: NOW), fake, exp


def test_missing_workers_go_as_one_array(tmp_path: Path) -> None:
    p, fake, exp = pool(tmp_path, [])
    assert p.settle([Demand(exp, config(2), runs=5)]) == []
    (sbatch,) = [c for c in fake.calls if c[0] == "sbatch"]
    assert "--array=0-1" in sbatch  # at most count, whatever the runs
    # Two 1-slot trials per worker of 2 slots: three runs need two workers.
    p, fake, exp = pool(tmp_path / "b", [])
    p.settle([Demand(exp, config(5, slots=2), runs=3)])
    assert "--array=0-1" in next(c for c in fake.calls if c[0] == "sbatch")


def test_surplus_goes_waiting_first_then_idle_never_busy(tmp_path: Path) -> None:
    tag = experiment_tag(str(tmp_path / "exp"))
    jobs = [
        queued("200_0", 201, SlurmState.RUNNING, 1, tag),
        queued("200_1", 202, SlurmState.RUNNING, 1, tag),
        queued("200_2", 203, SlurmState.PENDING, 1, tag),
        queued("200_3", 204, SlurmState.RUNNING, 2, tag),  # another experiment's
        queued("200_4", 205, SlurmState.RUNNING, 1, "0ther"),  # another store's
    ]
    p, fake, exp = pool(tmp_path, jobs)
    now = [NOW]
    p._clock = lambda: now[0]
    p.steps._live["r"] = StepRun("201", Share(("g1",), 1, 1), "h", 1, 0.0)  # a run in the first
    assert p.running(exp) == ["201", "202"]
    # One worker too many while the search goes on: kept for idle_timeout (the next trial or
    # promotion may need it a tick later), then the waiting one goes.
    for t in (0, 30, 59):
        now[0] = NOW + t
        p.settle([Demand(exp, config(3, idle_timeout=60), runs=2)])
    assert fake.asked("scancel") == 0
    now[0] = NOW + 60
    p.settle([Demand(exp, config(3, idle_timeout=60), runs=2)])
    assert [c for c in fake.calls if c[0] == "scancel"] == [["scancel", "200_2"]]
    assert not [c for c in fake.calls if c[0] == "sbatch"]


def test_a_surplus_worker_needed_again_starts_its_grace_afresh(tmp_path: Path) -> None:
    tag = experiment_tag(str(tmp_path / "exp"))
    jobs = [queued("200_0", 201, SlurmState.RUNNING, 1, tag), queued("200_1", 202, SlurmState.RUNNING, 1, tag)]
    p, fake, exp = pool(tmp_path, jobs)
    now = [NOW]
    p._clock = lambda: now[0]
    p.settle([Demand(exp, config(2, idle_timeout=60), runs=1)])  # one surplus from NOW
    now[0] = NOW + 40
    p.settle([Demand(exp, config(2, idle_timeout=60), runs=2)])  # a promotion: both needed
    now[0] = NOW + 70
    p.settle([Demand(exp, config(2, idle_timeout=60), runs=1)])  # surplus again, from NOW + 70
    assert fake.asked("scancel") == 0
    now[0] = NOW + 130
    p.settle([Demand(exp, config(2, idle_timeout=60), runs=1)])
    assert [c for c in fake.calls if c[0] == "scancel"] == [["scancel", "200_0"]]  # no run in either


def test_a_paused_experiment_keeps_no_idle_worker(tmp_path: Path) -> None:
    tag = experiment_tag(str(tmp_path / "exp"))
    jobs = [
        queued("200_0", 201, SlurmState.RUNNING, 1, tag),
        queued("200_1", 202, SlurmState.RUNNING, 1, tag),
        queued("200_2", 203, SlurmState.PENDING, 1, tag),
    ]
    p, fake, exp = pool(tmp_path, jobs)
    p.steps._live["r"] = StepRun("201", Share(("g1",), 1, 1), "h", 1, 0.0)  # its run checkpoints
    # Paused (or ended): no run needs a worker; all but the one a run is still in go at once.
    p.settle([Demand(exp, config(3), runs=0)])
    assert [c for c in fake.calls if c[0] == "scancel"] == [["scancel", "200_2", "200_1"]]
    assert not [c for c in fake.calls if c[0] == "sbatch"]


def test_a_worker_past_its_last_start_goes_once_its_run_has_left(tmp_path: Path) -> None:
    """Within the signal lead of its end a worker takes no run: a successor is queued at once,
    and the worker is canceled as soon as no run is in it, not left idle until its limit."""
    tag = experiment_tag(str(tmp_path / "exp"))
    p, fake, exp = pool(tmp_path, [queued("200_0", 201, SlurmState.RUNNING, 1, tag)])
    p.steps._clock = lambda: END - 30  # the site's lead is 60 s
    p.steps._live["r"] = StepRun("201", Share(("g1",), 1, 1), "h", 1, 0.0)  # its run checkpoints
    p.settle([Demand(exp, config(1), runs=1)])
    assert fake.asked("sbatch") == 1 and fake.asked("scancel") == 0
    del p.steps._live["r"]  # the run has ended; the trial waits for the successor
    p.settle([Demand(exp, config(1), runs=1)])
    assert [c for c in fake.calls if c[0] == "scancel"] == [["scancel", "200_0"]]


class Queue(Slurm):
    """Also squeue: three running workers, two of experiment 1 and one of experiment 2."""

    def __init__(self, lease: Path, records: str) -> None:
        super().__init__(lease)
        self.records = records

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        if argv[0] == "squeue":
            return Result(0, self.records, "")
        return super().answer(argv, input)


def _record(task: str, raw: int, comment: str) -> str:
    f = [task, str(raw), task.split("_")[0], task.split("_")[1], "RUNNING", "gpu", "root", "100", "None", "g1"]
    f += ["1", "1", "N/A", "2026-11-28T22:52:51", "2026-11-28T22:52:52", "1:00:00", "0", "det-e1-pilot", comment, "0"]
    assert len(f) == len(SQUEUE_FIELDS)
    return SEP.join(f) + REC_END


def test_one_squeue_a_tick_whatever_the_workers(tmp_path: Path) -> None:
    one, two = ExpRef(1, tmp_path / "e1"), ExpRef(2, tmp_path / "e2")
    for e in (one, two):
        e.dir.mkdir()
    t1, t2 = experiment_tag(str(one.dir)), experiment_tag(str(two.dir))
    records = _record("200_0", 201, worker_comment(1, t1)) + _record("200_1", 202, worker_comment(1, t1))
    records += _record("300_0", 301, worker_comment(2, t2))
    fake = Queue(lease_path(one.dir), records)
    ex = SlurmExecutor(SlurmClient(fake, user="root"), SITE)
    ex.steps._clock = lambda: NOW
    for _ in range(2):  # two ticks
        # Every worker answers as the captured job: two nodes of two GPUs, four 1-slot runs.
        assert ex.capacity(config(2), one) == 8 and ex.capacity(config(2), two) == 4
        ex.settle([Demand(one, config(2), runs=2), Demand(two, config(1), runs=1)])
    assert fake.asked("squeue") == 2
    assert fake.asked("scontrol -d show job") == 3  # each worker once, when it is first seen running
    assert fake.asked("sbatch") == 0 and fake.asked("scancel") == 0


def test_a_worker_slurm_made_too_small_pauses_rather_than_waits(tmp_path: Path) -> None:
    """A worker running with less than a trial needs (``slurm.sbatch_args`` can override what
    the pilots section asks for): its runs would wait for room forever, so the settle says why
    (the controller pauses the experiment with it) instead."""
    tag = experiment_tag(str(tmp_path / "exp"))
    p, fake, exp = pool(tmp_path, [queued("200_0", 201, SlurmState.RUNNING, 1, tag)])
    # The captured worker holds two nodes of two GPUs; a trial of 6 slots cannot fit.
    ((exp_id, problem),) = p.settle([Demand(exp, config(1, trial_slots=6), runs=1)])
    assert exp_id == 1 and isinstance(problem, HoldingEnded), problem
    assert str(problem).startswith("pilot worker 200_0 is too small: a trial needs "), problem
    assert "but allocation 201 holds 2 nodes" in str(problem), problem
    assert fake.asked("sbatch") == 0
    # One that fits is no problem.
    tag = experiment_tag(str(tmp_path / "b" / "exp"))
    p, fake, exp = pool(tmp_path / "b", [queued("200_0", 201, SlurmState.RUNNING, 1, tag)])
    assert p.settle([Demand(exp, config(1, trial_slots=4), runs=1)]) == []
    assert p.running(exp) == ["201"] and fake.asked("sbatch") == 0
    # Once paused (no runs), the too-small worker is canceled like any idle one.
    tag = experiment_tag(str(tmp_path / "c" / "exp"))
    p, fake, exp = pool(tmp_path / "c", [queued("200_0", 201, SlurmState.RUNNING, 1, tag)])
    assert p.settle([Demand(exp, config(1, trial_slots=6), runs=0)]) == []
    assert [c for c in fake.calls if c[0] == "scancel"] == [["scancel", "200_0"]]
