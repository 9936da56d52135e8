"""Trial runs as job steps of a held job (controller/step_executor.py, docs/user/allocation.md):
the create's binding to the allocation `det` runs in, the step's plan, the room left, and the
held job's end as HoldingEnded."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import pytest
from fake_runner import FakeRunner
from test_refusals import SITE

from detslurm.controller.executor import ExitCause, HoldingEnded, JobState, RunSpec
from detslurm.controller.in_allocation import OUTSIDE, bind
from detslurm.controller.step_executor import StepExecutor, StepRun, is_step
from detslurm.errors import ConfigError
from detslurm.expconf import ExperimentConfig, validate
from detslurm.slurm.allocation import Share
from detslurm.slurm.client import Result, SlurmClient

DATA = Path(__file__).parents[2] / "data" / "slurm-22.05"
SHOW = (DATA / "show-job-allocation.txt").read_text()
END = datetime.fromisoformat("2026-11-28T23:22:52").timestamp()  # the captured job's EndTime (local time)


def raw(**slurm: Any) -> dict[str, Any]:
    return {
        "entrypoint": "python3 train.py",
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
        "slurm": slurm,
    }


def config(slots: int = 1, job: str = "9") -> ExperimentConfig:
    cfg = raw(in_allocation=True, allocation_id=job)
    cfg["resources"] = {"slots_per_trial": slots}
    return validate(cfg, {"type": "shared_fs", "host_path": "/tmp"})


class Held(FakeRunner):
    """scontrol's answer about held job 9: the captured one, or gone."""

    def __init__(self) -> None:
        super().__init__()
        self.gone = False

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        if argv[:4] == ["scontrol", "-d", "show", "job"]:
            if self.gone:
                return Result(1, "", "slurm_load_jobs error: Invalid job id specified")
            return Result(0, SHOW, "")
        return Result(1, "", f"{argv[0]}: unexpected")


def executor(fake: Held, now: float) -> StepExecutor:
    return StepExecutor(SlurmClient(fake, user="root"), SITE, clock=lambda: now)


def test_bind_records_the_allocation_det_runs_in() -> None:
    assert bind(raw(in_allocation=True), "42")["slurm"] == {"in_allocation": True, "allocation_id": "42"}
    assert bind(raw(in_allocation=True, allocation_id="7"), "42")["slurm"]["allocation_id"] == "7"
    assert bind(raw(in_allocation=True, allocation_id="7"), "42", fresh=True)["slurm"]["allocation_id"] == "42"
    assert bind(raw(), "42")["slurm"] == {}  # not asked: ordinary jobs, allocation or not
    with pytest.raises(ConfigError) as e:
        bind(raw(in_allocation=True), None)
    assert e.value.errors == [OUTSIDE]


def test_room_in_the_held_job_and_its_end() -> None:
    fake = Held()
    ex = executor(fake, END - 3600)
    assert ex.capacity(config(1)) == 4
    ex._live["a"] = StepRun("9", Share(("g1",), 1, 1), "h", 1, 0.0)
    assert ex.capacity(config(1)) == 3 and ex.capacity(config(2)) == 1
    # Within the site's signal lead of its time limit, nothing more starts there.
    late = executor(fake, END - SITE.signal_lead_s + 1)
    with pytest.raises(HoldingEnded, match="allocation 9 reaches its time limit"):
        late.capacity(config(1))
    fake.gone = True
    with pytest.raises(HoldingEnded, match="allocation 9 has ended"):
        executor(fake, END - 3600).capacity(config(1))


def test_refusal_names_the_numbers() -> None:
    (r,) = executor(Held(), END - 3600).refusals(config(6))
    assert str(r) == (
        "<config>.resources.slots_per_trial: a trial needs 3 nodes with 2 GPUs each, "
        "but allocation 9 holds 2 nodes (g1, g2) with 2 GPUs and 2 CPUs each"
    )
    assert executor(Held(), END - 3600).refusals(config(4)) == []


def test_the_step_runs_the_batch_scripts_shell_with_srun_in_the_held_job(tmp_path: Path) -> None:
    spec = RunSpec(
        name="det-e1-t2-r1",
        argv=[],
        env={"DET_TRIAL_ID": "2"},
        run_dir=tmp_path / "run",
        log_path=tmp_path / "run" / "output.log",
        exp_dir=tmp_path,
        identity=(1, 2, 1),
        config=config(1),
    )
    ex = executor(Held(), END - 3600)
    alloc = ex.allocation("9")
    assert alloc is not None
    req = ex.plan(spec, "9", alloc, Share(("g2",), 1, 1))
    assert req.args == [
        "--jobid=9",
        "--job-name=det-e1-t2-r1",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--nodelist=g2",
        "--gres=gpu:1",
        "--cpus-per-task=1",
        "--exact",
    ]
    script = req.script
    assert "srun --jobid=9 --job-name=det-e1-t2-r1 --nodes=1" in script and "--kill-on-bad-exit=1" in script
    assert "export DET_TRIAL_ID=2" in script and '_det_job="9"' in script
    # srun stays the shell's child (no Slurm signal reaches this shell): no setsid, no pid file.
    assert "setsid" not in script and "_det_step=$!" in script


def test_a_step_run_id_holds_its_placement() -> None:
    run = StepRun("9", Share(("g1", "g2"), 2, 2, 0), "login1", 4242, 1700000000.25)
    assert run.id == "9/g[1-2]/2/2/0/login1/4242@1700000000.250"
    assert is_step(run.id) and not is_step("9") and not is_step("9_3")
    assert StepRun.parse(run.id) == run and StepRun.parse("9/x") is None


class Ended(Held):
    """scontrol's answer about held job 9 once it has ended (canceled at its captured EndTime)."""

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        res = super().answer(argv, input)
        return Result(res.returncode, res.stdout.replace("JobState=RUNNING", "JobState=CANCELLED"), res.stderr)


def test_a_run_whose_shell_ended_with_its_held_job_is_a_preemption(tmp_path: Path) -> None:
    """The daemon ran inside the held job (an sbatch script's `det e create --in-allocation`):
    Slurm ended the job and the run's shell with it, so no exit record was written. A daemon
    started later reads the run as the held job's end (a preemption: no restart spent), not as
    running forever (the shell was on another host) nor as lost (this host)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    elsewhere = StepRun("9", Share(("g1",), 1, 1), "another-host", 4242, 0.0)
    # While the job runs, a run whose shell lives on another host is running.
    (status,) = executor(Held(), END - 3600).poll({elsewhere.id: run_dir}).values()
    assert status.state == JobState.RUNNING
    # Just ended: its shell may still be writing its record.
    (status,) = executor(Ended(), END + 10).poll({elsewhere.id: run_dir}).values()
    assert status.state == JobState.RUNNING
    for fake, now in ((Ended(), END + 61), (Held(), END + 61)):
        fake.gone = fake.__class__ is Held  # ended long ago, or forgotten by Slurm
        (status,) = executor(fake, now).poll({elsewhere.id: run_dir}).values()
        assert (status.state, status.cause, status.exit_code) == (JobState.EXITED, ExitCause.PREEMPTED, None)
    # This host, its shell gone: the held job's end decides, not the shell's.
    here = executor(Ended(), END + 1)
    mine = StepRun("9", Share(("g1",), 1, 1), here.host, 2**22 + 1, 0.0)  # no such process
    (status,) = here.poll({mine.id: run_dir}).values()
    assert (status.state, status.cause) == (JobState.EXITED, ExitCause.PREEMPTED)
    (status,) = executor(Held(), END - 3600).poll({mine.id: run_dir}).values()
    assert (status.state, status.cause) == (JobState.UNKNOWN, ExitCause.LOST)  # the job runs on
