"""What many test modules share: waiting for a condition, and the store of a test's own detslurm
dirs (the ``det_env`` fixture of tests/conftest.py points the settings at them)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from detslurm.store import Store


def wait_for(
    pred: Callable[[], object], timeout: float = 90, what: str = "the condition", interval: float = 0.2
) -> None:
    """Returns once ``pred()`` is true; asks once more at the deadline, then fails naming ``what``.
    A guard against a hang, not a timing: give it what a loaded 2-core machine needs."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def store() -> Store:
    """The store the test's settings name (``det_env``'s data dir, or the URL a test set)."""
    from detslurm import settings
    from detslurm.store import open_store

    return open_store(settings.load().db_url)
