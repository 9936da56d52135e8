"""Ingest and reads at scale: metric rows go in bulk yet a refused row still
costs only itself; the curve query downsamples; `det e describe` shows a bounded table."""

from __future__ import annotations

import sqlite3
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import write
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from detslurm import settings, views
from detslurm.controller.apply import ingest_run
from detslurm.controller.create import execute_create, plan_create
from detslurm.controller.reconcile import load_searcher
from detslurm.protocol import ExpPaths, Metrics, Progress, encode
from detslurm.store import Experiment, LogEntry, Metric, MetricPoint, Trial, TrialRun, open_store
from detslurm.store.sanitize import JSON_STR_MAX, json_safe

CONFIG = "name: s\nentrypoint: python3 train.py\nsearcher: {name: single, metric: loss}\n"


def _experiment(tmp_path: Path) -> tuple[str, int, int]:
    """(store url, experiment id, trial id) of a one-trial experiment with one run."""
    st = settings.load()
    store = open_store(st.db_url)
    write(tmp_path / "ctx" / "train.py", "pass\n")
    exp_id = execute_create(store, st, plan_create(st, write(tmp_path / "c.yaml", CONFIG), tmp_path / "ctx"), "local")
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        trial = Trial(experiment_id=exp_id, request_id="bulk", hparams={}, seed=1)
        s.add(trial)
        s.flush()
        run_dir = ExpPaths(Path(exp.exp_dir)).run(trial.id, 1).dir
        s.add(TrialRun(trial_id=trial.id, run_id=1, executor="local", run_dir=str(run_dir), log_path="-"))
        tid = trial.id
    store.dispose()
    return st.db_url, exp_id, tid


def _ingest(url: str, exp_id: int, tid: int, events: list[Any]) -> int:
    store = open_store(url)
    with store.read() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        write(ExpPaths(Path(exp.exp_dir)).run(tid, 1).event_file(0), "".join(encode(e) for e in events))
    with store.tx() as s:
        exp, trial = s.get(Experiment, exp_id), s.get(Trial, tid)
        assert exp is not None and trial is not None
        run = s.scalars(select(TrialRun).where(TrialRun.trial_id == tid)).one()
        n = ingest_run(s, exp, trial, run, load_searcher(exp))
    store.dispose()
    return n


def test_bulk_ingest_keeps_order_and_quarantines_a_refused_row_alone(det_env: Path, tmp_path: Path) -> None:
    url, exp_id, tid = _experiment(tmp_path)
    # SQLite takes any value, so a trigger stands in for a database refusing one row (as
    # PostgreSQL refuses an over-long group).
    con = sqlite3.connect(url.split("///", 1)[-1])
    con.execute(
        "CREATE TRIGGER refuse_13 BEFORE INSERT ON metrics WHEN NEW.steps_completed = 13 "
        "BEGIN SELECT RAISE(ABORT, 'refused by the store'); END"
    )
    con.commit()
    con.close()
    events: list[Any] = []
    for step in range(1, 31):
        events.append(Metrics(group="training", steps_completed=step, metrics={"loss": 1.0 / step}))
        if step % 10 == 0:
            events.append(Metrics(group="validation", steps_completed=step, metrics={"loss": 2.0 / step}))
            events.append(Progress(progress=step / 30))
    applied = _ingest(url, exp_id, tid, events)
    assert applied == len(events) - 1  # every event but the refused row
    store = open_store(url)
    with store.read() as s:
        rows = [(g, n) for g, n in s.execute(select(Metric.group, Metric.steps_completed).order_by(Metric.id))]
        trial = s.get(Trial, tid)
        notes = list(s.scalars(select(LogEntry.message).where(LogEntry.level == "WARNING")))
    expected = []
    for step in range(1, 31):
        if step != 13:
            expected.append(("training", step))
        if step % 10 == 0:
            expected.append(("validation", step))
    assert rows == expected  # in the order reported, ids included
    assert trial is not None and trial.progress == 1.0 and trial.searcher_metric == 2.0 / 30
    assert len(notes) == 1 and "quarantined 1 bad event line" in notes[0] and "refused by the store" in notes[0]
    assert _ingest(url, exp_id, tid, events) == 0  # offsets committed with the rows: nothing twice


def test_a_failing_store_rolls_the_pass_back_instead_of_quarantining(det_env: Path, tmp_path: Path) -> None:
    """sqlite3's own errors in the fast insert are the store failing (disk full, I/O), not a row
    refused: raised as SQLAlchemy's OperationalError, so the tick rolls back and every line is
    read again next time, none quarantined."""
    url, exp_id, tid = _experiment(tmp_path)
    db = url.split("///", 1)[-1]
    con = sqlite3.connect(db)
    # Fires on every insert and fails as a broken store does: an OperationalError from SQLite.
    con.execute("CREATE TRIGGER broken BEFORE INSERT ON metrics BEGIN INSERT INTO no_such_table VALUES (1); END")
    con.commit()
    events = [Metrics(group="training", steps_completed=step, metrics={"loss": 1.0}) for step in range(1, 6)]
    with pytest.raises(OperationalError, match="no_such_table"):
        _ingest(url, exp_id, tid, events)
    con.execute("DROP TRIGGER broken")
    con.commit()
    con.close()
    assert _ingest(url, exp_id, tid, events) == 5  # the same lines, from the old offset
    store = open_store(url)
    with store.read() as s:
        assert list(s.scalars(select(Metric.steps_completed).order_by(Metric.id))) == [1, 2, 3, 4, 5]
        assert not list(s.scalars(select(LogEntry.message).where(LogEntry.level == "WARNING")))
    store.dispose()


def test_odd_report_values_are_stored_as_the_orm_stored_them(det_env: Path, tmp_path: Path) -> None:
    """The fast path (no json_safe copy for flat reports, sqlite3's executemany) stores what
    json_safe makes of any report, and the values no float holds cost neither ingest nor TensorBoard."""
    url, exp_id, tid = _experiment(tmp_path)
    odd = {
        "loss": 0.5,
        "big": 10**400,  # JSON allows it; no float holds it
        "huge": 1e39,  # a float64, beyond float32 (TensorBoard's values)
        "nan": float("nan"),
        "inf": float("-inf"),
        "flag": True,
        "none": None,
        "long": "x" * (JSON_STR_MAX + 10),
        "nested": {"a": [1, float("nan")]},
    }
    flat = {"loss": 0.25, "acc": 1, "name": "ok"}
    events = [
        Metrics(group="training", steps_completed=1, metrics=odd),
        Metrics(group="training", steps_completed=2, metrics=flat, batch_metrics=[{"l": float("inf")}]),
    ]
    assert _ingest(url, exp_id, tid, events) == 2
    store = open_store(url)
    with store.read() as s:
        stored = list(s.execute(select(Metric.metrics, Metric.batch_metrics).order_by(Metric.id)))
        points = list(s.execute(select(MetricPoint.steps_completed, MetricPoint.name, MetricPoint.value)))
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        tb_dir = ExpPaths(Path(exp.exp_dir)).trial_tensorboard(tid)
    store.dispose()
    assert stored == [(json_safe(odd), None), (flat, [{"l": "Infinity"}])]
    assert sorted(points) == [(1, "huge", 1e39), (1, "loss", 0.5), (2, "acc", 1.0), (2, "loss", 0.25)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [e.value for e in acc.Scalars("huge")] == [float("inf")]  # float32's view of 1e39
    assert set(acc.Tags()["scalars"]) == {"loss", "huge", "acc"}


def test_metric_curve_downsamples_and_keeps_the_last_point(det_env: Path, tmp_path: Path) -> None:
    url, _exp_id, tid = _experiment(tmp_path)
    store = open_store(url)
    now = datetime.now(timezone.utc)
    with store.tx() as s:
        for step in range(1, 1002):
            value: Any = "NaN" if step == 500 else float(step)
            s.add(
                Metric(
                    trial_id=tid,
                    run_id=1,
                    group="validation",
                    steps_completed=step,
                    metrics={"loss": value},
                    report_time=now,
                )
            )
        s.add(
            Metric(trial_id=tid, run_id=1, group="training", steps_completed=7, metrics={"loss": 0.0}, report_time=now)
        )
    with store.read() as s:
        curve = views.metric_curve(s, tid, "validation", "loss", 100)
        full = views.metric_curve(s, tid, "validation", "loss", 5000)
        assert views.metric_curve(s, tid, "validation", "loss", 0) == []
        assert views.metric_curve(s, tid, "nothing", "loss", 10) == []
    # 1001 reports, every 11th kept (ceil(1001 / 100)), plus the last one.
    assert [p[0] for p in curve] == [*range(1, 1002, 11), 1001]
    assert all(v == float(st) for st, v in curve)
    assert len(full) == 1000 and 500 not in [p[0] for p in full]  # the string value is skipped


def test_describe_shows_each_trials_last_workloads(det: Any, tmp_path: Path) -> None:
    from detslurm.cli import experiment

    url, exp_id, tid = _experiment(tmp_path)
    store = open_store(url)
    now = datetime.now(timezone.utc)
    n = experiment.WORKLOADS_SHOWN + 5
    with store.tx() as s:
        s.add_all(
            Metric(trial_id=tid, run_id=1, group="training", steps_completed=i, metrics={"loss": i}, report_time=now)
            for i in range(1, n + 1)
        )
    code, out, _ = det("e", "describe", str(exp_id))
    assert code == 0 and "Workloads:" in out
    shown = [ln for ln in out.splitlines() if ln.strip().startswith(f"{tid} |") and "| training |" in ln]
    assert len(shown) == experiment.WORKLOADS_SHOWN
    assert shown[0].split("|")[1].strip() == "6" and shown[-1].split("|")[1].strip() == str(n)
    assert f"Trial {tid}: only its last {experiment.WORKLOADS_SHOWN} workloads are shown" in out
