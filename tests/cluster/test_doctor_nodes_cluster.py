"""The doctor's node checks on the real test cluster (docs/admin/doctor.md): a GPU node whose
slurmd died is named in its partition's line, and a CPU pool asking for more slots per node than
the nodes have CPUs is caught."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, Det, write
from test_doctor_cluster import _doctor, _stop_slurmd, _wait_idle

pytestmark = [pytest.mark.slurm]


def _state_of(node: str) -> str:
    out = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True).stdout
    return (out.split() or [""])[0]


def test_doctor_names_a_node_whose_slurmd_died(slurm_env: Path, slurm_cluster: Path, det: Det) -> None:
    _stop_slurmd(slurm_cluster, "g2")
    try:
        deadline = time.time() + 120  # SlurmdTimeout is 10 s; a loaded machine notices later
        while not _state_of("g2").endswith("*") and time.time() < deadline:
            time.sleep(1)
        state = _state_of("g2")
        assert state.endswith("*"), f"slurmctld never noticed g2's slurmd was gone ({state})"
        code, found, _ = _doctor(det, "--no-probe")
        gpu = found["partition gpu"]
        assert gpu["status"] == "warning" and f"1 {state} (g2)" in gpu["detail"], gpu
        assert f"1 of 2 nodes take no jobs (g2 {state})" in gpu["action"], gpu
        assert found["partition cpu"]["status"] == "ok"
    finally:
        env = dict(os.environ, TEST_CLUSTER_PORT=os.environ.get("TEST_CLUSTER_PORT", "17817"))
        subprocess.run([str(ROOT / "scripts/test-cluster"), "up", str(slurm_cluster)], check=True, env=env)
        subprocess.run(["scontrol", "update", "NodeName=g2", "State=RESUME"], check=False, capture_output=True)
        _wait_idle(["g2"])


def test_doctor_checks_a_cpu_pools_slots_against_the_nodes(
    slurm_env: Path, det: Det, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The test cluster's nodes have 2 CPUs each.
    site = write(
        slurm_env / "site.yaml",
        "default_pool: big\npools:\n  big: {partition: cpu, slot_type: cpu, slots_per_node: 8}\n",
    )
    monkeypatch.setenv("DETSLURM_SITE_CONFIG", str(site))
    _, found, _ = _doctor(det, "--no-probe")
    big = found["pool big"]
    assert big["status"] == "warning" and "the nodes have 2 CPUs" in big["detail"], big
