"""The SDK's state changes are the CLI's: Experiment.pause/activate/cancel/kill and Trial.kill do
what `det e pause/activate/cancel/kill` and `det t kill` do, through the same code, against the
fake Slurm of test_client_sdk_create.py: the same Slurm calls at once (scancel of a killed
experiment's jobs, of a paused one's queued jobs), the daemon started on activate, and nothing
printed on stdout (over ssh:// that is the login node's answer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import write
from test_client_sdk_create import CONFIG, sdk

from detslurm.store import open_store
from detslurm.store.models import RunState, TrialRun

__all__ = ["sdk"]  # the fixture, shared with test_client_sdk_create.py


def _job(exp_id: int) -> str:
    with open_store_of_settings().read() as s:
        (job,) = [r.job_id for r in s.query(TrialRun).all() if r.trial.experiment_id == exp_id]
    assert job
    return str(job)


class Effects:
    """What each step did outside the store: the Slurm calls that change jobs (the experiment's
    job id written JOB) and the daemon starts."""

    def __init__(self, fake: Any, started: list[object]) -> None:
        self.fake, self.started = fake, started
        self.seen = (len(fake.calls), len(started))

    def step(self, job: str) -> tuple[list[list[str]], int]:
        calls = [c for c in self.fake.calls[self.seen[0] :] if c[0] in ("scancel", "scontrol", "sbatch")]
        out = ([["JOB" if a == job else a for a in c] for c in calls], len(self.started) - self.seen[1])
        self.seen = (len(self.fake.calls), len(self.started))
        return out


def test_experiment_verbs_reach_slurm_at_once_as_det_e_does(
    sdk: Any, det: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sdk_client, fake, started = sdk
    ctx = write(tmp_path / "ctx" / "train.py", "pass\n").parent
    mine = sdk_client.create_experiment(write(tmp_path / "a.yaml", CONFIG), str(ctx))
    code, out, err = det("e", "create", write(tmp_path / "b.yaml", CONFIG), ctx)
    assert code == 0, err
    theirs = mine.id + 1

    def by_sdk(verb: str) -> None:
        getattr(mine, verb)()

    def by_cli(verb: str) -> None:
        code, _, err = det("e", verb, str(theirs))
        assert code == 0, err

    runs: dict[str, list[tuple[str, list[list[str]], int]]] = {}
    for name, exp_id, do in (("sdk", mine.id, by_sdk), ("cli", theirs, by_cli)):
        effects, job = Effects(fake, started), _job(exp_id)
        capsys.readouterr()
        runs[name] = []
        for verb in ("pause", "activate", "kill"):
            do(verb)
            runs[name].append((verb, *effects.step(job)))
        if name == "sdk":
            assert capsys.readouterr().out == ""  # the SDK prints nothing
    # Slurm is told at once: the queued job canceled on pause, the daemon started on activate,
    # every live job canceled on kill.
    assert runs["sdk"] == [
        ("pause", [["scancel", "--state=PENDING", "JOB"]], 0),
        ("activate", [], 1),
        ("kill", [["scancel", "JOB"]], 0),
    ]
    assert runs["sdk"] == runs["cli"]
    assert mine.state == sdk_client.ExperimentState.STOPPING_KILLED
    # The paused run was marked as detslurm's own cancel (no restart spent), as `det e pause` marks it.
    with open_store_of_settings().read() as s:
        reasons = {r.trial.experiment_id: r.exit_reason for r in s.query(TrialRun).all()}
    assert reasons[mine.id] == reasons[theirs] is not None


def test_trial_kill_cancels_its_job_at_once_as_det_t_kill_does(sdk: Any, det: Any, tmp_path: Path) -> None:
    sdk_client, fake, started = sdk
    ctx = write(tmp_path / "ctx" / "train.py", "pass\n").parent
    mine = sdk_client.create_experiment(write(tmp_path / "a.yaml", CONFIG), str(ctx))
    code, _, err = det("e", "create", write(tmp_path / "b.yaml", CONFIG), ctx)
    assert code == 0, err
    effects = Effects(fake, started)
    (trial,) = mine.list_trials()
    trial.kill()
    by_sdk = effects.step(_job(mine.id))
    code, _, err = det("t", "kill", str(trial.id + 1))
    assert code == 0, err
    assert by_sdk == ([["scancel", "JOB"]], 0) == effects.step(_job(mine.id + 1))
    # A cancel is the row only (the trials checkpoint first), in the SDK as in `det e cancel`.
    other = sdk_client.create_experiment(write(tmp_path / "c.yaml", CONFIG), str(ctx))
    effects.step("")
    other.cancel()
    assert effects.step(_job(other.id)) == ([], 0)
    assert other.state == sdk_client.ExperimentState.STOPPING_CANCELED


def test_a_failed_scancel_is_a_warning_and_the_kill_stands(sdk: Any, tmp_path: Path, caplog: Any) -> None:
    sdk_client, fake, _ = sdk
    exp = sdk_client.create_experiment(write(tmp_path / "a.yaml", CONFIG))
    fake.scancel = 1  # Slurm's controller cannot be reached
    exp.kill()
    assert exp.state == sdk_client.ExperimentState.STOPPING_KILLED
    assert "the daemon will do it at its next tick" in caplog.text
    with open_store_of_settings().read() as s:
        assert [r.state for r in s.query(TrialRun).all()] == [RunState.QUEUED]


def open_store_of_settings() -> Any:
    from detslurm import settings

    return open_store(settings.load().db_url)
