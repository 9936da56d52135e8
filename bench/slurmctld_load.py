"""slurmctld load: RPCs per daemon tick with 1, 10, 100 (and 1000 with --full) active trial jobs,
from sdiag's per-user and per-message counters, side by side with per-job polling (one
``squeue -j`` per job per tick, as TorchX's describe does). Trials are held job-array tasks, so
many are cheap. Goal: one query per tick whatever the count.

On the test cluster every daemon runs as root, so root's counter also moves with node
registrations and sdiag itself: an idle interval as long as the measured one is subtracted, and
the job-query messages (REQUEST_JOB_INFO*, REQUEST_JOB_USER_INFO) are reported on their own.

    python bench/slurmctld_load.py [--counts 1,10,100,1000] [--ticks T]   (needs the test cluster)
"""

from __future__ import annotations

import argparse
import functools
import getpass
import re
import subprocess
import sys
import time
from typing import Any

from _common import Workspace, require_cluster, save, scancel_mine

JOB_QUERIES = ("REQUEST_JOB_INFO", "REQUEST_JOB_INFO_SINGLE", "REQUEST_JOB_USER_INFO")


def sdiag() -> tuple[int, dict[str, int]]:
    """(this user's RPC count, count per message type)."""
    out = subprocess.run(["sdiag"], capture_output=True, text=True, check=True).stdout
    user = getpass.getuser()
    by_user = re.search(rf"^\s*{re.escape(user)}\s+\(\s*\d+\)\s+count:(\d+)", out, re.M)
    types = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*([A-Z_]+)\s+\(\s*\d+\)\s+count:(\d+)", out, re.M)}
    return (int(by_user.group(1)) if by_user else 0), types


def delta(before: tuple[int, dict[str, int]], after: tuple[int, dict[str, int]]) -> tuple[int, int]:
    """(user RPCs, job-query RPCs) between two snapshots."""
    queries = sum(after[1].get(k, 0) - before[1].get(k, 0) for k in JOB_QUERIES)
    return after[0] - before[0], queries


def measure(fn: Any, ticks: int) -> tuple[float, float, float, dict[str, float], float]:
    """(user RPCs, job-query RPCs, seconds, RPCs by message type, this process's CPU seconds),
    each per tick, for ``fn`` run ``ticks`` times."""
    before = sdiag()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(ticks):
        fn()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = sdiag()
    idle_before = sdiag()
    time.sleep(elapsed)
    idle = delta(idle_before, sdiag())
    user, queries = delta(before, after)
    types = {k: (v - before[1].get(k, 0)) / ticks for k, v in after[1].items() if v != before[1].get(k, 0)}
    return (user - idle[0]) / ticks, queries / ticks, elapsed / ticks, types, cpu / ticks


def per_job(jobs: list[str]) -> None:
    """One tick of per-job polling."""
    for j in jobs:
        subprocess.run(["squeue", "-h", "-j", j, "-o", "%T"], capture_output=True, check=False)


def setup(ws: Workspace, n: int) -> list[str]:
    ctx = ws.dir / f"ctx{n}"
    ctx.mkdir()
    (ctx / "noop.py").write_text("pass\n")
    (ctx / "c.yaml").write_text(f"""name: load-{n}
entrypoint: python3 noop.py
hyperparameters: {{x: {{type: int, minval: 0, maxval: {max(n - 1, 1)}, count: {n}}}}}
searcher: {{name: grid, metric: loss, max_length: {{batches: 1}}, max_concurrent_trials: {n}}}
slurm: {{sbatch_args: [--hold]}}
""")
    ws.det("e", "create", str(ctx / "c.yaml"), str(ctx))
    ws.det("daemon", "stop", check=False)  # the benchmark drives the ticks itself
    out = subprocess.run(["squeue", "-h", "-r", "-t", "PD", "-o", "%i"], capture_output=True, text=True).stdout
    return out.split()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1,10,100")
    ap.add_argument("--ticks", type=int, default=3)
    ap.add_argument(
        "--skip-per-job-from",
        type=int,
        default=0,
        help="counts from this one on measure no per-job polling (at 10,000 held tasks it is 10,000 squeues)",
    )
    args = ap.parse_args()
    require_cluster()
    from detslurm import daemon, settings

    rows: list[dict[str, Any]] = []
    ws = Workspace("load")
    try:
        for n in (int(c) for c in args.counts.split(",")):
            scancel_mine()
            ws.close()
            ws = Workspace("load")  # a fresh store: the last count's trials are gone with their jobs
            ws.apply()
            time.sleep(1)
            jobs = setup(ws, n)
            ctl = daemon.make_controller(settings.load())
            ctl.tick()  # warm: the capability probe is cached after this
            det_user, det_q, det_s, det_types, det_cpu = measure(ctl.tick, args.ticks)
            pj_ticks = 1 if n >= 100 else args.ticks
            if args.skip_per_job_from and n >= args.skip_per_job_from:
                # Three RPCs per job, as measured at the smaller counts: not worth 10,000 squeues.
                pj_user, pj_q, pj_s, pj_types = 3.0 * len(jobs), float(len(jobs)), float("nan"), {"estimated": 1.0}
            else:
                pj_user, pj_q, pj_s, pj_types, _ = measure(functools.partial(per_job, jobs), pj_ticks)
            rows.append(
                {
                    "jobs": len(jobs),
                    "detslurm_rpcs_per_tick": det_user,
                    "detslurm_job_queries_per_tick": det_q,
                    "detslurm_tick_s": det_s,
                    # The daemon's own CPU per tick (the tick runs in this process).
                    "detslurm_tick_cpu_s": det_cpu,
                    "per_job_rpcs_per_tick": pj_user,
                    "per_job_job_queries_per_tick": pj_q,
                    "per_job_tick_s": pj_s,
                    "detslurm_by_type": det_types,
                    "per_job_by_type": pj_types,
                }
            )
            print(rows[-1], flush=True)
    finally:
        scancel_mine()
        ws.close()
    save(
        "slurmctld_load",
        {"benchmark": "slurmctld_load", "ticks": args.ticks, "rows": rows, "goal_job_queries_per_tick": 1},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
