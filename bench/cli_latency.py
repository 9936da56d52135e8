"""CLI latency: ``det e list`` with 10k experiments in the store, ``det job list`` with 2k
queued jobs, and ``det --help`` start-up, each side by side with the floor it cannot beat:
a bare Python reading the same rows with sqlite3, a raw ``squeue -r`` of the same jobs, and a
Python that only imports click. For ``det job list`` the floor of any Python command is shown
too: the same interpreter doing nothing (``-c pass``), with ``site`` as every console script
starts it and without (``-S``), and the least a Python ``det job list`` must do
(``_job_list_floor.py``: squeue in the daemon's format, the store's names, one line per job).
``det`` is timed as ``pip install .`` installs it (``installed_det``), not the checkout's editable
install. Medians of interleaved repeats.

    python bench/cli_latency.py [--experiments N] [--jobs N] [--repeats R]   (jobs need the cluster)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _common import HERE, Workspace, ended_experiment_row, installed_det, median, save, scancel_mine

from detslurm.slurm.parse import SQUEUE_FORMAT

RAW_LIST = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1])
for row in con.execute("SELECT id, owner, name, parent_id, state, progress, start_time, end_time, resource_pool "
                       "FROM experiments WHERE archived = 0 ORDER BY id"):
    print(*row, sep=" | ")
"""


def fill_store(ws: Workspace, n: int) -> str:
    ws.apply()
    from sqlalchemy import insert

    from detslurm import settings
    from detslurm.expconf import validate
    from detslurm.identity import os_user
    from detslurm.store import Experiment, open_store

    url = settings.load().db_url
    cfg = validate(
        {
            "name": "x",
            "entrypoint": "python3 train.py",
            "searcher": {"name": "single", "metric": "loss"},
            "hyperparameters": {"lr": 0.1},
        },
        {"type": "shared_fs", "host_path": "/tmp"},
    ).as_dict()
    now = datetime.now(timezone.utc)
    # The caller's own: `det e list` shows only those (other owners' rows never leave SQL).
    rows = [ended_experiment_row(f"exp-{i}", os_user(), cfg, f"/nonexistent/exp-{i}", now) for i in range(n)]
    with open_store(url).tx() as s:
        s.execute(insert(Experiment), rows)
    return url.split("///", 1)[-1]


def fill_log(ws: Workspace, mib: int) -> tuple[int, Path]:
    """A trial whose one run wrote ``mib`` MiB of output lines; (trial id, log path)."""
    from store_scale import make_experiment

    from detslurm import settings
    from detslurm.store import TrialRun, open_store

    _url, _exp, (tid,) = make_experiment(ws, 1)
    store = open_store(settings.load().db_url)
    with store.tx() as s:
        run = s.query(TrialRun).filter_by(trial_id=tid).one()
        log = Path(run.log_path)
    store.dispose()
    log.parent.mkdir(parents=True, exist_ok=True)
    line = b"[rank=0] step 123456: loss=0.123456 accuracy=0.987654 lr=0.001 throughput=12345.6/s\n"
    block = line * ((1 << 20) // len(line) + 1)
    with open(log, "wb") as f:
        for _ in range(mib):
            f.write(block[: 1 << 20])
    return tid, log


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, capture_output=True, check=True)
    return time.perf_counter() - t0


def fill_queue(n: int) -> None:
    """n held trial jobs of ours (arrays of at most 1000 tasks), as a grid experiment makes."""
    for start in range(0, n, 1000):
        count = min(1000, n - start)
        subprocess.run(
            [
                "sbatch",
                "--parsable",
                "--hold",
                f"--array=0-{count - 1}",
                "-o",
                "/dev/null",
                "-J",
                f"det-e1-t{start + 1}+-r1",
                f"--comment=detslurm:exp=1,trial={start + 1}+,run=1",
                "--wrap",
                "true",
            ],
            check=True,
            capture_output=True,
        )


def report(args: argparse.Namespace, with_jobs: bool, t: dict[str, list[float]]) -> dict[str, Any]:
    """The result: medians, samples, each command's ratio to its floor, and the goals."""
    med = {k: median(v) for k, v in t.items() if v}
    result: dict[str, Any] = {
        "benchmark": "cli_latency",
        "experiments": args.experiments,
        "jobs": args.jobs if with_jobs else 0,
        "repeats": args.repeats,
        "det": "pip install . (plain, not editable), dependencies shared with the bench's venv",
        "median_s": med,
        "samples_s": t,
        "help_ratio_vs_import_click": med["det_help"] / med["python_click"],
        "e_list_ratio_vs_raw_sqlite": med["det_e_list"] / med["raw_sqlite_list"],
        "log_mib": args.log_mib,
        "t_logs_tail_ratio_vs_tail": med["det_t_logs_tail"] / med["raw_tail"],
        "goal_help_s_max": 0.15,
        "goal_e_list_s_max": 0.3,
        "goal_t_logs_tail_s_max": 0.1,
        "goal_job_list_ratio_vs_squeue_max": 3.0,
    }
    if with_jobs:
        result["job_list_ratio_vs_squeue"] = med["det_job_list"] / med["raw_squeue"]
        # The floor: what `det`'s interpreter costs before running a line of detslurm.
        result["python_pass_ratio_vs_squeue"] = med["python_pass"] / med["raw_squeue"]
        result["python_S_pass_ratio_vs_squeue"] = med["python_S_pass"] / med["raw_squeue"]
        result["python_floor_job_list_ratio_vs_squeue"] = med["python_floor_job_list"] / med["raw_squeue"]
    return result


def sample(t: dict[str, list[float]], env: dict[str, str], bin_dir: Path, db: str, tail: list[str], jobs: bool) -> None:
    """One interleaved repeat of every command and its floor."""
    det, py = str(bin_dir / "det"), str(bin_dir / "python")
    t["det_help"].append(timed([det, "--help"], env))
    t["python_click"].append(timed([py, "-c", "import click"], env))
    t["det_e_list"].append(timed([det, "e", "list"], env))
    t["raw_sqlite_list"].append(timed([py, "-c", RAW_LIST, db], env))
    t["det_t_logs_tail"].append(timed([det, *tail], env))
    t["raw_tail"].append(timed(["tail", "-n", "100", env["BENCH_LOG"]], env))
    if jobs:
        t["det_job_list"].append(timed([det, "job", "list"], env))
        t["raw_squeue"].append(timed(["squeue", "-r"], env))
        t["python_pass"].append(timed([py, "-c", "pass"], env))
        t["python_S_pass"].append(timed([py, "-S", "-c", "pass"], env))
        floor = [py, str(HERE / "_job_list_floor.py"), SQUEUE_FORMAT, db]
        t["python_floor_job_list"].append(timed(floor, env))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiments", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--log-mib", type=int, default=1024, help="size of the log `det t logs --tail 100` reads")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ws = Workspace("cli")
    # Bytecode caches as an installed detslurm has them (some shells set PYTHONDONTWRITEBYTECODE,
    # which would make every timed start-up compile the modules again).
    ws.env.pop("PYTHONDONTWRITEBYTECODE", None)
    bin_dir = installed_det(ws.dir / "installed")
    db = fill_store(ws, args.experiments)
    tid, log = fill_log(ws, args.log_mib)
    ws.env["BENCH_LOG"] = str(log)
    keys = ("det_help", "python_click", "det_e_list", "raw_sqlite_list", "det_t_logs_tail", "raw_tail")
    jobs_keys = ("det_job_list", "raw_squeue", "python_pass", "python_S_pass", "python_floor_job_list")
    t: dict[str, list[float]] = {k: [] for k in (*keys, *jobs_keys)}
    tail = ["t", "logs", str(tid), "--tail", "100"]
    for argv in (["--help"], ["e", "list"], tail):
        subprocess.run([str(bin_dir / "det"), *argv], env=ws.env, capture_output=True, check=True)  # warm caches
    with_jobs = args.jobs > 0 and bool(os.environ.get("SLURM_CONF"))
    try:
        if with_jobs:
            scancel_mine()
            fill_queue(args.jobs)
        for _ in range(args.repeats):
            sample(t, ws.env, bin_dir, db, tail, with_jobs)
    finally:
        if with_jobs:
            scancel_mine()
        ws.close()
    save("cli_latency", report(args, with_jobs, t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
