"""Time to result of one adaptive ASHA search (16 trials of examples/core_api/train.py, a few
seconds each, 4 at a time), run in each of detslurm's ways of placing trials, side by side, on
the test cluster idle and made busy (bench/busy_cluster.py: every job waits --wait-s in the
queue):

- ``per-trial``: today's default, each trial run its own Slurm job in the cpu pool (c1, c2);
- ``allocation``: one allocation of the same nodes (``salloc -N2 --ntasks-per-node=2``, the
  user's one job through the queue), the search inside it (``det e create --in-allocation``);
- ``pilots``: two pilot workers of two slots (``slurm.pilots``), the same 4 slots: one array
  of two one-node worker jobs through the queue, the daemon running the trials in them as steps.

Time to result is from the user's first command (``det e create``, or the ``salloc`` before it)
to the experiment's end as the store records it. Reported: each run's time, its trial runs' own
queue waits, the waits of the jobs the runs were steps of (the salloc, the workers), and the
ratios the goals name (on the busy cluster each mode against per-trial: <= 0.5x; on the idle
one, the slowest mode against the fastest: <= 1.1x). And the daemon's Slurm commands per tick:
a shim before each Slurm command on the daemon's PATH appends one line to the daemon's own tick
file (DETSLURM_TICK_STATS), so each command falls in the tick that issued it.

    eval "$(scripts/test-cluster env .state/cluster)"
    python bench/time_to_result.py [--wait-s 30] [--repeats 1] [--conditions idle,busy] [--modes ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
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
from busy_cluster import _epoch as slurm_time

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
# Workers of the allocation's shape: one node of 2 CPUs each (--nodes=1 --cpus-per-task=2).
PILOTS = f"slurm: {{pilots: {{count: {NODES}, slots: {SLOTS_PER_NODE}, time_limit: 60, idle_timeout: 60}}}}\n"
END_STATES = ("COMPLETED", "ERROR", "CANCELED", "PAUSED")
# The Slurm commands the daemon may issue; srun (a step's start) is counted by the daemon itself.
COUNTED = ("squeue", "sbatch", "scancel", "scontrol", "sinfo", "sacct")
HELD_NAMES = ("ttr-allocation", "det-e1-pilot")  # the jobs the runs are steps of


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
    """The same search with pilot workers of the allocation's shape, timed from its create; the
    daemon submits the workers and ends them when the search has nothing left to run."""
    with (ctx / "c.yaml").open("a") as f:
        f.write(PILOTS)
    t0 = time.time()
    create(ws, ctx)
    return Started(t0)


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
        by_state = s.execute(select(Trial.state, func.count()).group_by(Trial.state)).all()
        runs = s.execute(select(TrialRun.submit_time, TrialRun.start_time)).all()
    waits = [(start - submit).total_seconds() for submit, start in runs if start is not None]
    return {
        "state": str(getattr(exp.state, "value", exp.state)),
        "end": exp.end_time.timestamp() if exp.end_time else None,
        "trials": sum(n for _, n in by_state),
        "trial_states": {str(getattr(st, "value", st)): n for st, n in by_state},
        "runs": len(runs),
        "run_wait_s_median": statistics.median(waits) if waits else None,
        "run_wait_s_max": max(waits) if waits else None,
    }


def count_slurm_calls(ws: Workspace, ticks: Path) -> None:
    """Put a shim before each COUNTED command on the daemon's PATH: it appends the command and
    its parent's pid to ``ticks``, the file the daemon appends a line to at each tick's end."""
    bindir = ws.dir / "count-shim"
    bindir.mkdir()
    for cmd in COUNTED:
        real = shutil.which(cmd)
        if real is None:
            continue
        line = f'{{"cmd": "{cmd}", "ppid": %d}}\\n'
        (bindir / cmd).write_text(
            f'#!/bin/bash\nprintf \'{line}\' "$PPID" >> {shlex.quote(str(ticks))}\nexec {shlex.quote(real)} "$@"\n'
        )
        (bindir / cmd).chmod(0o755)
    ws.env["PATH"] = f"{bindir}:{ws.env['PATH']}"
    ws.env["DETSLURM_TICK_STATS"] = str(ticks)


def daemon_pid(ws: Workspace) -> int | None:
    try:
        return int(json.loads((ws.dir / "data/daemon.pid").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def per_tick(ticks: Path, pid: int | None) -> dict[str, Any]:
    """The daemon's Slurm commands per tick: each command line before a tick's own line (and
    after the previous tick's) was issued by that tick; commands of other processes (the
    create's CLI, the workers' scripts) are left out."""
    counts: list[dict[str, int]] = []
    calls: list[int] = []
    current: dict[str, int] = {}
    for raw in ticks.read_text().splitlines() if ticks.exists() else []:
        rec = json.loads(raw)
        if "cmd" in rec:
            if rec["ppid"] == pid:
                current[rec["cmd"]] = current.get(rec["cmd"], 0) + 1
        else:
            counts.append(current)
            calls.append(int(rec["slurm_calls"]))
            current = {}
    squeues = [c.get("squeue", 0) for c in counts]
    return {
        "ticks": len(counts),
        "squeue_per_tick_max": max(squeues, default=0),
        "ticks_by_squeue_count": {str(n): squeues.count(n) for n in sorted(set(squeues))},
        "per_tick_max": {cmd: max((c.get(cmd, 0) for c in counts), default=0) for cmd in COUNTED},
        "totals": {cmd: sum(c.get(cmd, 0) for c in counts) for cmd in COUNTED},
        # The daemon's own count per tick (its Slurm commands and the steps it started).
        "slurm_calls_per_tick_max": max(calls, default=0),
        "slurm_calls_per_tick_median": statistics.median(calls) if calls else None,
    }


def held_jobs(since: float) -> dict[str, Any]:
    """The allocation or the workers submitted since ``since`` (the jobs the runs were steps
    of): how many, and the queue waits (Slurm's start less submit time) of those that ran (a
    worker canceled while it waited ran for 0 s)."""
    out = subprocess.run(
        ["squeue", "-h", "-r", "--states=all", "-o", "%j|%V|%S|%M"], capture_output=True, text=True, check=False
    ).stdout
    submitted, waits = 0, []
    for line in out.splitlines():
        name, submit, start, used = line.split("|")
        if name not in HELD_NAMES or slurm_time(submit) < int(since):
            continue
        submitted += 1
        if start != "N/A" and used != "0:00":
            waits.append(slurm_time(start) - slurm_time(submit))
    return {"held_jobs_submitted": submitted, "held_job_waits_s": sorted(waits)}


def first_run_start(since: float) -> float | None:
    """Seconds from ``since`` to the first trial run's start, from the store."""
    from sqlalchemy import func, select

    from detslurm import settings
    from detslurm.store import TrialRun, open_store

    with open_store(settings.load().db_url).read() as s:
        first = s.scalar(select(func.min(TrialRun.start_time)))
    return first.timestamp() - since if first else None


def run_mode(mode: str, ctx_src: Path, timeout_s: float, logs: Path | None = None) -> dict[str, Any]:
    """One search in ``mode``; the daemon's log is kept as ``logs``, when given."""
    ws = Workspace(f"ttr-{mode}")
    ticks = ws.dir / "ticks.jsonl"
    count_slurm_calls(ws, ticks)
    ws.apply()
    ctx = ws.dir / "ctx"
    shutil.copytree(ctx_src, ctx)
    started: Started | None = None
    try:
        started = MODES[mode](ws, ctx)
        deadline = started.t0 + timeout_s
        pid = None
        while (r := outcome())["state"] not in END_STATES and time.time() < deadline:
            pid = pid or daemon_pid(ws)
            time.sleep(1)
        ended = r["end"] or time.time()
        return {
            "mode": mode,
            "time_to_result_s": ended - started.t0,
            **r,
            "first_run_start_s": first_run_start(started.t0),
            **held_jobs(started.t0),
            "slurm_calls": per_tick(ticks, pid or daemon_pid(ws)),
        }
    finally:
        for job in started.held if started else []:
            subprocess.run(["scancel", job], check=False)
        ws.det("daemon", "stop", check=False)
        if logs is not None and (ws.dir / "data/daemon.log").exists():
            shutil.copy2(ws.dir / "data/daemon.log", logs)
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
                    logs = args.logs / f"{cond}-{rep}-{mode}-daemon.log" if args.logs else None
                    row = run_mode(mode, ctx, args.timeout_s, logs)
                    rows.append({"condition": cond, "repeat": rep, "load_average": os.getloadavg()[0], **row})
                    print(f"{cond} {mode}: {row['time_to_result_s']:.1f} s ({row['state']})", flush=True)
        finally:
            if busy:
                load["busy_errors"] = busy.errors[:10]
                busy.stop()
    return rows, load


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wait-s", type=float, default=30.0, help="the queue wait of the busy cluster")
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--batch-s", type=float, default=0.25, help="each batch's sleep (40 batches at most)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--conditions", type=lambda s: s.split(","), default=["idle", "busy"])
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per search")
    ap.add_argument("--logs", type=Path, help="a dir to keep each search's daemon log in")
    args = ap.parse_args()
    if unknown := set(args.modes) - set(MODES):
        sys.exit(f"--modes: unknown {sorted(unknown)}; the modes are {', '.join(MODES)}")
    require_cluster()
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
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
