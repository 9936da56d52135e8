"""Ingest and storage, no cluster needed:

- metrics ingest: rows/s through the daemon's own path (``controller.apply.ingest_run``: event
  file -> decoded, validated events -> metric rows, offsets committed with them) into SQLite
  on local disk, side by side with a bare sqlite3 ``executemany`` of the same rows (the floor),
  and of the same rows with the two ``metric_points`` rows each report also writes; wall and
  CPU time of this process (the CPU ratio is the steadier on a shared machine);
- an experiment with ``--rows`` metric rows (1M at full size): whole-process `det e describe`
  (`--metrics-shown` rows are what it prints), and the dashboard's curve query (one trial's
  validation curve of one metric, downsampled to ``--points``), side by side with the bare
  sqlite3 SELECT of the same rows;
- store size per million metric rows: of the rows written in bulk (with their points), and of
  what the ingest itself added (rows, points, offsets).

    python bench/store_scale.py [--ingest N] [--rows N] [--trials N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _common import DET, Workspace, median, save

CONFIG = """
name: scale
entrypoint: python3 train.py
searcher: {name: single, metric: loss, smaller_is_better: true}
hyperparameters: {lr: 0.1}
"""

RAW_CURVE = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1])
rows = con.execute("SELECT steps_completed, metrics FROM metrics WHERE trial_id = ? AND \\"group\\" = 'validation' "
                   "AND archived = 0 ORDER BY steps_completed, id", (int(sys.argv[2]),)).fetchall()
print(len(rows))
"""


def make_experiment(ws: Workspace, trials: int) -> tuple[str, int, list[int]]:
    """A store with one experiment of ``trials`` trials, each with one run dir; (url, exp id, trial ids)."""
    ws.apply()
    from detslurm import settings
    from detslurm.controller.create import execute_create, plan_create
    from detslurm.protocol import ExpPaths
    from detslurm.store import Experiment, Trial, TrialRun, open_store

    st = settings.load()
    ctx = ws.dir / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text("pass\n")
    (ws.dir / "c.yaml").write_text(CONFIG)
    store = open_store(st.db_url)
    exp_id = execute_create(store, st, plan_create(st, ws.dir / "c.yaml", ctx), "local")
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        ids = []
        for i in range(trials):
            t = Trial(experiment_id=exp_id, request_id=f"bench-{i}", hparams={"lr": 0.1}, seed=i)
            s.add(t)
            s.flush()
            paths = ExpPaths(Path(exp.exp_dir)).run(t.id, 1)
            s.add(
                TrialRun(
                    trial_id=t.id,
                    run_id=1,
                    executor="local",
                    run_dir=str(paths.dir),
                    log_path=str(paths.dir / "output.log"),
                )
            )
            ids.append(t.id)
    store.dispose()
    return st.db_url, exp_id, ids


def measure_ingest(url: str, exp_id: int, trial_id: int, n: int) -> tuple[float, float, int]:
    """Seconds (wall, and this process's CPU) for the daemon's ingest of ``n`` metric events of
    one run (one transaction per pass, as a tick), and how many rows it wrote."""
    from sqlalchemy import func, select

    from detslurm.controller.apply import ingest_run
    from detslurm.controller.reconcile import load_searcher
    from detslurm.protocol import Metrics, RunPaths, encode
    from detslurm.store import Experiment, Metric, Trial, TrialRun, open_store

    store = open_store(url)
    with store.read() as s:
        run = s.scalars(select(TrialRun).where(TrialRun.trial_id == trial_id)).one()
    path = RunPaths.from_run_dir(Path(run.run_dir)).event_file(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            # Mostly training rows, a validation every 10th: the mix a trial reports.
            group = "validation" if i % 10 == 9 else "training"
            f.write(encode(Metrics(group=group, steps_completed=i + 1, metrics={"loss": 1.0 / (i + 1), "acc": 0.5})))
    t0, c0 = time.perf_counter(), time.process_time()
    applied, run_pk = 0, run.id
    # One transaction per pass, as the daemon's ticks: a pass reads a bounded chunk of the file.
    while applied < n:
        with store.tx() as s:
            exp = s.get(Experiment, exp_id)
            trial = s.get(Trial, trial_id)
            run = s.get(TrialRun, run_pk)
            assert exp is not None and trial is not None and run is not None
            got = ingest_run(s, exp, trial, run, load_searcher(exp))
        if got == 0:
            break
        applied += got
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    with store.read() as s:
        rows = int(s.scalar(select(func.count()).select_from(Metric).where(Metric.trial_id == trial_id)) or 0)
    store.dispose()
    assert applied == n, (applied, n)
    return seconds, cpu, rows


def raw_insert(db: str, trial_ids: list[int], n: int, first_step: int, points: bool = False) -> float:
    """Bare sqlite3 executemany of ``n`` metric rows spread over the trials (and, with ``points``,
    their two ``metric_points`` rows each, as ingest writes them); its seconds."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")
    per = max(1, n // len(trial_ids))
    con = sqlite3.connect(db)
    t0 = time.perf_counter()
    with con:
        for k, tid in enumerate(trial_ids):
            count = per if k < len(trial_ids) - 1 else n - per * (len(trial_ids) - 1)
            rows = [
                (tid, "validation" if i % 10 == 9 else "training", first_step + i, {"loss": 1.0 / (i + 1), "acc": 0.5})
                for i in range(count)
            ]
            con.executemany(
                'INSERT INTO metrics (trial_id, run_id, "group", steps_completed, metrics, batch_metrics, '
                "report_time, archived) VALUES (?, 1, ?, ?, ?, NULL, ?, 0)",
                ((t, g, step, json.dumps(m), now) for t, g, step, m in rows),
            )
            if points:
                con.executemany(
                    'INSERT INTO metric_points (trial_id, "group", name, steps_completed, report_time, value, '
                    "archived) VALUES (?, ?, ?, ?, ?, ?, 0)",
                    ((t, g, name, step, now, v) for t, g, step, m in rows for name, v in m.items()),
                )
    seconds = time.perf_counter() - t0
    con.close()
    return seconds


def store_bytes(db: str) -> int:
    con = sqlite3.connect(db)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    return sum(os.path.getsize(p) for p in (db, db + "-wal") if os.path.exists(p))


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, p.stdout


def children_cpu() -> float:
    """CPU seconds of this process's finished children: a whole command's CPU, steadier than its
    wall time on a shared machine."""
    t = os.times()
    return t.children_user + t.children_system


def curve_seconds(url: str, trial_id: int, points: int) -> tuple[float, int]:
    """In-process seconds of the dashboard's curve query (views.metric_curve) and its points."""
    from detslurm import views
    from detslurm.store import open_store

    store = open_store(url)
    t0 = time.perf_counter()
    with store.read() as s:
        curve = views.metric_curve(s, trial_id, "validation", "loss", points)
    seconds = time.perf_counter() - t0
    store.dispose()
    return seconds, len(curve)


def row_counts(db: str, trial_id: int) -> tuple[int, int]:
    """The experiment's metric rows, and the validation rows of the trial whose curve is asked."""
    con = sqlite3.connect(db)
    try:
        total = int(con.execute("SELECT count(*) FROM metrics").fetchone()[0])
        q = "SELECT count(*) FROM metrics WHERE trial_id = ? AND \"group\" = 'validation'"
        return total, int(con.execute(q, (trial_id,)).fetchone()[0])
    finally:
        con.close()


def time_queries(
    ws: Workspace, url: str, exp_id: int, trial_id: int, points: int, repeats: int
) -> tuple[dict[str, list[float]], int]:
    """det e describe (wall and CPU), a bare SELECT of the curve's rows and the curve query,
    ``repeats`` times each; also the number of points the curve query returned."""
    db = url.split("///", 1)[-1]
    names = ("det_e_describe", "det_e_describe_cpu", "raw_curve_select", "curve_query")
    t: dict[str, list[float]] = {k: [] for k in names}
    got = 0
    for _ in range(repeats):
        c0 = children_cpu()
        secs, _out = timed([DET, "e", "describe", str(exp_id)], ws.env)
        t["det_e_describe_cpu"].append(children_cpu() - c0)
        t["det_e_describe"].append(secs)
        t["raw_curve_select"].append(timed([sys.executable, "-c", RAW_CURVE, db, str(trial_id)], ws.env)[0])
        secs, got = curve_seconds(url, trial_id, points)
        t["curve_query"].append(secs)
    return t, got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ingest", type=int, default=100_000, help="metric events ingested in one tick")
    ap.add_argument("--rows", type=int, default=1_000_000, help="metric rows of the experiment queried")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--points", type=int, default=1000, help="points the curve query returns at most")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ws = Workspace("store")
    try:
        url, exp_id, trial_ids = make_experiment(ws, args.trials)
        db = url.split("///", 1)[-1]
        before_ingest = store_bytes(db)
        ingest_s, ingest_cpu, ingested = measure_ingest(url, exp_id, trial_ids[0], args.ingest)
        ingest_bytes = store_bytes(db) - before_ingest
        # The floors, side by side: the metric rows alone, then with the points ingest also writes.
        c0 = time.process_time()
        raw_s = raw_insert(db, trial_ids[1:2] or trial_ids, args.ingest, 10_000_000)
        raw_cpu = time.process_time() - c0
        c0 = time.process_time()
        raw_points_s = raw_insert(db, trial_ids[1:2] or trial_ids, args.ingest, 30_000_000, points=True)
        raw_points_cpu = time.process_time() - c0
        before = store_bytes(db)
        # The rest of the experiment's rows, spread over its trials, the fast way (with their points).
        raw_insert(db, trial_ids, max(0, args.rows - 3 * args.ingest), 20_000_000, points=True)
        after = store_bytes(db)
        total_rows, biggest = row_counts(db, trial_ids[-1])
        t, points = time_queries(ws, url, exp_id, trial_ids[-1], args.points, args.repeats)
    finally:
        ws.close()
    med = {k: median(v) for k, v in t.items()}
    added = max(1, total_rows - 3 * args.ingest)
    load = os.getloadavg()
    result: dict[str, Any] = {
        "benchmark": "store_scale",
        "ingested_rows": ingested,
        "ingest_rows_per_s": ingested / ingest_s,
        "raw_executemany_rows_per_s": args.ingest / raw_s,
        "ingest_ratio_vs_raw": (ingested / ingest_s) / (args.ingest / raw_s),
        "raw_with_points_rows_per_s": args.ingest / raw_points_s,
        "ingest_ratio_vs_raw_with_points": (ingested / ingest_s) / (args.ingest / raw_points_s),
        # CPU seconds of this process: steadier than wall time on a shared machine.
        "ingest_cpu_rows_per_s": ingested / ingest_cpu,
        "raw_cpu_rows_per_s": args.ingest / raw_cpu,
        "raw_with_points_cpu_rows_per_s": args.ingest / raw_points_cpu,
        "ingest_store_mb_per_million_rows": ingest_bytes / ingested * 1e6 / 2**20,
        "load_average": load,
        "metric_rows": total_rows,
        "curve_trial_validation_rows": biggest,
        "curve_points": points,
        "store_mb_per_million_rows": (after - before) / added * 1e6 / 2**20 if args.rows > 3 * args.ingest else None,
        "median_s": med,
        "samples_s": t,
        "describe_ratio_vs_raw_select": med["det_e_describe"] / med["raw_curve_select"],
        "goal_ingest_rows_per_s_min": 100_000,
        "goal_query_s_max": 0.5,
    }
    save("store_scale", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
