"""Submission: ``det e create`` of an N-trial grid experiment (N=256 full, 32 quick) until every
trial is in Slurm's queue, side by side with a loop of N sbatch calls and with submitit's job-array
submission (``map_array``) of N equivalent no-op tasks. Counts sbatch calls (a counting sbatch on
PATH) and wall time; all jobs are submitted held and canceled after each repeat, so only
submission is measured. Goals: at most 2 sbatch calls; wall time no worse than submitit's.
The floor of a create made in the CLI's own process is shown beside them (``FLOOR``).

    python bench/submission.py [--trials N] [--repeats R]      (needs the test cluster)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from _common import Workspace, median, require_cluster, save, scancel_mine


def pending(prefix: str) -> int:
    out = subprocess.run(
        ["squeue", "-h", "-r", "-t", "PD", "-o", "%j"], capture_output=True, text=True, check=True
    ).stdout
    return sum(1 for name in out.split() if name.startswith(prefix))


def wait_queued(prefix: str, n: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while pending(prefix) < n:
        if time.time() > deadline:
            raise TimeoutError(f"only {pending(prefix)} of {n} jobs reached the queue")
        time.sleep(0.05)


def clear_queue() -> None:
    scancel_mine()
    deadline = time.time() + 60
    while pending("") and time.time() < deadline:
        time.sleep(0.1)


def detslurm_once(ws: Workspace, n: int, calls: Path) -> tuple[float, int]:
    ctx = ws.dir / "ctx"
    ctx.mkdir(exist_ok=True)
    (ctx / "noop.py").write_text("pass\n")
    (ctx / "grid.yaml").write_text(f"""name: bench-grid
entrypoint: python3 noop.py
hyperparameters: {{x: {{type: int, minval: 0, maxval: {n - 1}, count: {n}}}}}
searcher: {{name: grid, metric: loss, max_length: {{batches: 1}}, max_concurrent_trials: {n}}}
slurm: {{sbatch_args: [--hold]}}
""")
    calls.write_text("")
    t0 = time.perf_counter()
    ws.det("e", "create", str(ctx / "grid.yaml"), str(ctx))
    wait_queued("det-e", n)
    elapsed = time.perf_counter() - t0
    ws.det("daemon", "stop", check=False)  # the jobs stay held; the next repeat starts clean
    # Submissions only: the create's one `sbatch --test-only` (admission check, queues nothing,
    # one per job shape whatever N is) is not a submission.
    return elapsed, len([c for c in calls.read_text().splitlines() if not c.startswith("--test-only")])


def loop_once(ws: Workspace, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        subprocess.run(
            ["sbatch", "--parsable", "--hold", "-p", "cpu", "-o", "/dev/null", "-J", f"loop-{i}", "--wrap", "true"],
            capture_output=True,
            check=True,
            env=ws.env,
        )
    wait_queued("loop-", n)
    return time.perf_counter() - t0


SUBMITIT = """
import sys, submitit
def noop(i):
    return i
ex = submitit.AutoExecutor(folder=sys.argv[1] + "/%j", cluster="slurm")
ex.update_parameters(slurm_partition="cpu", timeout_min=5, name="submitit", slurm_additional_parameters={"hold": True})
ex.map_array(noop, range(int(sys.argv[2])))
"""


def submitit_once(ws: Workspace, n: int) -> float:
    """As a user runs it: a Python script that submits (interpreter start-up included, as for det)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", SUBMITIT, str(ws.dir / "submitit"), str(n)], check=True, env=ws.env)
    wait_queued("submitit", n)
    return time.perf_counter() - t0


# The floor of a create in the CLI's own process, as this design makes it: a Python that imports
# what that process must (click; pydantic for the config's models; SQLAlchemy's ORM, the store's
# one owner; jinja2 for the sbatch script) and asks Slurm what a create must ask (the admission
# check, then the one array), and does nothing else: no config, no store, no files.
FLOOR = """
import subprocess, sys
import click, jinja2, pydantic, sqlalchemy.orm
args = ["-p", "cpu", "-o", "/dev/null", "-J", "floor", "--hold", f"--array=0-{int(sys.argv[1]) - 1}", "--wrap", "true"]
subprocess.run(["sbatch", "--test-only", *args], check=True, capture_output=True)
subprocess.run(["sbatch", "--parsable", *args], check=True, capture_output=True)
"""


def floor_once(ws: Workspace, n: int) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR, str(n)], check=True, env=ws.env)
    wait_queued("floor", n)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    require_cluster()
    ws = Workspace("submission")
    res: dict[str, list[float]] = {"detslurm": [], "sbatch_loop": [], "submitit": [], "floor": []}
    det_calls: list[int] = []
    try:
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
            for name in res:
                clear_queue()
                if name == "detslurm":
                    ws.close()
                    ws = Workspace("submission")  # a fresh store: nothing of the last repeat to reconcile
                    t, c = detslurm_once(ws, args.trials, ws.counting_sbatch())
                    det_calls.append(c)
                elif name == "floor":
                    t = floor_once(ws, args.trials)
                else:
                    t = loop_once(ws, args.trials) if name == "sbatch_loop" else submitit_once(ws, args.trials)
                res[name].append(t)
    finally:
        scancel_mine()
        ws.close()
    med = {k: median(v) for k, v in res.items()}
    save(
        "submission",
        {
            "benchmark": "submission",
            "trials": args.trials,
            "repeats": args.repeats,
            "unit": "s",
            "samples": res,
            "median_s": med,
            "detslurm_sbatch_calls": det_calls,
            "goal_sbatch_calls_max": 2,
            "ratio_vs_submitit": med["detslurm"] / med["submitit"],
            "ratio_vs_sbatch_loop": med["detslurm"] / med["sbatch_loop"],
            "goal_ratio_vs_submitit_max": 1.0,
            "floor_ratio_vs_submitit": med["floor"] / med["submitit"],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
