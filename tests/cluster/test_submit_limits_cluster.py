"""Slurm's submit limits on the real cluster: an association's MaxSubmitJobs
set low with sacctmgr and enforced (a private cluster with accounting), an experiment with more
trials than the limit, run by the real daemon. Every trial completes with one run, none errors
or spends a restart, and this user's queue never holds more jobs than the limit."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from test_slurm_arrays import grid, runs

from detslurm import daemon, settings

pytestmark = [pytest.mark.slurm]
LIMIT = 4
TRIALS = 10


@pytest.fixture(scope="module")
def limits_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cluster with accounting that enforces association limits, on its own ports.
    DETSLURM_TEST_LIMITS_CLUSTER=DIR reuses one that is up (and leaves it running)."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the Slurm test cluster needs root, and CI runs as root")
        pytest.skip("the Slurm test cluster needs root")
    reuse = os.environ.get("DETSLURM_TEST_LIMITS_CLUSTER")
    state = Path(reuse) if reuse else tmp_path_factory.mktemp("slurm-limits")
    # Clear of the shared cluster's ports (+0..+4) and the accounting one's (+100..+111).
    port = os.environ.get("TEST_CLUSTER_LIMITS_PORT") or str(int(os.environ.get("TEST_CLUSTER_PORT", "17817")) + 50)
    env = dict(os.environ, TEST_CLUSTER_PORT=port, TEST_CLUSTER_DBD="1", TEST_CLUSTER_ENFORCE="1")
    subprocess.run([str(ROOT / "scripts/test-cluster"), "up", str(state)], check=True, env=env)
    yield state
    if not reuse:
        subprocess.run([str(ROOT / "scripts/test-cluster"), "down", str(state)], check=False, env=env)


@pytest.fixture
def limited_env(det_env: Path, limits_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("SLURM_CONF", str(limits_cluster / "etc/slurm.conf"))
    monkeypatch.setenv("DETSLURM_SITE_CONFIG", str(ROOT / "site-configs/test-cluster.yaml"))
    monkeypatch.setenv("DETSLURM_DAEMON_IDLE_EXIT_S", "60")
    monkeypatch.setenv("DETSLURM_POLL_INTERVAL_S", "0.5")
    user = os.environ.get("USER", "root")
    subprocess.run(["sacctmgr", "-i", "modify", "user", user, "set", f"MaxSubmitJobs={LIMIT}"], check=True)
    yield det_env
    daemon.stop(settings.load())
    subprocess.run(["scancel", "-u", user], check=False)
    subprocess.run(["sacctmgr", "-i", "modify", "user", user, "set", "MaxSubmitJobs=-1"], check=False)


class QueueWatch(threading.Thread):
    """Samples this user's live jobs (array tasks one each) until stopped; keeps the most seen."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.most = 0
        self.done = threading.Event()

    def run(self) -> None:
        argv = ["squeue", "-h", "-r", "-u", os.environ.get("USER", "root"), "-t", "PD,R,CG,S,RQ", "-o", "%i"]
        while not self.done.is_set():
            out = subprocess.run(argv, capture_output=True, text=True).stdout
            self.most = max(self.most, len(out.split()))
            time.sleep(0.2)


@pytest.mark.usefixtures("limited_env")
def test_more_trials_than_max_submit_jobs_all_complete_throttled(det: Any, tmp_path: Path) -> None:
    cfg, ctx = grid(tmp_path, TRIALS)
    watch = QueueWatch()
    watch.start()
    try:
        code, _, err = det("e", "create", cfg, ctx)
        assert code == 0, err
        code, out, err = det("e", "wait", "1")
        assert code == 0, out + err
    finally:
        watch.done.set()
        watch.join()
    got = runs(1)
    assert len(got) == TRIALS
    assert {t.state for t, _ in got} == {"COMPLETED"}
    # Throttled, never failed: one run each, no restart spent, nothing refused on the way.
    assert all(len(rs) == 1 and t.restarts == 0 and rs[0].exit_code == 0 for t, rs in got)
    assert 0 < watch.most <= LIMIT
