"""Time to result of one adaptive ASHA search (16 trials of examples/core_api/train.py, a few
seconds each, 4 at a time), run in each of detslurm's ways of placing trials, side by side, on
the test cluster idle and made busy (bench/busy_cluster.py: every job waits --wait-s in the
queue):

- ``per-trial``: today's default, each trial run its own Slurm job in the cpu pool (c1, c2);
- ``allocation``: one allocation of the same nodes (``salloc -N2 --ntasks-per-node=2``, the
  user's one job through the queue), the search inside it (``det e create --in-allocation``);
- ``pilots``: worker jobs of the same shape that the daemon feeds (``slurm.pilots``); not built
  yet, so not among the default modes: ``--modes per-trial,allocation,pilots`` once it is.

Time to result is from the user's first command (``det e create``, or the ``salloc`` before it)
to the experiment's end as the store records it. Reported: each run's time, its trial runs' own
queue waits, and the ratios the goals name (on the busy cluster each mode against per-trial:
<= 0.5x; on the idle one, the slowest mode against the fastest: <= 1.1x).

    eval "$(scripts/test-cluster env .state/cluster)"
    python bench/time_to_result.py [--wait-s 30] [--repeats 1] [--conditions idle,busy] [--modes ...]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import DET, ROOT, Workspace, require_cluster, save, scancel_mine
from busy_cluster import BusyCluster, probe

PARTITION, NODES, SLOTS_PER_NODE = "cpu", 2, 2  # the cpu pool of the test cluster: c1, c2

CONFIG = """name: time-to-result
entrypoint: python3 train.py
hyperparameters:
  lr: {{type: log, minval: -3, maxval: -0.5}}
  noise: 0.1
  sleep: {sleep}
searcher:
  name: adaptive_asha
  metric: validation_loss
  smaller_is_better: true
  max_trials: {trials}
  max_time: 40
  time_metric: batches
  max_concurrent_trials: {concurrent}
resources:
  resource_pool: {pool}
reproducibility:
  experiment_seed: 7
max_restarts: 0
"""
END_STATES = ("COMPLETED", "ERROR", "CANCELED", "PAUSED")


class Pending(Exception):
    """A mode whose feature is not in this checkout yet."""


@dataclass
class Started:
    t0: float  # when the user's first command began (epoch s)
    held: list[str] = field(default_factory=list)  # Slurm jobs the user holds: canceled at the end


def create(ws: Workspace, ctx: Path, *extra: str, env: dict[str, str] | None = None) -> None:
    p = subprocess.run(
        [DET, "e", "create", str(ctx / "c.yaml"), str(ctx), *extra],
        env=env or ws.env,
        capture_output=True,
        text=True,
    )
    if p.returncode:
        raise RuntimeError(f"det e create {' '.join(extra)} failed: {p.stderr.strip() or p.stdout.strip()}")


def per_trial(ws: Workspace, ctx: Path) -> Started:
    t0 = time.time()
    create(ws, ctx)
    return Started(t0)


def hold_allocation() -> str:
    """What the user types first: ``salloc`` of the nodes, through the queue like any job."""
    p = subprocess.run(
        ["salloc", "--no-shell", f"-p{PARTITION}", f"-N{NODES}", f"--ntasks-per-node={SLOTS_PER_NODE}"]
        + ["-t60", "-Jttr-allocation"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    m = re.search(r"Granted job allocation (\d+)", p.stderr)
    if not m:
        raise RuntimeError(f"salloc gave no allocation: {p.stderr.strip()}")
    return m.group(1)


def allocation(ws: Workspace, ctx: Path) -> Started:
    t0 = time.time()
    job = hold_allocation()
    # As inside that salloc's shell: SLURM_JOB_ID names the allocation.
    create(ws, ctx, "--in-allocation", env=dict(ws.env, SLURM_JOB_ID=job))
    return Started(t0, [job])


def pilots(ws: Workspace, ctx: Path) -> Started:
    """The slot for pilot workers: the same search with ``--config slurm.pilots.count={NODES}``
    and ``slurm.pilots.slots={SLOTS_PER_NODE}`` (workers of the allocation's shape), timed from
    that create, once the daemon runs trials in them."""
    raise Pending("pilot workers: the daemon does not run trials in them yet")


MODES: dict[str, Callable[[Workspace, Path], Started]] = {
    "per-trial": per_trial,
    "allocation": allocation,
    "pilots": pilots,
}


def outcome() -> dict[str, Any]:
    """The experiment's state and end, and its trial runs' queue waits, from the store."""
    from sqlalchemy import func, select

    from detslurm import settings
    from detslurm.store import Experiment, Trial, TrialRun, open_store

    with open_store(settings.load().db_url).read() as s:
        exp = s.execute(select(Experiment.state, Experiment.end_time).where(Experiment.id == 1)).one()
        trials = s.scalar(select(func.count()).select_from(Trial).where(Trial.experiment_id == 1))
        runs = s.execute(select(TrialRun.submit_time, TrialRun.start_time)).all()
    waits = [(start - submit).total_seconds() for submit, start in runs if start is not None]
    return {
        "state": str(getattr(exp.state, "value", exp.state)),
        "end": exp.end_time.timestamp() if exp.end_time else None,
        "trials": trials or 0,
        "runs": len(runs),
        "run_wait_s_median": statistics.median(waits) if waits else None,
        "run_wait_s_max": max(waits) if waits else None,
    }


def run_mode(mode: str, ctx_src: Path, timeout_s: float) -> dict[str, Any]:
    ws = Workspace(f"ttr-{mode}")
    ws.apply()
    ctx = ws.dir / "ctx"
    shutil.copytree(ctx_src, ctx)
    started: Started | None = None
    try:
        started = MODES[mode](ws, ctx)
        deadline = started.t0 + timeout_s
        while (r := outcome())["state"] not in END_STATES and time.time() < deadline:
            time.sleep(1)
        ended = r["end"] or time.time()
        return {"mode": mode, "time_to_result_s": ended - started.t0, **r}
    finally:
        for job in started.held if started else []:
            subprocess.run(["scancel", job], check=False)
        ws.close()
        scancel_mine()


def context(args: argparse.Namespace) -> Path:
    ctx = Path(os.environ.get("TMPDIR", "/tmp")) / f"ttr-ctx-{os.getpid()}"
    ctx.mkdir(exist_ok=True)
    shutil.copy2(ROOT / "examples/core_api/train.py", ctx / "train.py")
    concurrent = NODES * SLOTS_PER_NODE
    (ctx / "c.yaml").write_text(
        CONFIG.format(sleep=args.batch_s, trials=args.trials, concurrent=concurrent, pool=PARTITION)
    )
    return ctx


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per condition, each mode's median time as a ratio: to per-trial, and slowest to fastest."""
    out: dict[str, Any] = {}
    for cond in sorted({r["condition"] for r in rows}):
        med = {
            m: statistics.median(r["time_to_result_s"] for r in rows if r["condition"] == cond and r["mode"] == m)
            for m in sorted({r["mode"] for r in rows if r["condition"] == cond and r["state"] == "COMPLETED"})
        }
        out[cond] = {
            "median_s": med,
            "vs_per_trial": {m: t / med["per-trial"] for m, t in med.items()} if "per-trial" in med else {},
            "slowest_vs_fastest": max(med.values()) / min(med.values()) if med else None,
        }
    return out


def measure(args: argparse.Namespace, ctx: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    pending: dict[str, str] = {}
    load: dict[str, Any] = {}
    for cond in args.conditions:
        busy = BusyCluster(args.wait_s) if cond == "busy" else None
        try:
            if busy:
                busy.__enter__()
                busy.wait_full()
                load["probe_wait_s"] = probe(PARTITION)[0]
            for rep in range(args.repeats):
                order = args.modes if rep % 2 == 0 else args.modes[::-1]  # alternated: no mode always first
                for mode in order:
                    if mode in pending:
                        continue
                    try:
                        row = run_mode(mode, ctx, args.timeout_s)
                    except Pending as e:
                        pending[mode] = str(e)
                        continue
                    rows.append({"condition": cond, "repeat": rep, **row})
                    print(f"{cond} {mode}: {row['time_to_result_s']:.1f} s ({row['state']})", flush=True)
        finally:
            if busy:
                load["busy_errors"] = busy.errors[:10]
                busy.stop()
    return rows, {"pending": pending, **load}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wait-s", type=float, default=30.0, help="the queue wait of the busy cluster")
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--batch-s", type=float, default=0.25, help="each batch's sleep (40 batches at most)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--conditions", type=lambda s: s.split(","), default=["idle", "busy"])
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["per-trial", "allocation"])
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per search")
    args = ap.parse_args()
    if unknown := set(args.modes) - set(MODES):
        sys.exit(f"--modes: unknown {sorted(unknown)}; the modes are {', '.join(MODES)}")
    require_cluster()
    scancel_mine()
    ctx = context(args)
    try:
        rows, extra = measure(args, ctx)
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
    result = {
        "benchmark": "time_to_result",
        "wait_s": args.wait_s,
        "trials": args.trials,
        "batch_s": args.batch_s,
        "rows": rows,
        "ratios": ratios(rows),
        "goals": {"busy_vs_per_trial_max": 0.5, "idle_slowest_vs_fastest_max": 1.1},
        "load_average": list(os.getloadavg()),
        **extra,
    }
    save("time_to_result", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
