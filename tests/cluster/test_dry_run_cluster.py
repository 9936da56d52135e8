"""The dry run is the plan: what `det e create --dry-run` prints is what slurmctld receives.

Checked on the real test cluster: an experiment is created (paused, so nothing runs), then
activated; the batch script slurmctld stored (`scontrol write batch_script`) and the job's
options (`scontrol show job`) are compared with the dry run's output, apart from the random
part of the experiment dir and the job tag derived from it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, write

from detslurm.slurm.parse import parse_key_values

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
CORE = EXAMPLES / "core_api"


def submissions(text: str) -> list[tuple[list[str], str]]:
    """(sbatch arguments, script) of every sbatch here-document in a dry run's output."""
    out = []
    for m in re.finditer(r"^sbatch --parsable (.*) <<'SCRIPT'\n(.*?)^SCRIPT$", text, re.M | re.S):
        out.append((shlex.split(m.group(1)), m.group(2)))
    return out


def normalize(text: str) -> str:
    # Each experiment dir has a random part (store identity); the tag is a hash of the dir.
    text = re.sub(r"exp-(\d+)-[0-9a-f]{8}", r"exp-\1-X", text)
    return re.sub(r"tag=[0-9a-f]{10}", "tag=X", text)


def our_jobs() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %k"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if "detslurm:" in line]


def wait_jobs(n: int, timeout: float = 60) -> list[str]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        jobs = our_jobs()
        if len(jobs) >= n:
            return jobs
        time.sleep(0.3)
    raise AssertionError(f"expected {n} jobs, saw {our_jobs()}")


def stored_script(job: str) -> str:
    base = job.split("_")[0]
    return subprocess.run(
        ["scontrol", "write", "batch_script", base, "-"], capture_output=True, text=True, check=True
    ).stdout


def job_options(job: str) -> dict[str, str]:
    base = job.split("_")[0]  # a pending array shows as 12_[0-2]; its first line is a task
    out = subprocess.run(["scontrol", "show", "job", "-o", base], capture_output=True, text=True, check=True).stdout
    return parse_key_values(out.splitlines()[0])


def option(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))


@pytest.mark.parametrize("trials", [1, 3])
@pytest.mark.slurm24_smoke
def test_dry_run_equals_what_slurm_received(det: Any, tmp_path: Path, trials: int) -> None:
    vals = list(range(trials))
    cfg = write(
        tmp_path / "c.yaml",
        "name: same\nentrypoint: python3 train.py\n"
        "searcher: {name: grid, metric: validation_loss, max_length: 4}\n"
        # The example's own hparams too: without them its first batch raised KeyError, and on a
        # quick machine the daemon had resubmitted the trial (run 2) before its job was compared.
        f"hyperparameters: {{x: {{type: categorical, vals: {vals}}}, sleep: 5, lr: 0.05, noise: 0.1}}\n"
        "reproducibility: {experiment_seed: 7}\n"
        "environment: {environment_variables: [WANDB_MODE=offline, FOO=bar baz]}\n",
    )
    code, dry, err = det("e", "create", "--dry-run", cfg, CORE)
    assert code == 0, err
    planned = submissions(dry)
    assert len(planned) == 1, dry
    args, script = planned[0]
    code, out, err = det("e", "create", "--paused", cfg, CORE)
    assert code == 0 and "Created experiment 1" in out, err
    assert our_jobs() == []
    assert det("e", "activate", "1")[0] == 0
    job = wait_jobs(1)[0]
    assert normalize(stored_script(job)) == normalize(script)
    assert "export FOO='bar baz'" in script and "export WANDB_MODE=offline" in script
    opts = job_options(job)
    assert opts["JobName"] == option(args, "job-name")
    assert normalize(opts["Comment"]) == normalize(option(args, "comment")) and ",tag=" in opts["Comment"]
    assert opts["Partition"] == option(args, "partition") and opts["NumNodes"].startswith(option(args, "nodes"))
    assert normalize(opts["WorkDir"]) == normalize(option(args, "chdir"))
    assert opts["Requeue"] == "1"  # --requeue: `scontrol requeue` is taken, and the daemon replaces the job
    if trials > 1:
        assert option(args, "array") == f"0-{trials - 1}"
        assert opts["ArrayJobId"] == job.split("_")[0] and opts["ArrayTaskId"] in ("0-2", "0", "1", "2")
    else:
        assert "--array" not in " ".join(args)
        assert normalize(opts["StdOut"]) == normalize(option(args, "output"))
