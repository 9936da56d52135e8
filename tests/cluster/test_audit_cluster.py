"""Root's changes to a second Unix user's job on the real test cluster reach the audit log
(docs/admin/audit.md): the command, then each scontrol call before it runs and with Slurm's
answer; root's changes to its own jobs are not admin actions and are not recorded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from security_harness import Attacker, run_as, victim_base

pytestmark = [pytest.mark.slurm, pytest.mark.security]


@pytest.fixture
def audit_log(slurm_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    base = victim_base()
    admin = base / "admin-site.yaml"
    admin.write_text(f"audit_log: {base / 'log/audit.log'}\n")
    admin.chmod(0o644)
    monkeypatch.setenv("DETSLURM_ADMIN_SITE_CONFIG", str(admin))
    yield base / "log/audit.log"
    shutil.rmtree(base, ignore_errors=True)


def sbatch_as(user: Attacker | None, slurm_cluster: Path) -> str:
    """A job that waits for its begin time (it takes no node), as ``user`` (None: root)."""
    argv = ["sbatch", "--parsable", "--begin=now+3600", "--output=/dev/null", "-p", "cpu", "--wrap", "true"]
    if user is None:
        r = subprocess.run(argv, capture_output=True, text=True, check=True)
    else:
        env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": str(slurm_cluster / "etc/slurm.conf")}
        r = run_as(user.user, argv, env=env, cwd=str(user.home))
        assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def test_roots_changes_to_another_users_job_are_recorded_with_the_scontrol_calls(
    det: Any, audit_log: Path, mallory: Attacker, slurm_cluster: Path
) -> None:
    for d in [slurm_cluster, *slurm_cluster.parents][:-1]:
        d.chmod(d.stat().st_mode | 0o001)  # the second user reaches slurm.conf
    theirs = sbatch_as(mallory, slurm_cluster)
    mine = sbatch_as(None, slurm_cluster)
    try:
        code, out, err = det("job", "update", mine, "--hold")
        assert code == 0, out + err
        assert not audit_log.exists()  # root's own job
        code, out, err = det("job", "update", theirs, "--hold")
        assert code == 0, out + err
        code, out, err = det("--all-users", "job", "update", theirs, "--release")
        assert code == 0, out + err
        recs = [json.loads(line) for line in audit_log.read_text().splitlines()]
        got = [(r["event"], r.get("argv") or r.get("slurm"), r.get("returncode")) for r in recs]
        assert got == [
            ("command", ["det", "job", "update", theirs, "--hold"], None),
            ("slurm_call", ["scontrol", "hold", theirs], None),
            ("slurm_result", ["scontrol", "hold", theirs], 0),
            ("command", ["det", "--all-users", "job", "update", theirs, "--release"], None),
            ("slurm_call", ["scontrol", "release", theirs], None),
            ("slurm_result", ["scontrol", "release", theirs], 0),
        ]
        assert all(r["user"] == "root" and r["host"] for r in recs)
    finally:
        subprocess.run(["scancel", theirs, mine], check=False, env=dict(os.environ))
