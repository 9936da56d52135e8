"""Fail-fast: one rank of a 2-node x 2-process DDP job exits 3 while the other three wait in a
gloo collective; the time from its exit to the end of the job's batch script.

Side by side on the same cluster, same script (tests/fixtures/ddp_train.py, FAIL_RANK=3):
- detslurm: ``det e create`` with the torch_distributed launcher; the end is the run's exit
  record (exit.json), written by the batch script once srun returns;
- baseline: the plain way, ``srun --kill-on-bad-exit=1 torchrun ...`` in an sbatch script
  (Slurm's own fail-fast around torchrun's); the end is a line the script writes after srun.
The sides alternate, and the load average is recorded per repeat. Reported: medians and their
ratio (goal < 1.0x: a detslurm job goes down no later than the plain one).

Needs the test cluster (SLURM_CONF) and torch:  python bench/fail_fast.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, Workspace, median, require_cluster, save, scancel_mine

FIXTURE = ROOT / "tests/fixtures/ddp_train.py"
CONFIG = (
    "entrypoint: python3 -m determined.launch.torch_distributed python3 ddp_train.py\n"
    "searcher: {name: single, metric: loss}\nmax_restarts: 0\nresources: {slots_per_trial: 4}\n"
    "environment: {environment_variables: [FAIL_RANK=3]}\n"
)


def _wait(path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if time.time() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.2)


def detslurm_side(ws: Workspace, n: int) -> float:
    ctx = ws.dir / f"ctx{n}"
    ctx.mkdir()
    (ctx / "ddp_train.py").write_text(FIXTURE.read_text())
    (ws.dir / f"c{n}.yaml").write_text(CONFIG)
    out = ws.det("e", "create", str(ws.dir / f"c{n}.yaml"), str(ctx)).stdout
    exp = out.split("Created experiment ", 1)[1].split()[0]
    ws.det("e", "wait", exp, check=False)
    (run,) = (ws.dir / "exps").glob(f"exp-{exp}-*/trials/*/runs/*")
    return (run / "exit.json").stat().st_mtime - float((run / "fail_time").read_text())


def plain_side(ws: Workspace, n: int) -> float:
    """The same ranks under torchrun, with nothing of detslurm's launch path."""
    run = ws.dir / f"plain{n}"
    run.mkdir()
    (run / "ddp_train.py").write_text(FIXTURE.read_text())
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--max_restarts=0",
        "--node_rank=$SLURM_NODEID", "--master_addr=$MASTER", f"--master_port={29400 + n % 200}",
        "ddp_train.py",
    ]  # fmt: skip
    line = " ".join(shlex.quote(a) if "$" not in a else f'"{a}"' for a in torchrun)
    script = (
        "#!/bin/bash\n"
        f"cd {shlex.quote(str(run))}\n"
        'MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
        f"export FAIL_RANK=3 DET_RUN_DIR={shlex.quote(str(run))} MASTER\n"
        f"srun --kill-on-bad-exit=1 -N2 --ntasks-per-node=1 bash -c {shlex.quote(line)}\n"
        'python3 -c "import time; print(time.time())" > end.tmp && mv end.tmp end\n'
    )
    (run / "job.sh").write_text(script)
    argv = ["sbatch", "--parsable", "-p", "cpu", "-N2", "-c2", "-o", str(run / "out.log"), str(run / "job.sh")]
    subprocess.run(argv, env=ws.env, check=True, capture_output=True)
    _wait(run / "end", 600)
    if not (run / "fail_time").exists():
        raise SystemExit(f"the plain job's rank 3 never ran:\n{(run / 'out.log').read_text()[-3000:]}")
    return float((run / "end").read_text()) - float((run / "fail_time").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    require_cluster()
    ws = Workspace("fail-fast")
    sides = {"detslurm": detslurm_side, "plain": plain_side}
    got: dict[str, list[float]] = {k: [] for k in sides}
    loads = []
    try:
        for n in range(args.repeats):
            order = list(sides) if n % 2 == 0 else list(reversed(sides))
            for name in order:
                got[name].append(round(sides[name](ws, n), 2))
            loads.append(round(os.getloadavg()[0], 1))
    finally:
        scancel_mine()
        ws.close()
    ours, plain = median(got["detslurm"]), median(got["plain"])
    save(
        "fail_fast",
        {
            "detslurm_s": got["detslurm"],
            "plain_srun_torchrun_s": got["plain"],
            "detslurm_median_s": ours,
            "plain_median_s": plain,
            "ratio": round(ours / plain, 3),
            "load_avg": loads,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
