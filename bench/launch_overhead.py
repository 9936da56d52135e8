"""Launch overhead: job start -> first training step of a 2-node x 2-process DDP job.

Side by side on the same cluster in one run: detslurm (torch_distributed launcher inside a trial
run, through exec.launch: context extraction, env contract, rendezvous ports) against a raw
``srun torchrun`` of the same script. Each job writes its start time as the first line of its
batch script (for detslurm, through the site config's setup lines), and rank 0 writes the time
its first step finished. Reported: medians and their ratio (goal <= 1.1x).

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
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
DET = str(Path(PY).parent / "det") if (Path(PY).parent / "det").exists() else str(ROOT / ".venv/bin/det")


def wait_file(path: Path, timeout: float = 180) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_text().strip():
            return float(path.read_text())
        time.sleep(0.1)
    raise TimeoutError(f"{path} never appeared")


def raw_once(work: Path) -> float:
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
    )
    return wait_file(out / "first_step") - wait_file(out / "job_start")


def det_once(work: Path, env: dict[str, str]) -> float:
    ctx = Path(tempfile.mkdtemp(dir=work))
    shutil.copy(HERE / "first_step.py", ctx)
    (ctx / "c.yaml").write_text(
        "entrypoint: python3 -m determined.launch.torch_distributed python3 first_step.py\n"
        "searcher: {name: single, metric: loss}\nresources: {slots_per_trial: 4}\nmax_restarts: 0\n"
        f"environment: {{environment_variables: [BENCH_OUT={ctx}]}}\n"
    )
    exps = Path(env["DETSLURM_EXPERIMENTS_DIR"])
    before = set(exps.glob("exp-*")) if exps.exists() else set()
    subprocess.run(
        [DET, "e", "create", str(ctx / "c.yaml"), str(ctx)],
        env=env,
        check=True,
        capture_output=True,
    )
    (exp,) = set(Path(env["DETSLURM_EXPERIMENTS_DIR"]).glob("exp-*")) - before
    first = wait_file(ctx / "first_step")
    start = wait_file(next(iter(exp.glob("trials/*/runs/1")), exp) / "job_start")
    return first - start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    site = work / "site.yaml"
    site.write_text(
        (ROOT / "site-configs/test-cluster.yaml").read_text() + 'setup:\n  - date +%s.%N > "$DET_RUN_DIR/job_start"\n'
    )
    env = dict(
        os.environ,
        DETSLURM_SITE_CONFIG=str(site),
        DETSLURM_DATA_DIR=str(work / "data"),
        DETSLURM_EXPERIMENTS_DIR=str(work / "exps"),
        DETSLURM_CHECKPOINT_DIR=str(work / "ck"),
        DETSLURM_POLL_INTERVAL_S="0.5",
    )
    raw, det = [], []
    try:
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
            raw.append(raw_once(work))
            det.append(det_once(work, env))
    finally:
        subprocess.run([DET, "daemon", "stop"], env=env, capture_output=True)
    result = {
        "benchmark": "launch_overhead",
        "unit": "s",
        "repeats": args.repeats,
        "raw_srun_torchrun_s": raw,
        "detslurm_s": det,
        "raw_median_s": statistics.median(raw),
        "detslurm_median_s": statistics.median(det),
        "ratio": statistics.median(det) / statistics.median(raw),
        "goal_ratio_max": 1.1,
    }
    results = Path(os.environ.get("BENCH_RESULTS_DIR") or HERE / "results")
    results.mkdir(parents=True, exist_ok=True)
    (results / "launch_overhead.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
