"""The read layer (store.reads): every read command asks it; it answers what the ORM's rows
hold, on the standard library's sqlite3 and through the ORM store's connection alike; its SQL
prepares against the models' tables; and the read commands load no ORM through it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, write
from sqlalchemy import create_engine, insert, select

from detslurm import settings
from detslurm.cli.experiment import WORKLOADS_SHOWN
from detslurm.controller.create import execute_create, plan_create
from detslurm.errors import NotFoundError
from detslurm.identity import os_user
from detslurm.store import (
    Checkpoint,
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
from detslurm.store.models import Base
from detslurm.store.reads import SQL, Reads, experiment_filter_rows

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


def _both(url: str) -> list[Reads]:
    """The two ways the layer runs: sqlite3 on the file, and the ORM store's connection (the
    PostgreSQL path; a URL with options takes it on SQLite too)."""
    fast = Reads.open_sqlite(url)
    assert fast is not None
    return [fast, Reads.of_store(open_store(url + "?timeout=30"))]


def test_reads_answer_what_the_orm_rows_hold(det_env: Path, tmp_path: Path) -> None:
    url, tid = _store_with_experiments(tmp_path)
    store = open_store(url)
    with store.read() as s:
        exps = list(s.scalars(select(Experiment).order_by(Experiment.id)))
        runs = list(s.scalars(select(TrialRun).where(TrialRun.trial_id == tid).order_by(TrialRun.run_id)))
        notes = list(s.scalars(select(LogEntry).where(LogEntry.trial_id == tid).order_by(LogEntry.id)))
        trial = s.get(Trial, tid)
        assert trial is not None
        exp_id = trial.experiment_id
    for reads in _both(url):
        for owner in (os_user(), None, "someone-else"):
            for archived in (False, True):
                want = [e for e in exps if (owner is None or e.owner == owner) and (archived or not e.archived)]
                got = reads.experiment_rows(owner, include_archived=archived)
                assert [(r.id, r.owner, r.name, r.parent_id, r.state, r.progress, r.archived) for r in got] == [
                    (e.id, e.owner, e.name, e.parent_id, e.state, e.progress, e.archived) for e in want
                ]
                assert len(got) > 1 and all(type(r.state) is ExperimentState for r in got)
                assert [d["labels"] for d in reads.experiment_dicts(owner, archived)] == [
                    e.config.get("labels", []) for e in want
                ]
        for executor in ("slurm", "local", "none"):
            for owner in (os_user(), "someone-else", "nobody"):
                want_any = any(e.executor == executor and e.owner == owner and not e.state.is_terminal for e in exps)
                assert reads.has_unfinished(executor, owner) == want_any
        d, cfg = reads.experiment(exp_id, os_user())
        assert cfg["searcher"]["metric"] == "q" or cfg["searcher"]["metric"] == "loss"
        assert (d["id"], d["state"], d["exp_dir"]) == (exp_id, ExperimentState.ACTIVE, exps[0].exp_dir)
        found_runs, found_notes = reads.trial_logs(tid, os_user())
        assert [tuple(r) for r in found_runs] == [
            (r.run_id, r.log_path, r.start_time or r.submit_time, r.end_time) for r in runs
        ] and len(runs) == 2
        assert [tuple(n) for n in found_notes] == [(n.time, n.level, n.message) for n in notes] and len(notes) == 2
        # Another user's trial and a missing one look the same: "not found".
        for trial_id, owner in ((tid, "someone-else"), (tid + 1000, None)):
            with pytest.raises(NotFoundError, match="trial"):
                reads.trial_logs(trial_id, owner)
        rows = reads.experiment_rows(None, include_archived=True)
        assert [r.name for r in experiment_filter_rows(rows, states=["error"], name="exp-1")] == ["Exp-11"]
        reads.close()


def test_every_statement_prepares_against_the_models_tables(tmp_path: Path) -> None:
    """The SQL names only tables and columns the models define: a renamed or dropped column fails here."""
    engine = create_engine(f"sqlite:///{tmp_path / 'models.sqlite'}")
    Base.metadata.create_all(engine)
    engine.dispose()
    con = sqlite3.connect(tmp_path / "models.sqlite")
    con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
    for name, sql in SQL.items():
        text = sql.format(where="1 = 1", ids=":p0")
        params = {p: None for p in ("executor", "owner", "exp", "trial", "uuid", "queued", "n", "p0")}
        params |= {f"t{j}": None for j in range(10)}
        con.execute(f"EXPLAIN {text}", params)  # prepared: unknown tables or columns raise
        assert name and "quick" not in text
    bad = SQL["metrics"].replace("steps_completed", "steps_done", 1)
    with pytest.raises(sqlite3.OperationalError, match="no such column"):
        con.execute(f"EXPLAIN {bad}", {"trial": 1})
    con.close()


def test_sqlite3_serves_only_a_current_sqlite_store(det_env: Path, tmp_path: Path) -> None:
    assert Reads.open_sqlite("postgresql+psycopg://u@h/db") is None
    assert Reads.open_sqlite("sqlite://") is None
    assert Reads.open_sqlite(f"sqlite:///{tmp_path}/missing.db") is None  # and creates nothing
    assert not (tmp_path / "missing.db").exists()
    url = settings.load().db_url
    open_store(url).dispose()
    reads = Reads.open_sqlite(url)
    assert reads is not None
    reads.close()
    db = url.split("///", 1)[-1]
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE alembic_version SET version_num = '0002'")  # an older schema: the ORM migrates
    con.close()
    assert Reads.open_sqlite(url) is None


def test_the_sqlite3_connection_is_read_only(det_env: Path) -> None:
    url = settings.load().db_url
    open_store(url).dispose()
    reads = Reads.open_sqlite(url)
    assert reads is not None
    with pytest.raises(sqlite3.OperationalError, match="readonly"), reads._begin() as run:
        run("DELETE FROM experiments", {})
    reads.close()


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


# Every read command of the CLI, with what must show in its output ({exp}, {tid}, {uuid} filled in).
READ_COMMANDS = [
    (["e", "list"], "Exp-1 "),
    (["e", "list", "-a"], "Exp-4 "),
    (["e", "list", "--state", "completed", "--csv"], "Exp-2,"),
    (["e", "ls", "--json"], '"labels"'),
    (["e", "list", "--label", "a"], "q"),
    (["e", "describe", "{exp}"], "Workloads:"),
    (["e", "describe", "{exp}", "--json"], '"trials"'),
    (["e", "list-trials", "{exp}"], "# of Batches"),
    (["e", "lt", "{exp}", "--json"], '"batches"'),
    (["e", "list-checkpoints", "{exp}"], "{uuid}"),
    (["e", "lc", "{exp}", "--best", "1", "--json"], "{uuid}"),
    (["e", "config", "{exp}"], "searcher:"),
    (["e", "logs", "{exp}", "--tail", "5"], ""),  # its first trial (create's) has written nothing
    (["t", "describe", "{tid}", "--metrics"], "Metrics:"),
    (["t", "describe", "{tid}", "--json"], '"runs"'),
    (["t", "logs", "{tid}", "--tail", "5"], "detslurm || WARNING: second"),
    (["checkpoint", "list", "{exp}"], "{uuid}"),
    (["c", "list", "{exp}", "--json"], '"validation_metric": 0.5'),
    (["c", "describe", "{uuid}"], "{uuid}"),
]


def _read_store(tmp_path: Path) -> dict[str, str]:
    """The store every read command is run on: labels, workloads, a checkpoint with its
    validation, notes; nothing left to reconcile (a read then asks Slurm nothing)."""
    url, tid = _store_with_experiments(tmp_path)
    exp_id = _describe_fixture(url, tid)
    store = open_store(url)
    with store.tx() as s:
        s.add(
            Checkpoint(
                uuid="ck-1",
                trial_id=tid,
                run_id=1,
                steps_completed=5000,
                storage_path="/ck",
                metadata_={"k": 1},
                resources={"a": 1},
                size=2048,
                report_time=datetime(2026, 1, 2, tzinfo=timezone.utc),
            )
        )
        s.execute(
            insert(Metric),
            [
                {
                    "trial_id": tid,
                    "run_id": 1,
                    "group": "validation",
                    "steps_completed": 5000,
                    "metrics": {"loss": 0.5},
                    "report_time": datetime(2026, 1, 2, tzinfo=timezone.utc),
                    "archived": False,
                }
            ],
        )
    store.dispose()
    _all_ended(url)
    return {"exp": str(exp_id), "tid": str(tid), "uuid": "ck-1", "url": url}


def test_read_commands_load_no_orm(det_env: Path, tmp_path: Path) -> None:
    ids = _read_store(tmp_path)
    for args, shown in READ_COMMANDS:
        argv = [a.format(**ids) for a in args]
        code, out, heavy = _probe(*argv)
        assert code == 0 and shown.format(**ids) in out and heavy == "", (argv, out[-2000:], heavy)
    code, _out, heavy = _probe("--help")
    assert code == 0 and heavy == ""


def test_read_commands_answer_the_same_through_the_orm_store(det_env: Path, tmp_path: Path) -> None:
    """sqlite3 and the ORM store's connection (PostgreSQL's path; a URL with options takes it
    on SQLite too) print the same for every read command, "not found" included."""
    ids = _read_store(tmp_path)
    db = ids["url"].split("///", 1)[-1]
    orm_env = {"DETSLURM_DB_URL": f"sqlite:///{db}?timeout=30"}
    missing = [(["e", "describe", "999"], ""), (["t", "describe", "999"], ""), (["c", "describe", "nope"], "")]
    for args, _ in READ_COMMANDS + missing:
        argv = [a.format(**ids) for a in args]
        fast = _probe(*argv)
        slow = _probe(*argv, env=orm_env)
        assert "sqlalchemy" in slow[2], argv
        assert slow[:2] == fast[:2], argv
    assert "experiment 999 not found" in _probe("e", "describe", "999")[1] + _probe_err("e", "describe", "999")


def _probe_err(*args: str) -> str:
    p = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        cwd=ROOT,
        timeout=120,
    )
    return p.stderr


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


def test_e_describe_shows_what_the_store_holds(det_env: Path, tmp_path: Path) -> None:
    url, tid = _store_with_experiments(tmp_path)
    exp_id = _describe_fixture(url, tid)
    _all_ended(url)
    code, out, heavy = _probe("e", "describe", str(exp_id))
    assert code == 0 and heavy == "", out
    assert "a, b c" in out and "some words" in out and "waiting for free nodes (Resources)" in out
    assert "the job failed" in out and f"Trial {tid}: only its last {WORKLOADS_SHOWN} workloads" in out
    assert out.count('"deep": {"k": [') == WORKLOADS_SHOWN + 1  # the last 1000 of one trial, 1 of another
    reads = Reads.open_sqlite(url)
    assert reads is not None
    trials = reads.trial_dicts(exp_id, os_user())
    recent = reads.recent_metrics([t["id"] for t in trials], 10)
    # The experiment's first trial (from create), the one with workloads, the queued one, the ended one.
    assert [len(w) for w, _ in recent.values()] == [0, 10, 0, 1]
    assert [more for _, more in recent.values()] == [False, True, False, False]
    assert [t["pending_reason"] is not None for t in trials] == [False, False, True, False]
    assert [t["state"] for t in trials][-1] is TrialState.ERROR
    with pytest.raises(NotFoundError):  # another user's experiment is not found
        reads.trial_dicts(exp_id, "someone-else")
    reads.close()


def test_a_relative_sqlite_path_is_read_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sqlite:///rel.db is relative to the current dir, for the fast path as for the ORM."""
    from detslurm.store import open_store

    monkeypatch.chdir(tmp_path)
    open_store("sqlite:///rel.db").dispose()
    assert Reads.open_sqlite("sqlite:///rel.db") is not None
