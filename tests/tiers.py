"""How a test session selects, orders and accounts for its tests (a pytest plugin, loaded by
tests/conftest.py; scripts/test sets the variables below).

CI's run is green only if every test it selected ran:
- under ``DETSLURM_TEST_TIER=ci`` a skipped test (or a module skipped at collection) fails the
  session, with its reason: a test that cannot apply somewhere is left out by its markers or by
  the session's selection (scripts/test, scripts/test-slurm24), never skipped;
- past ``DETSLURM_TEST_DEADLINE`` (epoch seconds) no further test starts: the session stops, names
  every test it did not run, and fails (pytest's "interrupted").
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

# scripts/test without arguments (CI's run) sets this to "ci": the tests marked `full` are then
# left out (scripts/test's header says which and why), and a skip fails the session.
TIER_VAR = "DETSLURM_TEST_TIER"
DEADLINE_VAR = "DETSLURM_TEST_DEADLINE"
OUT_OF_TIME = f"CI's time budget ({DEADLINE_VAR}) ran out before they started"
# A test marked `heavy` took up to 9 min on CI's loaded machine: it starts only this long before
# the deadline, so that it ends before the box does instead of being interrupted.
HEAVY_MARGIN_S = 600

# scripts/test builds DeepSpeed's CPU op and Horovod in the background (scripts/bootstrap-launchers)
# and names here the file it writes when that build has ended. The tests that need the build are
# marked `late_build`: they run after all others, and each waits for the build before it starts.
LATE_BUILD_VAR = "DETSLURM_LATE_BUILD_DONE"
LATE_BUILD_WAIT_S = 3600

# What the session did not run: skipped tests and modules (node id, reason), and the tests left
# when the deadline passed.
_skipped: list[tuple[str, str]] = []
_not_run: list[str] = []


def tier() -> str:
    return os.environ.get(TIER_VAR, "full")


def deadline() -> float:
    """Read at each test: a session's own tests may move it (tests/test_tiers.py does)."""
    return float(os.environ.get(DEADLINE_VAR) or "inf")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if tier() == "ci":
        left_out = [item for item in items if item.get_closest_marker("full") is not None]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item.get_closest_marker("full") is None]
        # Under CI's time box the tests of minutes go last, so that a slow machine stops the
        # session with a few of them left, not hundreds of tests of seconds that sort after them.
        items.sort(key=lambda item: item.get_closest_marker("heavy") is not None)  # stable
    if os.environ.get(LATE_BUILD_VAR):
        items.sort(key=lambda item: item.get_closest_marker("late_build") is not None)  # stable


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """Past the deadline this test and every later one are not run: the session stops here
    (pytest then tears its fixtures down and exits "interrupted", a failure)."""
    margin = HEAVY_MARGIN_S if item.get_closest_marker("heavy") is not None else 0
    if time.time() <= deadline() - margin:
        return None
    items = item.session.items
    _not_run.extend(i.nodeid for i in items[items.index(item) :])
    item.session.shouldstop = f"{len(_not_run)} tests not run: {OUT_OF_TIME}"
    return True


def pytest_runtest_setup(item: pytest.Item) -> None:
    done = os.environ.get(LATE_BUILD_VAR)
    if not done or item.get_closest_marker("late_build") is None:
        return
    until = time.monotonic() + LATE_BUILD_WAIT_S
    while not Path(done).exists():
        if time.monotonic() > until:
            pytest.fail(f"scripts/bootstrap-launchers did not end within {LATE_BUILD_WAIT_S} s")
        time.sleep(2)


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append((report.nodeid, _reason(report)))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _skipped.append((report.nodeid or "(collection)", _reason(report)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if tier() == "ci" and _skipped and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    write = terminalreporter.write_line
    if tier() == "ci" and _skipped:
        write(
            f"SKIPPED IN CI: {len(_skipped)}, a failure of CI's run (it must run every test it selects: "
            "leave a test that cannot apply out by its markers or the session's selection)",
            red=True,
            bold=True,
        )
        for nodeid, reason in _skipped:
            write(f"  {nodeid}: {reason}")
    if _not_run:
        write(f"NOT RUN: {len(_not_run)} tests: {OUT_OF_TIME}; the session fails", red=True, bold=True)
        for nodeid in _not_run:
            write(f"  {nodeid}")
