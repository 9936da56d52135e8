"""Per-user RPC rate limiting on a real Slurm 23.02+ cluster (the 24.11 test cluster, started
with TEST_CLUSTER_RL=1: a bucket of 3 RPCs refilled at one a second). slurmctld never limits
root or SlurmUser, so the client runs its commands as a second Unix user through an injected
runner. Skipped on 22.05, which has no rate limiting."""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Optional

import pytest
from conftest import ROOT

from detslurm.controller.executor import SchedulerUnavailable
from detslurm.controller.slurm_executor import SlurmExecutor
from detslurm.slurm.client import Result, SlurmClient, subprocess_runner
from detslurm.slurm.site import SiteConfig

# Slurm's RPC rate limiting came with 23.02: the 22.05 session leaves these out (marker `slurm23`).
pytestmark = [pytest.mark.slurm, pytest.mark.slurm23, pytest.mark.slurm24_smoke]
USER = "detslurm-rl"


def slurm_release() -> tuple[int, int]:
    """The installed Slurm's release (the daemon's -V needs no slurm.conf; 24.11's clients do)."""
    out = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@pytest.fixture(scope="module")
def rl_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the Slurm test cluster needs root, and CI runs as root")
        pytest.skip("the Slurm test cluster needs root")
    if slurm_release() < (23, 2):
        pytest.skip(f"Slurm {slurm_release()} has no RPC rate limiting (23.02+)")
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", USER], check=True)
    state = tmp_path_factory.mktemp("slurm-rl")
    port = os.environ.get("TEST_CLUSTER_RL_PORT") or str(int(os.environ.get("TEST_CLUSTER_PORT", "17817")) + 300)
    env = dict(os.environ, TEST_CLUSTER_PORT=port, TEST_CLUSTER_RL="1")
    subprocess.run([str(ROOT / "scripts/test-cluster"), "up", str(state)], check=True, env=env)
    yield state
    subprocess.run([str(ROOT / "scripts/test-cluster"), "down", str(state)], check=False, env=env)


def as_user(
    argv: Sequence[str], *, input: Optional[str] = None, timeout: float, env: Optional[Mapping[str, str]] = None
) -> Result:
    """The real command, run as the unprivileged user (whom slurmctld does rate-limit). setpriv
    execs the command in place (runuser would fork it), so a timeout kills the command itself, as
    it does without the wrapper: a starved squeue left behind would keep draining the bucket."""
    pw = pwd.getpwnam(USER)
    wrap = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", "--"]
    return subprocess_runner([*wrap, *argv], input=input, timeout=timeout, env=env)


def limited_count(state: Path) -> int:
    return (state / "log/slurmctld.log").read_text(errors="replace").count("rate limit exceeded by uid")


def test_rate_limited_polls_wait_instead_of_failing(rl_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(rl_cluster / "etc/slurm.conf"))
    client = SlurmClient(as_user, timeout_s=30, user=USER)
    assert client.capabilities().rate_limited  # probed from the controller's config
    before = limited_count(rl_cluster)
    start = time.monotonic()
    for _ in range(8):  # twice the bucket: Slurm's clients are told to back off and wait
        assert client.squeue() == []
    assert limited_count(rl_cluster) > before, "slurmctld never limited the user: the test proves nothing"
    assert time.monotonic() - start >= 2  # the commands waited instead of failing


def test_a_poll_starved_past_its_budget_is_an_unavailable_scheduler(
    rl_cluster: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Many pollers share one user's bucket: each tick either reads the queue or, when it cannot
    within its command timeout, reports the scheduler unavailable (the controller retries next
    tick and charges nothing); no other error ever escapes."""
    monkeypatch.setenv("SLURM_CONF", str(rl_cluster / "etc/slurm.conf"))
    outcomes: list[str] = []

    def poller() -> None:
        ex = SlurmExecutor(SlurmClient(as_user, timeout_s=3, user=USER), SiteConfig())
        for _ in range(3):
            try:
                ex.poll({"1": tmp_path})
                outcomes.append("ok")
            except SchedulerUnavailable:
                outcomes.append("unavailable")
            except Exception as e:  # anything else is the failure this test looks for
                outcomes.append(f"error: {e!r}")

    threads = [threading.Thread(target=poller) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 18 and set(outcomes) <= {"ok", "unavailable"}, outcomes
    # Once the storm is over the bucket refills (one token a second) and a tick reads the queue.
    time.sleep(4)
    assert SlurmExecutor(SlurmClient(as_user, timeout_s=10, user=USER), SiteConfig()).poll({"1": tmp_path})
