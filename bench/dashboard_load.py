"""Dashboard at scale: an experiment with 1000 trials and 1M metric points, opened through the
real server (HTTP on 127.0.0.1, as a browser would): the experiment's JSON plus its first curve,
which is what the page waits for before it is drawn. Goal: under 2 s. Baseline, measured in the
same run: reading the same metric rows whole (every row's JSON loaded), which is what a server
that did not downsample in SQL would do.

    bench/dashboard_load.py [--trials 1000] [--points 1000]

`build_store` is also what the tests use for their large synthetic experiment."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from detslurm.identity import os_user  # noqa: E402
from detslurm.store import Experiment, Store, Trial, open_store  # noqa: E402
from detslurm.store.models import Metric, MetricPoint  # noqa: E402

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def build_store(url: str, trials: int, points: int, exp_dir: Path, seed: int = 0) -> tuple[Store, int]:
    """A store holding one finished random-search experiment of ``trials`` trials, each with
    ``points`` metric rows: half training (loss), half validation (loss, accuracy)."""
    rng = random.Random(seed)
    store = open_store(url)
    with store.tx() as s:
        e = Experiment(
            name="synthetic-1000",
            owner=os_user(),
            config={
                "searcher": {"name": "random", "metric": "loss", "smaller_is_better": True},
                "records_per_epoch": 6400,
                "hyperparameters": {"global_batch_size": {"type": "const", "val": 64}},
            },
            original_config="",
            context_sha256="0",
            exp_dir=str(exp_dir),
            executor="local",
            resource_pool="cpu",
            progress=1.0,
            state="COMPLETED",
        )
        s.add(e)
        s.flush()
        exp_id = int(e.id)
        ts = [
            Trial(
                experiment_id=exp_id,
                request_id=f"r{i}",
                hparams={
                    "lr": round(10 ** rng.uniform(-4, -1), 6),
                    "layers": rng.choice([2, 4, 8]),
                    "opt": rng.choice(["sgd", "adam"]),
                },
                seed=i,
                state="COMPLETED",
                start_time=T0,
            )
            for i in range(trials)
        ]
        s.add_all(ts)
        s.flush()
        ids = [int(t.id) for t in ts]
    _fill_metrics(store, ids, points, rng)
    with store.tx() as s:
        for t in s.query(Trial).filter(Trial.experiment_id == exp_id):
            t.searcher_metric = _final_loss(t.id)
            t.steps_completed = 10 * (points // 2)
    return store, exp_id


def _final_loss(tid: int) -> float:
    return 1.0 / (1 + (tid % 97) / 10)


def _fill_metrics(store: Store, ids: list[int], points: int, rng: random.Random) -> None:
    """Reports as ingest stores them: a Metric row each, and a MetricPoint per numeric value."""
    half = points // 2
    for chunk in range(0, len(ids), 50):
        rows: list[dict[str, Any]] = []
        pts: list[dict[str, Any]] = []
        for tid in ids[chunk : chunk + 50]:
            end = _final_loss(tid)
            for k in range(half):
                step = 10 * (k + 1)
                loss = end + math.exp(-k / 60) + rng.random() * 0.05
                when = T0 + timedelta(seconds=step)
                reports = {"training": {"loss": loss}, "validation": {"loss": loss + 0.02, "accuracy": 1 - loss / 3}}
                for group, metrics in reports.items():
                    common = dict(trial_id=tid, group=group, steps_completed=step, report_time=when, archived=False)
                    rows.append(dict(common, run_id=1, metrics=metrics))
                    pts += [dict(common, name=n, value=v) for n, v in metrics.items()]
        with store.tx() as s:
            _insert(s, Metric.__table__, rows)
            _insert(s, MetricPoint.__table__, pts)


def _insert(s: Any, table: Any, rows: list[dict[str, Any]]) -> None:
    """A bulk insert. On SQLite the rows go to the driver's executemany as tuples, each value
    encoded once by SQLAlchemy's own bind processor for its column, so the rows are stored exactly
    as ``insert()`` stores them; only SQLAlchemy's per-row work is skipped (most of the build's
    time at a million rows). Other databases take the plain ``insert()``."""
    conn = s.connection()
    if conn.dialect.name != "sqlite":
        conn.execute(table.insert(), rows)
        return
    cols = [c for c in table.columns if c.name in rows[0]]
    procs = [c.type.dialect_impl(conn.dialect).bind_processor(conn.dialect) for c in cols]
    cached = [c.name == "report_time" for c in cols]  # few distinct times, a million rows
    memo: dict[Any, Any] = {}

    def enc(i: int, v: Any) -> Any:
        p = procs[i]
        if p is None:
            return v
        if not cached[i]:
            return p(v)
        if v not in memo:
            memo[v] = p(v)
        return memo[v]

    names = ", ".join(f'"{c.name}"' for c in cols)  # quoted: "group" is an SQL keyword
    sql = f"INSERT INTO {table.name} ({names}) VALUES ({', '.join('?' * len(cols))})"
    values = [tuple(enc(i, r[c.name]) for i, c in enumerate(cols)) for r in rows]
    conn.connection.driver_connection.executemany(sql, values)


def fetch(base: str, path: str, cookie: str) -> Any:
    req = urllib.request.Request(base + path, headers={"Cookie": cookie})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def open_page(base: str, cookie: str, exp_id: int) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """What the experiment page loads before it draws: (seconds, experiment JSON, curves JSON)."""
    t = time.perf_counter()
    exp = fetch(base, f"/api/experiments/{exp_id}", cookie)
    curves = fetch(base, f"/api/experiments/{exp_id}/curves?group=validation&metric=loss", cookie)
    return time.perf_counter() - t, exp, curves


def cpu_of_page(base: str, cookie: str, exp_id: int) -> float:
    """CPU seconds of one page load, server and client together (the server runs in this
    process): what the load costs on an idle core, whatever else the machine is doing."""
    t = time.process_time()
    open_page(base, cookie, exp_id)
    return time.process_time() - t


def whole_rows(store: Store, exp_id: int) -> float:
    from sqlalchemy import select

    t = time.perf_counter()
    with store.read() as s:
        trials = select(Trial.id).where(Trial.experiment_id == exp_id)
        q = select(Metric.trial_id, Metric.steps_completed, Metric.metrics).where(
            Metric.trial_id.in_(trials), Metric.group == "validation"
        )
        n = sum(1 for _ in s.execute(q))
    assert n > 0
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--points", type=int, default=1000)
    args = ap.parse_args()
    from _common import save  # type: ignore[import-not-found]

    from detslurm.dashboard.testing import running_dashboard

    # A private store (about 330 MB at full size), removed at the end.
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp_dir:
        tmp = Path(tmp_dir)
        t = time.perf_counter()
        store, exp_id = build_store(f"sqlite:///{tmp / 'db.sqlite'}", args.trials, args.points, tmp / "exp")
        built = time.perf_counter() - t
        with running_dashboard(store) as (base, cookie):
            # Warm-up: imports and SQLite's page cache (the store a daemon writes to stays cached).
            open_page(base, cookie, exp_id)
            times = [open_page(base, cookie, exp_id)[0] for _ in range(3)]
            cpu = min(cpu_of_page(base, cookie, exp_id) for _ in range(3))
        baseline = [whole_rows(store, exp_id) for _ in range(3)]
        store.dispose()
    ours, theirs = min(times), min(baseline)
    save(
        "dashboard_load",
        {
            "trials": args.trials,
            "points": args.trials * args.points,
            "build_s": built,
            "page_s": ours,
            "page_cpu_s": cpu,
            "load_average": os.getloadavg()[0],
            "whole_rows_s": theirs,
            "ratio": ours / theirs,
            "goal_s": 2.0,
        },
    )
    size = f"{args.trials} trials / {args.trials * args.points} points"
    print(
        f"experiment page, {size}: {ours:.2f} s, {cpu:.2f} s CPU (goal < 2 s); reading the rows whole: {theirs:.2f} s"
    )


if __name__ == "__main__":
    main()
