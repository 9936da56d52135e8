"""`det site doctor` and `det site init` on the real test cluster (whichever SLURM_CONF the
fixture points at), healthy and with something broken: the nodes of one pool that see another
filesystem where the experiments dir (and then the checkpoint dir) should be.

The break is real, not simulated: the gpu nodes' slurmd is restarted in a private mount
namespace with an empty tmpfs over those dirs, so every job on g1/g2 sees an empty dir there,
as on a site whose GPU nodes do not mount the login node's home."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Det

# The accounting cluster (MariaDB + slurmdbd) of the accounting tests, shared by module scope.
from test_accounting_cluster import dbd_cluster  # noqa: F401

from detslurm.slurm.site import load_site_config

pytestmark = [pytest.mark.slurm]


def _doctor(det: Det, *args: str) -> tuple[int, dict[str, dict[str, Any]], dict[str, Any]]:
    code, out, err = det("site", "doctor", "--json", "--timeout", "60", *args)
    assert out, err
    doc = json.loads(out)
    return code, {f["subject"]: f for f in doc["findings"]}, doc


def _stop_slurmd(state: Path, node: str) -> None:
    pid_file = state / "run" / f"slurmd-{node}.pid"
    pid = int(pid_file.read_text())
    os.kill(pid, 15)
    deadline = time.time() + 15
    while Path(f"/proc/{pid}").exists() and time.time() < deadline:
        time.sleep(0.1)


def _wait_idle(nodes: Sequence[str]) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%t"], capture_output=True, text=True, check=False
        ).stdout.split()
        if out and all(s.startswith(("idle", "mix")) for s in out):
            return
        time.sleep(0.3)
    raise AssertionError(f"nodes {nodes} did not come back idle")


@contextmanager
def hidden_on(state: Path, nodes: Sequence[str], paths: Sequence[Path]) -> Iterator[None]:
    """While inside, jobs on ``nodes`` see an empty tmpfs at each of ``paths``."""
    conf = state / "etc" / "slurm.conf"
    for node in nodes:
        _stop_slurmd(state, node)
    try:
        for node in nodes:
            mounts = " && ".join(f"mount -t tmpfs detslurm-hidden {shlex.quote(str(p))}" for p in paths)
            # slurmd daemonizes inside the namespace; its job steps inherit the namespace.
            script = f"{mounts} && exec slurmd -f {shlex.quote(str(conf))} -N {node}"
            subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], check=True)
        _wait_idle(nodes)
        yield
    finally:
        for node in nodes:
            _stop_slurmd(state, node)
        # `up` starts the slurmd that are not running, in the ordinary namespace.
        env = dict(os.environ, TEST_CLUSTER_PORT=os.environ.get("TEST_CLUSTER_PORT", "17817"))
        subprocess.run([str(ROOT / "scripts/test-cluster"), "up", str(state)], check=True, env=env)


@pytest.mark.slurm24_smoke
def test_doctor_on_a_healthy_cluster(slurm_env: Path, det: Det) -> None:
    code, found, doc = _doctor(det)
    # The test cluster has warnings (KillWait 15 s, no accounting, a 1 s poll floor), no problem.
    assert code == 0, [f for f in found.values() if f["status"] == "problem"]
    version = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, check=True).stdout.split()[-1]
    assert doc["schema"] == 1 and doc["slurm_version"] == version and doc["status"] == "warning"
    assert "KillWait 15 s" in found["preemption"]["detail"] and found["preemption"]["status"] == "warning"
    for pool in ("cpu", "gpu", "high"):
        for what in ("experiments dir", "checkpoints dir", "python", "detslurm"):
            assert found[f"pool {pool}: {what}"]["status"] == "ok", found[f"pool {pool}: {what}"]
    assert found["pool cpu: experiments dir"]["detail"].startswith(f"{slurm_env / 'exps'}: shared with c")
    # The gpu pool's probe asked Slurm for one GPU: the job sees it assigned.
    assert "CUDA_VISIBLE_DEVICES=" in found["pool gpu: GPUs"]["detail"]
    # The probe dirs are gone again.
    assert list((slurm_env / "exps" / ".detslurm-doctor").iterdir()) == []

    code, out, _ = det("site", "doctor", "--no-probe")
    assert code == 0 and "preemption" in out and "pool cpu: node" not in out


@pytest.mark.host_slurm  # restarts slurmd in a private mount namespace of the host
def test_doctor_names_a_pool_whose_nodes_cannot_see_the_experiments_dir(
    slurm_env: Path, slurm_cluster: Path, det: Det, monkeypatch: pytest.MonkeyPatch
) -> None:
    exps, hidden_ckpts = slurm_env / "exps", slurm_env / "ckpts-hidden"
    exps.mkdir(exist_ok=True)
    hidden_ckpts.mkdir()
    with hidden_on(slurm_cluster, ["g1", "g2"], [exps, hidden_ckpts]):
        code, found, doc = _doctor(det, "-p", "cpu", "-p", "gpu")
        assert code == 1 and doc["status"] == "problem"
        bad = found["pool gpu: experiments dir"]
        assert bad["status"] == "problem" and str(exps) in bad["detail"] and "DETSLURM_EXPERIMENTS_DIR" in bad["action"]
        assert "cannot read the login node's test file" in bad["detail"]
        # Only that pool, only that dir: the report came back through the checkpoint dir.
        assert found["pool gpu: checkpoints dir"]["status"] == "ok"
        assert found["pool cpu: experiments dir"]["status"] == "ok"
        assert [s for s, f in found.items() if f["status"] == "problem"] == ["pool gpu: experiments dir"]

        # With both dirs hidden nothing comes back: the probe's exit code still names them.
        monkeypatch.setenv("DETSLURM_CHECKPOINT_DIR", str(hidden_ckpts))
        code, found, _ = _doctor(det, "-p", "cpu", "-p", "gpu")
        assert code == 1
        problems = {s: f["detail"] for s, f in found.items() if f["status"] == "problem"}
        assert sorted(problems) == ["pool gpu: checkpoints dir", "pool gpu: experiments dir"]
        assert "the node cannot see the login node's test file" in problems["pool gpu: experiments dir"]
        assert str(hidden_ckpts) in problems["pool gpu: checkpoints dir"]


def test_site_init_writes_a_config_that_loads(slurm_env: Path, det: Det) -> None:
    path = slurm_env / "site.yaml"
    code, out, err = det("site", "init", "-o", str(path))
    assert code == 0 and f"Wrote {path}" in out, err
    site = load_site_config(path)
    assert site.default_pool == "cpu" and sorted(site.pools) == ["cpu", "gpu", "high"]
    assert site.pools["gpu"].slot_type == "gpu" and site.pools["cpu"].slots_per_node == 2
    assert site.pools["high"].slot_type == "cpu"  # c1, c2 have no GPUs
    code, _, err = det("site", "init", "-o", str(path))
    assert code == 1 and "exists; use --force" in err
    assert det("site", "init", "-o", str(path), "--force")[0] == 0
    code, out, _ = det("site", "init", "--print")
    assert code == 0 and out.startswith("# detslurm site config for detslurm")


def test_doctor_reads_association_limits_where_there_is_accounting(
    dbd_cluster: Path,  # noqa: F811
    det: Det,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_CONF", str(dbd_cluster / "etc/slurm.conf"))
    monkeypatch.setenv("DETSLURM_SITE_CONFIG", str(ROOT / "site-configs/test-cluster.yaml"))
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    limits = ["sacctmgr", "-i", "modify", "user", user, "set"]
    subprocess.run([*limits, "MaxSubmitJobs=50", "MaxJobs=8"], check=True, capture_output=True)
    try:
        code, found, _ = _doctor(det, "--no-probe")
    finally:
        subprocess.run([*limits, "MaxSubmitJobs=-1", "MaxJobs=-1"], check=False, capture_output=True)
    assert code == 0
    assert found["accounting"]["status"] == "ok"
    assert found["job limits"]["detail"].endswith("MaxSubmitJobs 50, MaxJobs 8")
