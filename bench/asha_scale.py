"""A large adaptive ASHA search on the real test cluster, run by the real daemon:
up to --trials trials (10,000 with --full) of a trivial entrypoint that reports one validation per
step, submitted as job arrays and throttled by max_concurrent_trials, for --budget-s seconds or
until the search ends. Reported: slurmctld RPCs per minute (sdiag, as slurmctld_load.py reads it,
less an idle interval), sbatch calls, trials completed, the daemon's CPU per tick (its own
per-tick lines, DETSLURM_TICK_STATS), store size, and `det e describe` latency at the end.

    python bench/asha_scale.py [--trials N] [--concurrent C] [--budget-s S] [--poll-s P] [--full]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from _common import Workspace, require_cluster, save, scancel_mine
from slurmctld_load import sdiag

# What each trial does: one validation per step (a rung is a step count), stopping when the
# searcher says so. No checkpoints: a trial that is stopped early simply ends.
TRIAL = """import determined as det

info = det.get_cluster_info()
hp = info.trial.hparams
with det.core.init() as ctx:
    for step in range(1, {steps} + 1):
        loss = (hp["x"] - 0.3) ** 2 + 1.0 / step
        ctx.train.report_validation_metrics(steps_completed=step, metrics={{"validation_loss": loss, "batches": step}})
        if ctx.preempt.should_preempt():
            break
"""

# The message types a detslurm daemon's own commands send (squeue, sbatch, scancel, scontrol);
# the rest of root's count on the test cluster is the jobs themselves and the nodes.
DAEMON_TYPES = (
    "REQUEST_JOB_INFO",
    "REQUEST_JOB_INFO_SINGLE",
    "REQUEST_JOB_USER_INFO",
    "REQUEST_PARTITION_INFO",
    "REQUEST_SUBMIT_BATCH_JOB",
    "REQUEST_KILL_JOB",
    "REQUEST_CANCEL_JOB_STEP",
    "REQUEST_UPDATE_JOB",
    "REQUEST_BUILD_INFO",
    "REQUEST_JOB_WILL_RUN",
)


def config(trials: int, concurrent: int, steps: int) -> str:
    return f"""name: asha-scale
entrypoint: python3 trial.py
hyperparameters: {{x: {{type: double, minval: 0, maxval: 1}}}}
searcher:
  name: adaptive_asha
  metric: validation_loss
  smaller_is_better: true
  max_trials: {trials}
  max_time: {steps}
  time_metric: batches
  max_concurrent_trials: {concurrent}
max_restarts: 0
"""


def trial_states() -> tuple[str, dict[str, int]]:
    """The experiment's state and its trials by state, read from the store."""
    from sqlalchemy import func, select

    from detslurm import settings
    from detslurm.store import Experiment, Trial, open_store

    with open_store(settings.load().db_url).read() as s:
        exp = s.scalar(select(Experiment.state).where(Experiment.id == 1))
        rows = s.execute(select(Trial.state, func.count()).group_by(Trial.state)).all()
    return _name(exp), {_name(state): int(n) for state, n in rows}


def _name(state: Any) -> str:
    return str(getattr(state, "value", state))


def run_search(ws: Workspace, args: argparse.Namespace) -> dict[str, Any]:
    ctx = ws.dir / "ctx"
    ctx.mkdir()
    (ctx / "trial.py").write_text(TRIAL.format(steps=args.steps))
    (ctx / "c.yaml").write_text(config(args.trials, args.concurrent, args.steps))
    sbatch_log = ws.counting_sbatch()
    ticks = ws.dir / "ticks.jsonl"
    ws.env["DETSLURM_TICK_STATS"] = str(ticks)
    ws.env["DETSLURM_POLL_INTERVAL_S"] = str(args.poll_s)
    before, t0 = sdiag(), time.perf_counter()
    ws.det("e", "create", str(ctx / "c.yaml"), str(ctx))
    ended = False
    while time.perf_counter() - t0 < args.budget_s:
        time.sleep(2)
        if trial_states()[0] in ("COMPLETED", "ERROR", "CANCELED"):
            ended = True
            break
    elapsed = time.perf_counter() - t0
    after = sdiag()
    d0 = time.perf_counter()
    ws.det("e", "describe", "1")
    describe_s = time.perf_counter() - d0
    ws.det("daemon", "stop", check=False)
    state, states = trial_states()
    lines = [json.loads(line) for line in ticks.read_text().splitlines()] if ticks.exists() else []
    cpu = [t["cpu_s"] for t in lines]
    by_type = {k: v - before[1].get(k, 0) for k, v in after[1].items() if v != before[1].get(k, 0)}
    return {
        "elapsed_s": elapsed,
        "search_ended": ended,
        "experiment_state": state,
        "rpcs": after[0] - before[0],
        "rpcs_by_type": by_type,
        "daemon_rpcs": sum(by_type.get(k, 0) for k in DAEMON_TYPES),
        # The create's one `sbatch --test-only` queues nothing: not a submission.
        "sbatch_calls": sum(1 for c in sbatch_log.read_text().splitlines() if not c.startswith("--test-only")),
        "trials": sum(states.values()),
        "trial_states": states,
        "ticks": len(lines),
        "slurm_commands_per_tick_max": max((t["slurm_calls"] for t in lines), default=0),
        "job_queries_per_tick": by_type.get("REQUEST_JOB_INFO", 0) / max(1, len(lines)),
        "tick_cpu_s_median": statistics.median(cpu) if cpu else None,
        "tick_cpu_s_max": max(cpu) if cpu else None,
        "describe_s": describe_s,
        "store_mb": sum(f.stat().st_size for f in (ws.dir / "data").glob("*.db*")) / 2**20,
    }


def idle_rpcs_per_min(seconds: float) -> float:
    """Root's RPCs per minute with nothing of ours running (the nodes' own traffic, sdiag)."""
    before = sdiag()
    time.sleep(seconds)
    return (sdiag()[0] - before[0]) * 60 / seconds


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=500)
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--steps", type=int, default=9, help="max_time: rungs at 1, 3, 9 with the default divisor")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--poll-s", type=float, default=5.0, help="the daemon's poll interval")
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--full", action="store_true", help="10,000 trials, 256 at a time, an hour at most")
    args = ap.parse_args()
    if args.full:
        args.trials, args.concurrent, args.budget_s = 10_000, 256, max(args.budget_s, 3600.0)
    require_cluster()
    scancel_mine()
    ws = Workspace("asha")
    ws.apply()
    try:
        r = run_search(ws, args)
    finally:
        scancel_mine()
        ws.close()
    idle = idle_rpcs_per_min(args.idle_s)
    minutes = r["elapsed_s"] / 60
    r.update(
        benchmark="asha_scale",
        max_trials=args.trials,
        concurrent=args.concurrent,
        poll_s=args.poll_s,
        budget_s=args.budget_s,
        idle_rpcs_per_min=idle,
        rpcs_per_min=r["rpcs"] / minutes - idle,
        daemon_rpcs_per_min=r["daemon_rpcs"] / minutes,
        load_average=list(os.getloadavg()),
        goal_rpcs_per_min=60,
    )
    save("asha_scale", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
