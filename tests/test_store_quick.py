"""The read commands' fast path (issue 15): store.quick answers what the ORM answers, serves
only a store whose schema is current, and `det e list` / `det t logs` load no ORM through it."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, write
from sqlalchemy import insert

from detslurm import settings, views
from detslurm.cli.experiment import WORKLOADS_SHOWN
from detslurm.controller.create import execute_create, plan_create
from detslurm.identity import Scope, os_user
from detslurm.store import (
    Experiment,
    ExperimentState,
    LogEntry,
    Metric,
    RunState,
    Trial,
    TrialRun,
    TrialState,
    open_store,
)
from detslurm.store.quick import (
    TERMINAL_EXPERIMENT_STATES,
    TERMINAL_TRIAL_STATES,
    QuickStore,
    experiment_filter_rows,
)

CONFIG = "name: q\nentrypoint: python3 train.py\nsearcher: {name: single, metric: loss}\n"


def _store_with_experiments(tmp_path: Path) -> tuple[str, int]:
    """A store with experiments of two owners, archived and not, ended and not, plus one
    experiment with a trial, two runs and notes; (url, that trial's id)."""
    st = settings.load()
    store = open_store(st.db_url)
    write(tmp_path / "ctx" / "train.py", "pass\n")
    exp_id = execute_create(store, st, plan_create(st, write(tmp_path / "c.yaml", CONFIG), tmp_path / "ctx"), "slurm")
    start = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    with store.tx() as s:
        cfg = s.get(Experiment, exp_id).config  # type: ignore[union-attr]
        rows: list[dict[str, Any]] = [
            {
                "name": f"Exp-{i}",
                "owner": os_user() if i % 3 else "someone-else",
                "state": [ExperimentState.COMPLETED, ExperimentState.ACTIVE, ExperimentState.ERROR][i % 3],
                "config": cfg,
                "original_config": "",
                "context_sha256": "0" * 64,
                "exp_dir": f"/nonexistent/{i}",
                "executor": "slurm" if i % 2 else "local",
                "resource_pool": "cpu",
                "progress": i / 10,
                "archived": i % 4 == 0,
                "parent_id": exp_id if i == 5 else None,
                "start_time": start,
                "end_time": None if i % 2 else start,
            }
            for i in range(12)
        ]
        s.execute(insert(Experiment), rows)
        trial = Trial(experiment_id=exp_id, request_id="r", hparams={}, seed=1)
        s.add(trial)
        s.flush()
        for run_id, started in ((1, start), (2, None)):
            s.add(
                TrialRun(
                    trial_id=trial.id,
                    run_id=run_id,
                    executor="slurm",
                    run_dir=f"/x/{run_id}",
                    log_path=f"/x/{run_id}/out.log",
                    start_time=started,
                    submit_time=start,
                )
            )
        s.add(LogEntry(trial_id=trial.id, message="first", level="INFO", time=start))
        s.add(LogEntry(trial_id=trial.id, message="second", level="WARNING", time=start))
        tid = trial.id
    store.dispose()
    return st.db_url, tid


def test_quick_answers_what_the_orm_answers(det_env: Path, tmp_path: Path) -> None:
    url, tid = _store_with_experiments(tmp_path)
    quick = QuickStore.open(url)
    assert quick is not None
    store = open_store(url)
    with store.read() as s:
        for scope in (Scope.mine(), Scope(owner=None), Scope(owner="someone-else")):
            for archived in (False, True):
                orm = views.experiment_rows(s, scope, include_archived=archived)
                assert quick.experiment_rows(scope.owner, include_archived=archived) == orm
                assert len(orm) > 1
        for executor in ("slurm", "local", "none"):
            for owner in (os_user(), "someone-else", "nobody"):
                assert quick.has_unfinished(executor, owner) == views.has_unfinished(s, executor, owner)
        runs = views.runs(s, tid)
        notes = views.notes(s, tid)
        expected_runs = [(r.run_id, r.log_path, r.start_time or r.submit_time, r.end_time) for r in runs]
        expected_notes = [(n.time, n.level, n.message) for n in notes]
    found = quick.trial_logs(tid, os_user())
    assert found is not None
    assert [tuple(r) for r in found[0]] == expected_runs and len(expected_runs) == 2
    assert [tuple(n) for n in found[1]] == expected_notes and len(expected_notes) == 2
    # Another user's trial and a missing one look the same: None (reported "not found").
    assert quick.trial_logs(tid, "someone-else") is None
    assert quick.trial_logs(tid + 1000, None) is None
    assert quick.trial_logs(tid, None) is not None
    rows = quick.experiment_rows(None, include_archived=True)
    assert [r.name for r in experiment_filter_rows(rows, states=["error"], name="exp-1")] == ["Exp-11"]
    quick.close()


def test_terminal_states_match_the_model() -> None:
    assert set(TERMINAL_EXPERIMENT_STATES) == {st.value for st in ExperimentState if st.is_terminal}


def test_quick_serves_only_a_current_sqlite_store(det_env: Path, tmp_path: Path) -> None:
    assert QuickStore.open("postgresql+psycopg://u@h/db") is None
    assert QuickStore.open("sqlite://") is None
    assert QuickStore.open(f"sqlite:///{tmp_path}/missing.db") is None  # and creates nothing
    assert not (tmp_path / "missing.db").exists()
    url = settings.load().db_url
    open_store(url).dispose()
    quick = QuickStore.open(url)
    assert quick is not None
    quick.close()
    db = url.split("///", 1)[-1]
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE alembic_version SET version_num = '0002'")  # an older schema: the ORM migrates
    con.close()
    assert QuickStore.open(url) is None


def test_quick_store_is_read_only(det_env: Path) -> None:
    url = settings.load().db_url
    open_store(url).dispose()
    quick = QuickStore.open(url)
    assert quick is not None
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        quick._con.execute("DELETE FROM experiments")
    quick.close()


PROBE = """
import sys
from detslurm.cli.main import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("sqlalchemy", "pydantic", "alembic", "jinja2") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


def _probe(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    p = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
        timeout=120,
    )
    heavy = [ln for ln in p.stderr.splitlines() if ln.startswith("HEAVY=")]
    assert heavy, p.stderr
    return p.returncode, p.stdout, heavy[-1].removeprefix("HEAVY=")


def _all_ended(url: str) -> None:
    """Nothing left to reconcile: a read with no daemon then asks Slurm nothing (and needs no ORM)."""
    con = sqlite3.connect(url.split("///", 1)[-1])
    with con:
        con.execute("UPDATE experiments SET state = 'COMPLETED'")
    con.close()


def test_read_commands_load_no_orm(det_env: Path, tmp_path: Path) -> None:
    url, tid = _store_with_experiments(tmp_path)
    _all_ended(url)
    code, out, heavy = _probe("e", "list")
    assert code == 0 and "Exp-1 " in out and heavy == ""
    code, out, heavy = _probe("t", "logs", str(tid), "--tail", "5")
    assert code == 0 and "detslurm || WARNING: second" in out and heavy == ""
    code, _out, heavy = _probe("--help")
    assert code == 0 and heavy == ""
    # What the fast path cannot answer still goes through the ORM, with the same output.
    code, out, heavy = _probe("e", "list", "--json")
    assert code == 0 and "sqlalchemy" in heavy and json.loads(out)


def test_e_list_output_is_the_orm_paths(det_env: Path, tmp_path: Path) -> None:
    _all_ended(_store_with_experiments(tmp_path)[0])
    db = settings.load().db_url.split("///", 1)[-1]
    # The same store through a URL the fast path leaves to SQLAlchemy (a query string).
    orm_env = {"DETSLURM_DB_URL": f"sqlite:///{db}?timeout=30"}
    for args in (["e", "list"], ["e", "list", "-a"], ["e", "list", "--state", "completed", "--csv"], ["e", "ls", "-a"]):
        code, fast, heavy = _probe(*args)
        assert code == 0 and heavy == "" and fast.count("\n") > 2, args
        code, slow, heavy = _probe(*args, env=orm_env)
        assert code == 0 and "sqlalchemy" in heavy, args
        assert slow == fast, args


def test_terminal_trial_states_match_the_model() -> None:
    assert set(TERMINAL_TRIAL_STATES) == {st.value for st in TrialState if st.is_terminal}


def _describe_fixture(url: str, tid: int) -> int:
    """Give ``tid``'s experiment what describe prints: labels, a description, a queued second
    trial with a pending reason, an ended third one, and more workloads than it shows (an
    archived row among them, odd values); returns the experiment id."""
    store = open_store(url)
    when = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=timezone.utc)
    with store.tx() as s:
        trial = s.get(Trial, tid)
        assert trial is not None
        exp = trial.experiment
        exp.config = {**exp.config, "labels": ["a", "b c"]}
        exp.description = "some words"
        trial.hparams = {"lr": 0.1, "nested": {"x": [1, 2]}, "name": "é"}
        waiting = Trial(experiment_id=exp.id, request_id="w", hparams={}, seed=2, runner_state="queued: Resources")
        ended = Trial(experiment_id=exp.id, request_id="e", hparams={}, seed=3, state=TrialState.ERROR)
        ended.exit_reason = "the job failed"
        s.add_all([waiting, ended])
        s.flush()
        s.add(
            TrialRun(
                trial_id=waiting.id, run_id=1, executor="slurm", run_dir="/w", log_path="/w/o", state=RunState.QUEUED
            )
        )
        rows = [
            {
                "trial_id": tid,
                "run_id": 1,
                "group": "validation" if i % 7 == 0 else "training",
                "steps_completed": i // 2,  # two reports per step: the id orders them
                "metrics": {"loss": 1.0 / (i + 1), "acc": "NaN", "deep": {"k": [i]}},
                "batch_metrics": None,
                "report_time": when,
                "archived": i == 1200,
            }
            for i in range(WORKLOADS_SHOWN + 300)
        ]
        s.execute(insert(Metric), rows)
        s.execute(insert(Metric), [{**rows[0], "trial_id": ended.id, "steps_completed": 5}])
        exp_id = exp.id
    store.dispose()
    return exp_id


def test_e_describe_output_is_the_orm_paths(det_env: Path, tmp_path: Path) -> None:
    url, tid = _store_with_experiments(tmp_path)
    exp_id = _describe_fixture(url, tid)
    _all_ended(url)
    db = url.split("///", 1)[-1]
    orm_env = {"DETSLURM_DB_URL": f"sqlite:///{db}?timeout=30"}
    code, fast, heavy = _probe("e", "describe", str(exp_id))
    assert code == 0 and heavy == "", fast
    code, slow, heavy = _probe("e", "describe", str(exp_id), env=orm_env)
    assert code == 0 and "sqlalchemy" in heavy
    assert slow == fast
    # What the table holds, so that two equally wrong paths cannot pass.
    assert "a, b c" in fast and "some words" in fast and "waiting for free nodes (Resources)" in fast
    assert "the job failed" in fast and f"Trial {tid}: only its last {WORKLOADS_SHOWN} workloads" in fast
    assert fast.count('"deep": {"k": [') == WORKLOADS_SHOWN + 1  # the last 1000 of one trial, 1 of another
    # Not found: the fast path leaves it to the ORM path, which says so the same way.
    code, missing, _ = _probe("e", "describe", str(exp_id + 1000))
    assert code != 0 and missing == _probe("e", "describe", str(exp_id + 1000), env=orm_env)[1]


def test_quick_describe_leaves_the_rest_to_the_orm(det_env: Path, tmp_path: Path) -> None:
    url, tid = _store_with_experiments(tmp_path)
    exp_id = _describe_fixture(url, tid)
    quick = QuickStore.open(url)
    assert quick is not None
    got = quick.describe(exp_id, os_user(), 10)
    # The experiment's first trial (from create), the one with workloads, the queued one, the ended one.
    assert got is not None and [len(w) for w, _ in got.workloads.values()] == [0, 10, 0, 1]
    assert [more for _, more in got.workloads.values()] == [False, True, False, False]
    assert got.searcher_metric == "loss" and [t.queued for t in got.trials] == [False, False, True, False]
    # Another user's experiment is not served (the ORM path says "not found").
    assert quick.describe(exp_id, "someone-else", 10) is None
    con = sqlite3.connect(url.split("///", 1)[-1])
    with con:  # a measured stop time: its warning needs the typed config and Slurm
        con.execute("UPDATE trial_runs SET preempt_stop_s = 3.5 WHERE trial_id = ?", (tid,))
    con.close()
    assert quick.describe(exp_id, os_user(), 10) is None
    quick.close()


def test_a_relative_sqlite_path_is_read_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sqlite:///rel.db is relative to the current dir, for the fast path as for the ORM."""
    from detslurm.store import open_store
    from detslurm.store.quick import QuickStore

    monkeypatch.chdir(tmp_path)
    open_store("sqlite:///rel.db").dispose()
    assert QuickStore.open("sqlite:///rel.db") is not None
