"""A daemon tick costs what changed: counts, never times. The controller runs the
real SlurmClient and SlurmExecutor over bench/tick_cost.py's held-queue fake, with an event
reader that counts what it opens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import ROOT
from sqlalchemy import func, select

sys.path.insert(0, str(ROOT / "bench"))
import tick_cost

from detslurm.controller import ops
from detslurm.controller.controller import Controller
from detslurm.controller.slurm_executor import SlurmExecutor
from detslurm.protocol import Batch, RunPaths, read_lines
from detslurm.slurm.client import SlurmClient
from detslurm.slurm.site import SiteConfig
from detslurm.store.models import Metric, Trial, TrialRun

TRIALS = 12


class CountingReader:
    """The real reader, counting the event files it opens."""

    def __init__(self) -> None:
        self.opened: list[Path] = []

    def __call__(self, path: Path, offset: int) -> Batch:
        self.opened.append(path)
        return read_lines(path, offset)


@pytest.fixture
def held(det_env: Path) -> tuple[Controller, tick_cost.FakeSlurm, int, CountingReader]:
    reader = CountingReader()
    ctl, fake, exp_id = tick_cost.build(det_env, TRIALS, reader)
    return ctl, fake, exp_id, reader


def metric_rows(ctl: Controller) -> int:
    with ctl.store.read() as s:
        return int(s.scalar(select(func.count()).select_from(Metric)) or 0)


def test_idle_tick_opens_no_event_file_and_asks_slurm_once(held: tuple) -> None:
    ctl, fake, exp_id, reader = held
    tick_cost.append_metrics(ctl, exp_id, 20)  # two runs have files now
    ctl.tick()
    reader.opened.clear()
    before = dict(fake.calls)
    for _ in range(3):
        ctl.tick()
    assert reader.opened == []
    assert fake.calls["squeue"] - before["squeue"] == 3
    assert fake.calls.get("sbatch") == before.get("sbatch")  # nothing resubmitted


def test_new_rows_open_only_the_runs_that_grew(held: tuple) -> None:
    ctl, fake, exp_id, reader = held
    ctl.tick()
    reader.opened.clear()
    touched = tick_cost.append_metrics(ctl, exp_id, 30)
    ctl.tick()
    assert touched == 3 and len(reader.opened) == 3
    assert metric_rows(ctl) == 30


def test_a_restarted_controller_sees_everything_once(held: tuple) -> None:
    ctl, fake, exp_id, reader = held
    ctl.tick()
    tick_cost.append_metrics(ctl, exp_id, 20)
    # A new daemon on the same store: empty memory, so it reads every run's files once.
    fresh = CountingReader()
    again = Controller(ctl.store, SlurmExecutor(SlurmClient(fake, user="bench"), SiteConfig()), reader=fresh)
    again.tick()
    assert metric_rows(ctl) == 20
    ctl.tick()  # the old one's memory is stale, the offsets in the store are not
    again.tick()
    assert metric_rows(ctl) == 20


def test_a_pause_from_the_cli_reaches_the_trials_of_an_idle_experiment(held: tuple) -> None:
    ctl, fake, exp_id, reader = held
    ctl.tick()
    ctl.tick()
    ops.pause(ctl.store, exp_id)
    ctl.tick()
    with ctl.store.read() as s:
        dirs = list(s.scalars(select(TrialRun.run_dir).join(Trial).where(Trial.experiment_id == exp_id)))
    assert len(dirs) == TRIALS
    assert all(RunPaths.from_run_dir(Path(d)).control.exists() for d in dirs)


def test_a_file_growing_again_is_read_again(held: tuple) -> None:
    ctl, fake, exp_id, reader = held
    tick_cost.append_metrics(ctl, exp_id, 10)
    ctl.tick()
    tick_cost.append_metrics(ctl, exp_id, 10)  # the same run's file grows
    ctl.tick()
    assert metric_rows(ctl) == 20


def test_a_file_longer_than_one_read_is_finished_without_growing(det_env: Path) -> None:
    # Reads of ~2 lines: the rest of the file must be read on the next ticks although its
    # stamp (size) no longer changes.
    def small(path: Path, offset: int) -> Batch:
        return read_lines(path, offset, max_chunk=400, max_line=300)

    ctl, fake, exp_id = tick_cost.build(det_env, 3, small)
    tick_cost.append_metrics(ctl, exp_id, 10)
    for _ in range(8):
        ctl.tick()
    assert metric_rows(ctl) == 10


def test_a_trial_killed_from_the_cli_is_cancelled_in_slurm(held: tuple) -> None:
    ctl, fake, exp_id, reader = held
    ctl.tick()
    ctl.tick()
    with ctl.store.read() as s:
        trial_id = s.scalar(select(Trial.id).where(Trial.experiment_id == exp_id).order_by(Trial.id))
    before = fake.calls.get("scancel", 0)
    ops.kill_trial(ctl.store, trial_id)
    ctl.tick()
    assert fake.calls.get("scancel", 0) == before + 1


def test_idle_and_changed_ticks_on_postgres(det_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fingerprint reads JSON columns as stored text; PostgreSQL's driver decodes them
    itself, so the same checks run there."""
    from pg_harness import PostgresUnavailable, private_postgres

    try:
        with private_postgres() as url:
            monkeypatch.setenv("DETSLURM_DB_URL", url)
            reader = CountingReader()
            ctl, fake, exp_id = tick_cost.build(det_env, 6, reader)
            assert not ctl.store.is_sqlite
            tick_cost.append_metrics(ctl, exp_id, 20)
            ctl.tick()
            reader.opened.clear()
            ctl.tick()
            assert reader.opened == [] and metric_rows(ctl) == 20
            ops.pause(ctl.store, exp_id)
            ctl.tick()
            with ctl.store.read() as s:
                dirs = list(s.scalars(select(TrialRun.run_dir)))
            assert all(RunPaths.from_run_dir(Path(d)).control.exists() for d in dirs)
            ctl.store.dispose()
    except PostgresUnavailable as e:
        pytest.skip(str(e))
