from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from detslurm.store import Store

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.fixture
def det_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Private detslurm dirs for one test (store, experiment dirs, checkpoints)."""
    monkeypatch.setenv("DETSLURM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("DETSLURM_EXPERIMENTS_DIR", str(tmp_path / "exps"))
    monkeypatch.setenv("DETSLURM_CHECKPOINT_DIR", str(tmp_path / "ckpts"))
    monkeypatch.setenv("DETSLURM_CONFIG", str(tmp_path / "no-config.yaml"))
    monkeypatch.setenv("DETSLURM_POLL_INTERVAL_S", "0.1")
    for k in list(os.environ):
        if k.startswith("DET_"):
            monkeypatch.delenv(k)
    return tmp_path


@pytest.fixture
def det(det_env: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[Det]:
    yield Det(capsys)


class Det:
    """Runs the real CLI entry point in-process and captures what a user would see."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        from detslurm.cli.main import main

        self.capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = self.capsys.readouterr()
        return code, out, err


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# Test modules and their helpers import each other by module name (`from conftest import ROOT`,
# `from test_slurm_cluster import trials`): tests/ and every folder of test modules under it are
# on sys.path, whatever test a session collects first. Module names are unique across folders.
TESTS = Path(__file__).resolve().parent
for _dir in [TESTS, *sorted({p.parent for p in TESTS.rglob("test_*.py")} - {TESTS})]:
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

# Selection by tier, the deadline and the late builds; a skip or a test not run fails CI's run.
pytest_plugins = ["tiers"]


def pytest_configure(config: pytest.Config) -> None:
    """Each session gets a private temp root unless one is given (--basetemp).

    pytest's default root, /tmp/pytest-of-USER, is shared by every session of a user, and each
    session that starts takes it back to 0700. scripts/test-cluster opens the path to a
    cluster's state dir (o+x) so that the second Unix user's Slurm commands can read slurm.conf;
    a session started beside it (CI runs two at once, and 24.11 starts while 22.05 runs) closed
    that path again and the second user's tests failed with "Unable to process configuration
    file". A root of the session's own under /tmp is changed by no other session."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        import tempfile

        config.option.basetemp = tempfile.mkdtemp(prefix="detslurm-pytest-")
        config.add_cleanup(lambda: shutil.rmtree(config.option.basetemp, ignore_errors=True))


_STOP_SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2]


@pytest.fixture(autouse=True)
def _signal_dispositions_restored() -> Iterator[None]:
    """Each test leaves the session's signal dispositions as it found them.

    In-process code may change them for good: a closed Core API context ignores the warning
    signal (detslurm/core/_preempt.py), and an ignored signal stays ignored in every process the
    session starts afterwards. A later test's launcher then never saw its SIGUSR2."""
    saved = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) != handler:
            signal.signal(sig, handler)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A failed test that ran experiments gets their story (tests/diagnose.py) as a section of
    its report, taken while its fixtures (the store, the cluster) are still there."""
    report: pytest.TestReport = yield
    if report.failed and call.when == "call" and "det_env" in getattr(item, "fixturenames", ()):
        from diagnose import story

        report.sections.append(("detslurm", "\n".join(story())))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Under CI, a failure is printed the moment it happens, not only in the final summary.

    CI shows the tail of a run cut off at its time limit, and pytest prints the tracebacks only at
    the end; the tail of each traceback here names the assertion that failed, and the story of
    the test's experiments (runs, their ends, their logs' last lines) says what led there."""
    if not os.environ.get("CI") or not report.failed:
        return
    tail = report.longreprtext.strip().splitlines()[-12:]
    story = [line for name, text in report.sections if name == "detslurm" for line in text.splitlines()]
    lines = [f"FAILED {report.nodeid} ({report.when}, {report.duration:.0f} s)", *("  " + t for t in tail + story)]
    sys.stderr.write("\n" + "\n".join(lines) + "\n")


@pytest.fixture(scope="session")
def store_1000x1000(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """(SQLite file, experiment id) of one finished 1000-trial experiment with 1M metric points
    (bench/dashboard_load.py's synthetic store), built once per session: two dashboard tests
    read it, and filling it took six minutes on a loaded 2-core machine. Tests work on a copy."""
    sys.path.insert(0, str(ROOT / "bench"))
    from dashboard_load import build_store

    d = tmp_path_factory.mktemp("store-1000x1000")
    store, exp_id = build_store(f"sqlite:///{d / 'db.sqlite'}", 1000, 1000, d / "exp")
    store.dispose()
    return d / "db.sqlite", exp_id


def copy_store(src: Path, tmp_path: Path) -> Store:
    from detslurm.store import open_store

    dst = tmp_path / src.name
    shutil.copyfile(src, dst)
    return open_store(f"sqlite:///{dst}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The project's real Slurm test cluster (scripts/test-cluster), started once per session.

    DETSLURM_TEST_CLUSTER=DIR reuses a cluster that is already up (and leaves it running)."""
    import subprocess

    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the Slurm test cluster needs root, and CI runs as root")
        pytest.skip("the Slurm test cluster needs root")
    reuse = os.environ.get("DETSLURM_TEST_CLUSTER")
    state = Path(reuse) if reuse else tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, TEST_CLUSTER_PORT=os.environ.get("TEST_CLUSTER_PORT", "17817"))
    subprocess.run([str(ROOT / "scripts/test-cluster"), "up", str(state)], check=True, env=env)
    yield state
    if not reuse:
        subprocess.run([str(ROOT / "scripts/test-cluster"), "down", str(state)], check=False, env=env)


@pytest.fixture
def slurm_env(det_env: Path, slurm_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A test's private detslurm dirs on the shared cluster; its daemon and jobs end with it."""
    import subprocess

    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster / "etc/slurm.conf"))
    monkeypatch.setenv("DETSLURM_SITE_CONFIG", str(ROOT / "site-configs/test-cluster.yaml"))
    monkeypatch.setenv("DETSLURM_DAEMON_IDLE_EXIT_S", "60")
    monkeypatch.setenv("DETSLURM_POLL_INTERVAL_S", "0.5")
    yield det_env
    from detslurm import daemon, settings

    daemon.stop(settings.load())
    subprocess.run(["scancel", "-u", os.environ.get("USER", "root")], check=False)
    deadline = time.time() + 15
    while time.time() < deadline:
        out = subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout
        if not out.strip():
            break
        time.sleep(0.3)
    left = nodes_out_of_service(wait_s=30)
    if left:
        # Every later test of the session would fail on the shared cluster (CI, 2026-11-27: one
        # drained node failed eight): this test is the one to blame, with Slurm's reason.
        subprocess.run(["scontrol", "update", f"NodeName={','.join(left)}", "State=RESUME"], check=False)
        pytest.fail(f"the test left nodes out of service (resumed for the next tests): {left}")


# sinfo's short node states (%t) of a node that takes jobs. With a suffix (idle* = not responding,
# idle~ = powered off, ...) a node takes none: such a state counts as out of service.
IN_SERVICE = ("idle", "mix", "alloc", "comp")


def nodes_out_of_service(wait_s: float) -> dict[str, str]:
    """The cluster's nodes (SLURM_CONF) that take no jobs, with Slurm's state and reason, after
    giving them ``wait_s`` to come back: a DOWN node returns once its slurmd registers again."""
    from diagnose import node_states

    deadline = time.time() + wait_s
    while True:
        left = {
            name: f"{state}: {reason}" for name, (state, reason) in node_states().items() if state not in IN_SERVICE
        }
        if not left or time.time() > deadline:
            return left
        time.sleep(1)


@pytest.fixture(scope="session")
def mallory() -> Iterator[object]:
    """A second Unix user on this machine (tests/security_harness.py), for the security tests."""
    import shutil

    from security_harness import HarnessUnavailable, make_attacker

    try:
        attacker = make_attacker()
    except HarnessUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"the security tests need a second Unix user, and CI runs as root: {e}")
        pytest.skip(str(e))
    yield attacker
    shutil.rmtree(attacker.home, ignore_errors=True)
