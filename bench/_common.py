"""What every benchmark shares: a private detslurm environment on the test cluster, an sbatch
that counts its calls, results files, and medians measured side by side."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The `det` of the venv running the benchmark: the checkout's .venv, or the venv of the Slurm
# 24.11 chroot (scripts/test-slurm24), where the checkout's .venv cannot run.
_VENV_DET = Path(sys.executable).parent / "det"
DET = str(_VENV_DET if _VENV_DET.exists() else ROOT / ".venv/bin/det")
sys.path.insert(0, str(ROOT))


def require_cluster() -> None:
    if not os.environ.get("SLURM_CONF"):
        sys.exit('this benchmark needs the test cluster: eval "$(scripts/test-cluster env .state/cluster)"')


class Workspace:
    """Private store, experiment dirs and checkpoints for one benchmark run; its daemon stops
    and its jobs are canceled when the benchmark ends."""

    def __init__(self, name: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        self.env = dict(
            os.environ,
            DETSLURM_DATA_DIR=str(self.dir / "data"),
            DETSLURM_EXPERIMENTS_DIR=str(self.dir / "exps"),
            DETSLURM_CHECKPOINT_DIR=str(self.dir / "ck"),
            DETSLURM_CONFIG=str(self.dir / "none.yaml"),
            DETSLURM_POLL_INTERVAL_S="0.5",
            DETSLURM_SITE_CONFIG=str(ROOT / "site-configs/test-cluster.yaml"),
        )

    def apply(self) -> None:
        """Use this workspace in this process too (for in-process controllers)."""
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("DETSLURM_")})

    def det(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([DET, *args], env=self.env, capture_output=True, text=True, check=check)

    def counting_sbatch(self) -> Path:
        """Put an sbatch first on PATH that logs each call, then runs the real one."""
        real = shutil.which("sbatch")
        if real is None:
            sys.exit("sbatch not found: is the test cluster's Slurm installed?")
        bindir, log = self.dir / "shim", self.dir / "sbatch-calls.log"
        bindir.mkdir(exist_ok=True)
        (bindir / "sbatch").write_text(
            f'#!/bin/bash\necho "$*" >> {shlex.quote(str(log))}\nexec {shlex.quote(real)} "$@"\n'
        )
        (bindir / "sbatch").chmod(0o755)
        self.env["PATH"] = f"{bindir}:{self.env['PATH']}"
        log.write_text("")
        return log

    def close(self) -> None:
        self.det("daemon", "stop", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def installed_det(where: Path) -> Path:
    """The bin dir of a fresh venv at ``where`` holding detslurm as the README's ``pip install .``
    installs it, its dependencies shared with this venv (a path in a .pth). The checkout's own
    venv has an editable install, whose import finder costs every Python start about 10 ms that a
    user's install does not: start-up timings are taken from this one."""
    src = where / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("detslurm", "cli", "launchers", "templates"):  # a copy: no build/ left in the checkout
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv = where / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin/python")
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # A path line only: this venv's own .pth files (its editable finder among them) are not run there.
    (Path(purelib) / "_bench_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, str(src)], check=True, capture_output=True)
    return venv / "bin"


def scancel_mine() -> None:
    subprocess.run(["scancel", "-u", os.environ.get("USER") or "root"], check=False)


def ended_experiment_row(name: str, owner: str, config: dict[str, Any], exp_dir: str, now: datetime) -> dict[str, Any]:
    """An experiment that has COMPLETED, as a Core insert row of the experiments table."""
    return {
        "name": name,
        "owner": owner,
        "state": "COMPLETED",
        "config": config,
        "original_config": "",
        "context_sha256": "0" * 64,
        "exp_dir": exp_dir,
        "executor": "local",
        "resource_pool": "cpu",
        "progress": 1.0,
        "archived": False,
        "test_mode": False,
        "start_time": now,
        "end_time": now,
    }


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def results_dir() -> Path:
    """bench/results, or BENCH_RESULTS_DIR (the tests run the benchmarks at toy sizes there)."""
    path = Path(os.environ.get("BENCH_RESULTS_DIR") or HERE / "results")
    path.mkdir(parents=True, exist_ok=True)
    return path


def save(name: str, result: dict[str, Any]) -> None:
    (results_dir() / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
