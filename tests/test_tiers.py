"""tests/tiers.py, the rules of a test session, on tiny suites in a temp dir run by a real pytest:
under CI's tier a skip fails the session and says why; past the deadline the tests left are not
run, are named, and the session fails; `full` tests are deselected, not skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import write

TESTS = Path(__file__).resolve().parent

SUITE = """
import os, pytest

def test_runs(tmp_path):
    pass

def test_skips():
    pytest.skip("no widget here")

@pytest.mark.full
def test_only_in_the_whole_suite():
    pass
"""


def run_pytest(suite: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """pytest on ``suite`` with only the tiers plugin (not this repo's conftest or settings)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DETSLURM_TEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tiers", str(suite)],
        cwd=suite,
        env={**clean, "PYTHONPATH": str(TESTS), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_skip_fails_ci_tier_and_says_why(tmp_path: Path) -> None:
    write(tmp_path / "suite/test_a.py", SUITE)
    write(tmp_path / "suite/pytest.ini", "[pytest]\nmarkers =\n    full: whole suite\n    heavy: minutes\n")
    ci = run_pytest(tmp_path / "suite", DETSLURM_TEST_TIER="ci")
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "SKIPPED IN CI: 1" in ci.stdout and "test_a.py::test_skips: no widget here" in ci.stdout
    assert "1 passed, 1 skipped, 1 deselected" in ci.stdout  # `full` left out, not skipped

    whole = run_pytest(tmp_path / "suite", DETSLURM_TEST_TIER="full")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "2 passed, 1 skipped" in whole.stdout and "SKIPPED IN CI" not in whole.stdout


def test_a_module_skipped_at_collection_fails_ci_tier(tmp_path: Path) -> None:
    write(
        tmp_path / "suite/test_b.py",
        'import pytest\npytest.importorskip("no_such_module_here")\n\ndef test_x():\n    pass\n',
    )
    write(tmp_path / "suite/test_c.py", "def test_y():\n    pass\n")
    ci = run_pytest(tmp_path / "suite", DETSLURM_TEST_TIER="ci")
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "test_b.py: could not import 'no_such_module_here'" in ci.stdout
    assert run_pytest(tmp_path / "suite").returncode == 0


def test_tests_left_at_the_deadline_are_named_and_fail_the_session(tmp_path: Path) -> None:
    """The first test moves the deadline into the past: the two after it never start."""
    ran = tmp_path / "ran"
    write(
        tmp_path / "suite/test_d.py",
        f"""
import os
from pathlib import Path

def test_first():
    Path({str(ran)!r}).mkdir()
    (Path({str(ran)!r}) / "first").touch()
    os.environ["DETSLURM_TEST_DEADLINE"] = "1"

def test_second():
    (Path({str(ran)!r}) / "second").touch()

def test_third():
    (Path({str(ran)!r}) / "third").touch()
""",
    )
    r = run_pytest(tmp_path / "suite", DETSLURM_TEST_DEADLINE=str(time.time() + 3600))
    assert r.returncode == 2, r.stdout + r.stderr  # pytest's "interrupted"
    assert sorted(p.name for p in ran.iterdir()) == ["first"]
    assert "NOT RUN: 2 tests" in r.stdout
    assert "test_d.py::test_second" in r.stdout and "test_d.py::test_third" in r.stdout


def test_no_test_starts_past_the_deadline(tmp_path: Path) -> None:
    write(tmp_path / "suite/test_e.py", "def test_x():\n    raise SystemExit('ran')\n")
    r = run_pytest(tmp_path / "suite", DETSLURM_TEST_TIER="ci", DETSLURM_TEST_DEADLINE="1")
    assert r.returncode == 2 and "NOT RUN: 1 tests" in r.stdout and "ran" not in r.stderr, r.stdout + r.stderr
