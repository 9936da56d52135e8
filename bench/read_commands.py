"""Read commands: every read command of the CLI on a 10,000-trial store, side by side with
``det e list`` on the same store (goal: each within 2x). The store holds E experiments of T
trials each (1,000 x 10 by default), every trial with one run and its log, R metric reports
(half of them validations) and two checkpoints; every experiment has ended, so no read asks
Slurm anything (`det job list` needs the cluster: timed only where SLURM_CONF is set).
``det`` is timed as ``pip install .`` installs it (``installed_det``). Medians of interleaved
repeats, the commands' order rotated each repeat.

    python bench/read_commands.py [--experiments E] [--trials T] [--reports R] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from _common import Workspace, ended_experiment_row, installed_det, median, save

BASELINE = "e list"


def _config() -> dict[str, Any]:
    from detslurm.expconf import validate

    cfg = {
        "name": "x",
        "entrypoint": "python3 train.py",
        "searcher": {"name": "random", "metric": "loss", "max_trials": 10, "max_length": {"batches": 100}},
        "hyperparameters": {"lr": {"type": "double", "minval": 0.001, "maxval": 0.1}, "layers": 4},
        "labels": ["bench"],
    }
    return validate(cfg, {"type": "shared_fs", "host_path": "/tmp"}).as_dict()


def _experiment_rows(n: int, cfg: dict[str, Any], exps: Path, owner: str, now: datetime) -> list[dict[str, Any]]:
    return [
        {"id": i + 1, **ended_experiment_row(f"exp-{i}", owner, cfg, str(exps / f"exp-{i}"), now)} for i in range(n)
    ]


def _trial_rows(args: argparse.Namespace, exps: Path, now: datetime) -> dict[str, list[dict[str, Any]]]:
    """Trials, their runs, metric reports and checkpoints, as Core insert rows by table."""
    out: dict[str, list[dict[str, Any]]] = {"trials": [], "runs": [], "metrics": [], "checkpoints": []}
    tid = 0
    for e in range(args.experiments):
        for k in range(args.trials):
            tid += 1
            run_dir = exps / f"exp-{e}" / "trials" / str(tid) / "runs" / "1"
            _add_trial(out, args, tid, e, k, run_dir, now)
    return out


def _add_trial(
    out: dict[str, list[dict[str, Any]]],
    args: argparse.Namespace,
    tid: int,
    e: int,
    k: int,
    run_dir: Path,
    now: datetime,
) -> None:
    """Trial ``tid`` (the ``k``-th of experiment ``e + 1``): its row, its run, reports and checkpoints."""
    out["trials"].append(
        {
            "id": tid,
            "experiment_id": e + 1,
            "request_id": f"r{k}",
            "state": "COMPLETED",
            "hparams": {"lr": 0.001 * (k + 1), "layers": 4},
            "seed": k,
            "run_count": 1,
            "steps_completed": 100,
            "searcher_metric": 0.5,
            "progress": 1.0,
            "start_time": now,
            "end_time": now,
        }
    )
    out["runs"].append(
        {
            "trial_id": tid,
            "run_id": 1,
            "state": "EXITED",
            "executor": "local",
            "job_id": str(run_dir),
            "run_dir": str(run_dir),
            "log_path": str(run_dir / "output.log"),
            "exit_code": 0,
            "submit_time": now,
            "start_time": now,
            "end_time": now,
        }
    )
    for r in range(args.reports):
        step = 100 * (r // 2 + 1) // max(args.reports // 2, 1)
        group = "validation" if r % 2 else "training"
        out["metrics"].append(
            {
                "trial_id": tid,
                "run_id": 1,
                "group": group,
                "steps_completed": step,
                "metrics": {"loss": 1.0 / (r + 1), "accuracy": r / args.reports},
                "report_time": now + timedelta(seconds=r),
                "archived": False,
            }
        )
    for c, step in enumerate((50, 100)):
        out["checkpoints"].append(
            {
                "uuid": f"ck-{tid}-{c}",
                "trial_id": tid,
                "run_id": 1,
                "steps_completed": step,
                "storage_path": f"/nonexistent/ck-{tid}-{c}",
                "metadata": {"steps_completed": step},
                "resources": {"model.pt": 1024, "state.json": 64},
                "size": 1088,
                "report_time": now,
            }
        )


def fill_store(ws: Workspace, args: argparse.Namespace) -> tuple[int, int]:
    """The store; (an experiment in its middle, that experiment's first trial)."""
    ws.apply()
    from sqlalchemy import insert

    from detslurm import settings
    from detslurm.identity import os_user
    from detslurm.store import Experiment, Metric, Trial, TrialRun, open_store
    from detslurm.store.models import Base

    exps, now = ws.dir / "exps", datetime.now(timezone.utc)
    rows = _trial_rows(args, exps, now)
    store = open_store(settings.load().db_url)
    with store.tx() as s:
        s.execute(insert(Experiment), _experiment_rows(args.experiments, _config(), exps, os_user(), now))
        s.execute(insert(Trial), rows["trials"])
        s.execute(insert(TrialRun), rows["runs"])
        s.execute(insert(Metric), rows["metrics"])
        s.execute(insert(Base.metadata.tables["checkpoints"]), rows["checkpoints"])  # its column "metadata"
    store.dispose()
    exp_id = args.experiments // 2 + 1
    trial_id = (exp_id - 1) * args.trials + 1
    log = Path(rows["runs"][trial_id - 1]["log_path"])
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"[rank=0] step {i}: loss={1 / (i + 1):.6f}\n" for i in range(2000)))
    return exp_id, trial_id


def commands(exp_id: int, trial_id: int, jobs: bool) -> dict[str, list[str]]:
    """Every read command, by the name the result gives it."""
    e, t, ck = str(exp_id), str(trial_id), f"ck-{trial_id}-1"
    out = {
        BASELINE: ["e", "list"],
        "e list --json": ["e", "list", "--json"],
        "e describe": ["e", "describe", e],
        "e describe --json": ["e", "describe", e, "--json"],
        "e list-trials": ["e", "list-trials", e],
        "e list-checkpoints": ["e", "list-checkpoints", e],
        "e config": ["e", "config", e],
        "e logs --tail 100": ["e", "logs", e, "--tail", "100"],
        "t describe --metrics": ["t", "describe", t, "--metrics"],
        "t logs --tail 100": ["t", "logs", t, "--tail", "100"],
        "checkpoint list": ["checkpoint", "list", e],
        "checkpoint describe": ["checkpoint", "describe", ck],
    }
    if jobs:
        out["job list"] = ["job", "list"]
    return out


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, capture_output=True, check=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiments", type=int, default=1000)
    ap.add_argument("--trials", type=int, default=10, help="trials per experiment")
    ap.add_argument("--reports", type=int, default=10, help="metric reports per trial")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ws = Workspace("reads")
    # Bytecode caches as an installed detslurm has them (see cli_latency.py).
    ws.env.pop("PYTHONDONTWRITEBYTECODE", None)
    try:
        det = str(installed_det(ws.dir / "installed") / "det")
        exp_id, trial_id = fill_store(ws, args)
        cmds = commands(exp_id, trial_id, bool(os.environ.get("SLURM_CONF")))
        for argv in cmds.values():
            subprocess.run([det, *argv], env=ws.env, capture_output=True, check=True)  # warm caches
        t: dict[str, list[float]] = {name: [] for name in cmds}
        names = list(cmds)
        for k in range(args.repeats):
            for name in names[k % len(names) :] + names[: k % len(names)]:
                t[name].append(timed([det, *cmds[name]], ws.env))
    finally:
        ws.close()
    med = {name: median(v) for name, v in t.items()}
    save(
        "read_commands",
        {
            "benchmark": "read_commands",
            "experiments": args.experiments,
            "trials": args.experiments * args.trials,
            "trials_per_experiment": args.trials,
            "reports_per_trial": args.reports,
            "repeats": args.repeats,
            "baseline": f"det {BASELINE}",
            "median_s": med,
            "samples_s": t,
            "ratio_vs_e_list": {name: med[name] / med[BASELINE] for name in med},
            "max_ratio": max(med[name] / med[BASELINE] for name in med),
            "goal_ratio_max": 2.0,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
