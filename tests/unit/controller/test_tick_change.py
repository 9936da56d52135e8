"""A tick whose change is one event walks only the trial it changed: counts of the
Trial rows the ORM loads (a SQLAlchemy ``load`` event) and of SELECTs, never times. The
controller runs the real SlurmClient and SlurmExecutor over bench/tick_cost.py's held-queue fake.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from sqlalchemy import event, select

sys.path.insert(0, str(ROOT / "bench"))
import tick_cost

from detslurm.controller import ops
from detslurm.controller.changes import TickMemory
from detslurm.controller.controller import Controller
from detslurm.controller.reconcile import load_searcher
from detslurm.controller.slurm_executor import SlurmExecutor
from detslurm.protocol import Metrics, OpCompleted, PreemptAck, RunPaths
from detslurm.searcher import SearchMethod
from detslurm.slurm.client import SlurmClient
from detslurm.slurm.site import SiteConfig
from detslurm.store.models import Experiment, ExperimentState, Trial, TrialRun, TrialState

TRIALS = 12


class Loaded:
    """The ids of the Trial rows the ORM builds while it listens."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, target: Trial, context: Any) -> None:
        self.ids.append(target.id)


@pytest.fixture
def loaded() -> Iterator[Loaded]:
    seen = Loaded()
    event.listen(Trial, "load", seen)
    yield seen
    event.remove(Trial, "load", seen)


@pytest.fixture
def held(det_env: Path) -> tuple[Controller, tick_cost.FakeSlurm, int]:
    ctl, fake, exp_id = tick_cost.build(det_env, TRIALS)
    ctl.tick()  # steady: the first ticks' submissions are behind it
    return ctl, fake, exp_id


def trial_of(ctl: Controller, run_dir: Path) -> Trial:
    with ctl.store.read() as s:
        trial = s.scalar(select(Trial).join(TrialRun).where(TrialRun.run_dir == str(run_dir)))
        assert trial is not None
        return trial


def validation(loss: float, batches: int = 1) -> Metrics:
    return Metrics(group="validation", steps_completed=batches, metrics={"loss": loss, "batches": batches})


def test_a_validation_loads_only_its_trial(held: tuple, loaded: Loaded) -> None:
    ctl, fake, exp_id = held
    run_dir, _ = tick_cost.nth_run(ctl, exp_id, 4)
    tick_cost.append_event(run_dir, validation(0.25))
    loaded.ids.clear()
    ctl.tick()
    trial = trial_of(ctl, run_dir)
    assert trial.searcher_metric == 0.25
    # Reconcile, transitions and files each load that one trial; none of the other eleven.
    assert set(loaded.ids) == {trial.id}
    loaded.ids.clear()
    ctl.tick()  # and after it, an idle tick loads nothing
    assert loaded.ids == []


def test_an_op_completed_loads_only_its_trial(held: tuple, loaded: Loaded) -> None:
    ctl, fake, exp_id = held
    run_dir, _ = tick_cost.nth_run(ctl, exp_id, 7)
    tick_cost.append_event(run_dir, OpCompleted(index=0, length=1, metric=0.5))
    loaded.ids.clear()
    ctl.tick()
    trial = trial_of(ctl, run_dir)
    assert trial.ops_completed == 1
    assert set(loaded.ids) == {trial.id}


def test_a_trial_ending_loads_only_its_trial(held: tuple, loaded: Loaded) -> None:
    ctl, fake, exp_id = held
    run_dir, job = tick_cost.nth_run(ctl, exp_id, 2)
    tick_cost.end_job(fake, run_dir, job)
    loaded.ids.clear()
    ctl.tick()
    trial = trial_of(ctl, run_dir)
    assert trial.state == TrialState.COMPLETED
    assert set(loaded.ids) == {trial.id}
    with ctl.store.read() as s:
        assert s.get(Experiment, exp_id).state == ExperimentState.ACTIVE  # eleven trials still run


def own_store(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """This process's detslurm dirs (and so its store) below ``root``."""
    root.mkdir()
    for var, sub in (("DATA", "data"), ("EXPERIMENTS", "exps"), ("CHECKPOINT", "ck")):
        monkeypatch.setenv(f"DETSLURM_{var}_DIR", str(root / sub))


def test_selects_of_a_changed_tick_do_not_grow_with_trials(det_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same change costs the same queries at 4 and at 16 trials (no query per trial)."""
    counts = []
    for n in (4, 16):
        own_store(monkeypatch, det_env / str(n))
        ctl, fake, exp_id = tick_cost.build(det_env / str(n), n)
        ctl.tick()
        statements: list[str] = []

        def seen(conn: Any, cursor: Any, statement: str, *rest: Any, into: list[str] = statements) -> None:
            into.append(statement)

        run_dir, _ = tick_cost.nth_run(ctl, exp_id, 1)
        tick_cost.append_event(run_dir, validation(0.5))
        event.listen(ctl.store.engine, "before_cursor_execute", seen)
        ctl.tick()
        event.remove(ctl.store.engine, "before_cursor_execute", seen)
        counts.append(sum(1 for st in statements if st.lstrip().upper().startswith("SELECT")))
        ctl.store.dispose()
    assert counts[0] == counts[1]


def test_the_last_trial_ending_completes_the_experiment(held: tuple) -> None:
    ctl, fake, exp_id = held
    for n in range(TRIALS):
        run_dir, job = tick_cost.nth_run(ctl, exp_id, n)
        tick_cost.end_job(fake, run_dir, job)
        ctl.tick()
        with ctl.store.read() as s:
            state = s.get(Experiment, exp_id).state
        # Each tick looks at one trial, yet sees when it was the last one.
        assert state == (ExperimentState.COMPLETED if n == TRIALS - 1 else ExperimentState.ACTIVE)


def test_a_replacement_trial_is_submitted_in_the_tick_its_predecessor_ends(det_env: Path) -> None:
    search = (
        "hyperparameters: {x: {type: int, minval: 0, maxval: 5, count: 6}}\n"
        "searcher: {name: grid, metric: loss, max_length: {batches: 1}, max_concurrent_trials: 2}\n"
    )
    ctl, fake, exp_id = tick_cost.build(det_env, 6, search=search)
    ctl.tick()
    sbatches = fake.calls["sbatch"]
    run_dir, job = tick_cost.nth_run(ctl, exp_id, 0)
    tick_cost.end_job(fake, run_dir, job)
    ctl.tick()
    assert fake.calls["sbatch"] == sbatches + 1
    with ctl.store.read() as s:
        trials = list(s.scalars(select(Trial).where(Trial.experiment_id == exp_id).order_by(Trial.id)))
    assert [t.state for t in trials] == [TrialState.COMPLETED, TrialState.ACTIVE, TrialState.ACTIVE]
    assert [len(t.runs) for t in trials] == [1, 1, 1]


def test_a_pause_then_activate_reaches_every_trial(held: tuple) -> None:
    ctl, fake, exp_id = held
    ops.pause(ctl.store, exp_id)
    ctl.tick()
    with ctl.store.read() as s:
        dirs = list(s.scalars(select(TrialRun.run_dir).join(Trial).where(Trial.experiment_id == exp_id)))
    assert all(RunPaths.from_run_dir(Path(d)).control.exists() for d in dirs)
    # Every run acknowledges the pause and its job ends; the trials wait, paused, and resume
    # on activate.
    for n in range(TRIALS):
        run_dir, job = tick_cost.nth_run(ctl, exp_id, n)
        tick_cost.append_event(run_dir, PreemptAck())
        tick_cost.end_job(fake, run_dir, job)
    ctl.tick()
    ctl.tick()
    with ctl.store.read() as s:
        states = set(s.scalars(select(Trial.state).where(Trial.experiment_id == exp_id)))
    assert states == {TrialState.PAUSED}
    sbatches = fake.calls["sbatch"]
    ops.activate(ctl.store, exp_id)
    ctl.tick()
    assert fake.calls["sbatch"] > sbatches
    with ctl.store.read() as s:
        live = s.scalars(select(TrialRun).join(Trial).where(Trial.experiment_id == exp_id))
        assert sum(1 for r in live if r.run_id == 2) == TRIALS


ASHA = (
    "hyperparameters: {x: {type: double, minval: 0, maxval: 1}}\n"
    "reproducibility: {experiment_seed: 11}\n"
    "searcher: {name: adaptive_asha, metric: loss, smaller_is_better: true, max_trials: 10, max_time: 16,\n"
    "  time_metric: batches, divisor: 2, max_rungs: 3, mode: aggressive, max_concurrent_trials: 4}\n"
)


def drive_asha(det_env: Path, monkeypatch: pytest.MonkeyPatch, name: str, fresh: bool) -> list[tuple[Any, ...]]:
    """An ASHA search fed the same validations round after round, by one controller (its
    searcher kept in memory) or by a new controller every tick (loaded from the store)."""
    own_store(monkeypatch, det_env / name)
    ctl, fake, exp_id = tick_cost.build(det_env / name, 4, search=ASHA)
    for k in range(6):
        with ctl.store.read() as s:
            q = select(TrialRun.run_dir, TrialRun.job_id, Trial.id, Trial.early_stopped).join(Trial)
            live = s.execute(q.where(TrialRun.state.in_(["QUEUED", "RUNNING"])).order_by(TrialRun.id)).all()
        for run_dir, job, trial_id, stopped in live:
            if stopped:
                tick_cost.end_job(fake, Path(run_dir), job)
            else:
                loss = ((trial_id * 7919 + k * 31) % 97) / 97
                tick_cost.append_event(Path(run_dir), validation(loss, 4 * (k + 1)))
        if fresh:
            ctl = Controller(ctl.store, SlurmExecutor(SlurmClient(fake, user="bench"), SiteConfig()))
        ctl.tick()
    with ctl.store.read() as s:
        exp = s.get(Experiment, exp_id)
        trials = list(s.scalars(select(Trial).where(Trial.experiment_id == exp_id).order_by(Trial.id)))
        out = [(t.request_id, t.state, t.early_stopped, t.searcher_metric) for t in trials]
        out.append((exp.state, exp.searcher_state))
    ctl.store.dispose()
    return out


def test_asha_decides_the_same_with_its_searcher_kept_or_reloaded(
    det_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = drive_asha(det_env, monkeypatch, "kept", fresh=False)
    reloaded = drive_asha(det_env, monkeypatch, "reloaded", fresh=True)
    assert kept == reloaded
    assert len(kept) > 5  # the search created trials beyond its first four
    assert any(row[2] for row in kept[:-1])  # and stopped some


def test_a_kept_searcher_is_used_only_while_the_store_agrees() -> None:
    exp = Experiment(id=1, config={"searcher": {"name": "x"}}, searcher_state={"n": 1})
    loads: list[int] = []

    def load(e: Experiment) -> SearchMethod:
        loads.append(e.id)
        return SearchMethod(0)

    memory = TickMemory()
    first = memory.take_searcher(exp, load)
    memory.keep_searcher(1, first, {"n": 1}, exp.config)
    assert memory.take_searcher(exp, load) is first and loads == [1]
    # Taken and not kept again (its transaction failed): loaded afresh next time.
    assert memory.take_searcher(exp, load) is not first and loads == [1, 1]
    # Another writer changed the stored state (det e continue): the kept one is stale.
    memory.keep_searcher(1, first, {"n": 1}, exp.config)
    exp.searcher_state = {"n": 2}
    assert memory.take_searcher(exp, load) is not first and loads == [1, 1, 1]


def test_a_restarted_controller_steps_every_trial_once(held: tuple, loaded: Loaded) -> None:
    ctl, fake, exp_id = held
    again = Controller(ctl.store, SlurmExecutor(SlurmClient(fake, user="bench"), SiteConfig()))
    loaded.ids.clear()
    again.tick()
    assert len(set(loaded.ids)) == TRIALS  # memory is a cache: a new controller looks at everything
    loaded.ids.clear()
    again.tick()
    assert loaded.ids == []


def test_load_searcher_is_what_a_kept_one_replaces(held: tuple) -> None:
    """The kept searcher holds exactly the stored state (what a reload would give)."""
    ctl, fake, exp_id = held
    run_dir, _ = tick_cost.nth_run(ctl, exp_id, 0)
    tick_cost.append_event(run_dir, validation(0.1))
    ctl.tick()
    kept = ctl.memory.searchers[exp_id]
    with ctl.store.read() as s:
        exp = s.get(Experiment, exp_id)
        assert kept.searcher.state_dict() == load_searcher(exp).state_dict() == exp.searcher_state


def four_trial_grid(tmp_path: Path) -> tuple[Any, Any, list[int]]:
    """A grid of four trials, created and not yet submitted: (store, its ExpPaths, trial ids)."""
    from detslurm import settings
    from detslurm.controller.create import execute_create, plan_create
    from detslurm.protocol import ExpPaths
    from detslurm.store import open_store

    s = settings.load()
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "c.yaml").write_text(
        "name: four\nentrypoint: python3 x.py\nhyperparameters: {x: {type: int, minval: 0, maxval: 3, count: 4}}\n"
        "searcher: {name: grid, metric: loss, max_length: {batches: 1}, max_concurrent_trials: 4}\n"
    )
    store = open_store(s.db_url)
    exp_id = execute_create(store, s, plan_create(s, ctx / "c.yaml", ctx), "slurm")
    with store.read() as sess:
        exp = sess.get(Experiment, exp_id)
        assert exp is not None
        return store, ExpPaths(Path(exp.exp_dir)), sorted(t.id for t in exp.trials)


def test_a_link_planted_where_an_arrays_links_go_is_replaced_not_followed(det_env: Path, tmp_path: Path) -> None:
    """The experiment dir is the trials' to write: a symlink at a job array's links dir (its
    name is predictable) is removed, not followed or rmtree'd, and the array is submitted."""
    store, layout, trials = four_trial_grid(tmp_path)
    links = layout.array_links(trials[0], 1)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("p")
    links.parent.mkdir(parents=True, exist_ok=True)
    links.symlink_to(victim, target_is_directory=True)
    fake = tick_cost.FakeSlurm()
    Controller(store, SlurmExecutor(SlurmClient(fake, user="bench"), SiteConfig())).tick()
    assert fake.calls.get("sbatch") == 1  # the array went out
    assert os.listdir(victim) == ["precious"] and not links.is_symlink() and links.is_dir()


def test_a_run_dir_a_trial_spoiled_fails_that_run_only(det_env: Path, tmp_path: Path) -> None:
    """A directory where one run's secret goes (a trial can write into its next run's place)
    fails that run's submission, as a refused sbatch would; the other trials go out."""
    store, layout, trials = four_trial_grid(tmp_path)
    (layout.run_dir(trials[1], 1) / "run-secret").mkdir(parents=True)
    fake = tick_cost.FakeSlurm()
    Controller(store, SlurmExecutor(SlurmClient(fake, user="bench"), SiteConfig())).tick()
    with store.read() as s:
        jobs = {r.trial_id: r.job_id for r in s.scalars(select(TrialRun))}
    assert fake.calls.get("sbatch") == 1
    assert jobs[trials[1]] is None and all(jobs[t] for t in trials if t != trials[1])
