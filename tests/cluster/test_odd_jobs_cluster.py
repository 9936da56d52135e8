"""Odd job names on the real cluster: sbatch accepts a newline (and any control
character) in a job's name or comment. Such a job of the same user must neither stop the
daemon's tick nor `det job list`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES

from detslurm import settings
from detslurm.slurm.client import client_from_env

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
CORE = EXAMPLES / "core_api"

# (name, comment) of the odd jobs: a newline, our field separator, our record separator.
ODD = [("wrap", "a\nb"), ("nm\nx", ""), ("n\x1fm", "c\x1fd"), ("rec\x1eend", "x\x1e\ny")]


def submit_odd_jobs(tmp_path: Path) -> dict[str, tuple[str, str]]:
    ids = {}
    for name, comment in ODD:
        argv = [
            "sbatch",
            "--parsable",
            "--partition=gpu",
            f"--job-name={name}",
            f"--chdir={tmp_path}",
            "--wrap=sleep 600",
        ]
        if comment:
            argv.append(f"--comment={comment}")
        res = subprocess.run(argv, capture_output=True, text=True, check=True)  # accepted by Slurm
        ids[res.stdout.strip()] = (name, comment)
    return ids


def test_jobs_with_newlines_in_name_or_comment_stop_nothing(det: Any, tmp_path: Path) -> None:
    odd = submit_odd_jobs(tmp_path)
    queue = client_from_env().squeue()  # this user's queue: what every tick reads
    seen = {j.job_id: (j.name, j.comment) for j in queue}
    # The newline ones are read whole; the ones holding our separators are skipped, never misread.
    for job_id, (name, comment) in odd.items():
        assert seen.get(job_id) in (None, (name, comment)), (job_id, seen.get(job_id))
    assert sum(job_id in seen for job_id in odd) == 2
    code, out, err = det("e", "create", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=0")
    assert code == 0, err
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    code, out, err = det("job", "list", "--json")
    assert code == 0, err
    listed = {row["id"] for row in json.loads(out)}
    assert {j for j in odd if j in seen} <= listed, (listed, odd)
    log = (settings.load().data_dir / "daemon.log").read_text()
    assert "tick failed" not in log and "skipped" in log  # the skipped records are counted, once a tick
