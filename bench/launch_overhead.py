"""Launch overhead: job start -> first training step of a 2-node x 2-process DDP job.

Side by side on the same cluster in one run: detslurm (torch_distributed launcher inside a trial
run, through exec.launch: context extraction, env contract, rendezvous ports) against a raw
``srun torchrun`` of the same script. Each job writes its start time as the first line of its
batch script (for detslurm, through the site config's setup lines), and rank 0 writes the time
its first step finished. Reported: medians and their ratio (goal <= 1.05x).

How the sides are kept comparable on a small shared machine:
- the order of the sides rotates every repeat, and the load average is recorded per repeat;
- each detslurm side's daemon is started before the first repeat, so its one-time start-up
  (SQLAlchemy and the store) never overlaps a job's window (on a cluster it runs on the login
  node, not on the job's nodes); its ticks do overlap, as they would;
- every side reads bytecode from one private cache in this run's own dir
  (``PYTHONPYCACHEPREFIX``; an installed package has its bytecode compiled), filled by one
  process per interpreter before the first job, whatever PYTHONDONTWRITEBYTECODE the caller's
  environment sets; ``--warmup`` untimed rounds come on top.

``--compare-python PY`` adds a second detslurm side run by another install's interpreter (its
``det`` next to PY), e.g. a checkout of the previous version: before/after in one run.

Needs the test cluster (SLURM_CONF) and torch:  python bench/launch_overhead.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
# What the timed processes import: torchrun's agent, the ranks' DDP step, our launcher.
WARM_IMPORTS = "import torch, torch.distributed.run, torch.nn.parallel, detslurm.exec.launch"


def _det_next_to(python: str) -> str:
    det = Path(python).parent / "det"
    return str(det if det.exists() else ROOT / ".venv/bin/det")


def wait_file(path: Path, timeout: float = 900) -> float:
    # A guard, not a measurement: a 2-node torch job on a loaded 2-core machine took over 3 min.
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_text().strip():
            return float(path.read_text())
        time.sleep(0.1)
    raise TimeoutError(f"{path} never appeared")


def raw_once(work: Path, env: dict[str, str]) -> float:
    out = Path(tempfile.mkdtemp(dir=work))
    script = f"""#!/bin/bash
date +%s.%N > {out}/job_start
export BENCH_OUT={out}
srun --nodes=2 --ntasks-per-node=1 bash -c '{PY} -m torch.distributed.run --nnodes 2 --nproc_per_node 2 \\
  --node_rank $SLURM_NODEID --max_restarts 0 --master_addr c1 --master_port $((20000 + SLURM_JOB_ID % 20000)) \\
  {HERE / "first_step.py"}'
"""
    subprocess.run(
        ["sbatch", "--parsable", "-N2", "--ntasks-per-node=1", "-c", "2", "-o", str(out / "log")],
        input=script,
        text=True,
        check=True,
        capture_output=True,
        env=env,
    )
    return wait_file(out / "first_step") - wait_file(out / "job_start")


@dataclass
class DetSide:
    """One detslurm install: its `det`, and a private store and experiments dir."""

    name: str
    det: str
    env: dict[str, str]
    times: list[float] = field(default_factory=list)

    def once(self, work: Path) -> float:
        ctx = Path(tempfile.mkdtemp(dir=work))
        shutil.copy(HERE / "first_step.py", ctx)
        (ctx / "c.yaml").write_text(
            "entrypoint: python3 -m determined.launch.torch_distributed python3 first_step.py\n"
            "searcher: {name: single, metric: loss}\nresources: {slots_per_trial: 4}\nmax_restarts: 0\n"
            f"environment: {{environment_variables: [BENCH_OUT={ctx}]}}\n"
        )
        exps = Path(self.env["DETSLURM_EXPERIMENTS_DIR"])
        before = set(exps.glob("exp-*")) if exps.exists() else set()
        subprocess.run(
            [self.det, "e", "create", str(ctx / "c.yaml"), str(ctx)], env=self.env, check=True, capture_output=True
        )
        (exp,) = set(exps.glob("exp-*")) - before
        first = wait_file(ctx / "first_step")
        start = wait_file(next(iter(exp.glob("trials/*/runs/1")), exp) / "job_start")
        return first - start


def _env(work: Path, pycache: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(pycache))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _det_side(name: str, python: str, work: Path, base: dict[str, str]) -> DetSide:
    site = work / "site.yaml"
    if not site.exists():
        site.write_text(
            (ROOT / "site-configs/test-cluster.yaml").read_text()
            + 'setup:\n  - date +%s.%N > "$DET_RUN_DIR/job_start"\n'
        )
    d = work / name
    env = dict(
        base,
        DETSLURM_SITE_CONFIG=str(site),
        DETSLURM_DATA_DIR=str(d / "data"),
        DETSLURM_EXPERIMENTS_DIR=str(d / "exps"),
        DETSLURM_CHECKPOINT_DIR=str(d / "ck"),
        DETSLURM_CONFIG=str(d / "none.yaml"),
        DETSLURM_POLL_INTERVAL_S="0.5",
    )
    return DetSide(name, _det_next_to(python), env)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--compare-python", help="also run the detslurm installed for this interpreter")
    ap.add_argument(
        "--pycache-prefix",
        help="the bytecode cache every side reads (PYTHONPYCACHEPREFIX); default: a private one in this run's dir",
    )
    return ap.parse_args()


def _warm(pythons: set[str], env: dict[str, str]) -> None:
    """Fill the bytecode cache once, in one process each, before any job: a cold cache is
    compiled by all six processes of the first job at once (agents and ranks), which on a
    fresh, busy 2-core machine outlasted wait_file's limit (CI), and would be timed otherwise."""
    for python in pythons:
        subprocess.run([python, "-c", WARM_IMPORTS], env=env, check=True, capture_output=True)


def main() -> int:
    args = _args()
    work = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    # Private (mkdtemp, 0700) unless asked: a fixed name in /tmp could hold another user's .pyc files.
    base = _env(work, Path(args.pycache_prefix) if args.pycache_prefix else work / "pycache")
    sides = [_det_side("detslurm", PY, work, base)]
    if args.compare_python:
        sides.append(_det_side("compare", args.compare_python, work, base))
    _warm({PY, args.compare_python or PY}, base)
    raw: list[float] = []
    loads: list[float] = []
    try:
        for side in sides:  # start-up before any window (see the module doc)
            subprocess.run([side.det, "daemon", "start"], env=side.env, check=True, capture_output=True)
        runs = [("raw", lambda: raw_once(work, base), raw)] + [
            (s.name, lambda s=s: s.once(work), s.times) for s in sides
        ]
        for i in range(args.warmup + args.repeats):
            shift = i % len(runs)  # rotate the order: drift on a shared machine hits every side alike
            for name, fn, times in runs[shift:] + runs[:shift]:
                value = fn()
                if i >= args.warmup:
                    times.append(value)
                    print(f"repeat {i - args.warmup + 1} {name}: {value:.2f} s", file=sys.stderr, flush=True)
            if i >= args.warmup:
                loads.append(os.getloadavg()[0])
    finally:
        for side in sides:
            subprocess.run([side.det, "daemon", "stop"], env=side.env, capture_output=True)
    ours = sides[0]
    result = {
        "benchmark": "launch_overhead",
        "unit": "s",
        "repeats": args.repeats,
        "warmup": args.warmup,
        "load_average_1min": loads,
        "raw_srun_torchrun_s": raw,
        "detslurm_s": ours.times,
        "raw_median_s": statistics.median(raw),
        "detslurm_median_s": statistics.median(ours.times),
        "ratio": statistics.median(ours.times) / statistics.median(raw),
        "goal_ratio_max": 1.05,
    }
    if args.compare_python:
        other = sides[1]
        result |= {
            "compare_python": args.compare_python,
            "compare_s": other.times,
            "compare_median_s": statistics.median(other.times),
            "compare_ratio": statistics.median(other.times) / statistics.median(raw),
        }
    results = Path(os.environ.get("BENCH_RESULTS_DIR") or HERE / "results")
    results.mkdir(parents=True, exist_ok=True)
    (results / "launch_overhead.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
