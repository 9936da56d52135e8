"""Checkpoints are private, durable and do not pile up (security review M5, L8, L5).

The cross-user read attempt is tests/test_security_read.py::test_checkpoints_are_private; these
check the modes, the opt-in group share, the fsync walk and the sweep of killed writers' dirs.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from detslurm.ckpt_settings import SHARE_ENV, Modes, checkpoint_modes
from detslurm.core._checkpoint import STALE_PARTIAL_AFTER_S, CheckpointContext, sweep_partials, sync_tree
from detslurm.core._distributed import DummyDistributedContext
from detslurm.protocol.events import Event


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """A umask that would leave everything group-writable and world-readable (002)."""
    old = os.umask(0o002)
    yield
    os.umask(old)


def ctx(base: Path, events: list[Event]) -> CheckpointContext:
    return CheckpointContext(DummyDistributedContext(), base, events.append, require_steps=False)


def write_one(c: CheckpointContext) -> Path:
    with c.store_path({"steps_completed": 1}) as (path, _):
        (path / "sub").mkdir()
        (path / "sub/weights.pt").write_bytes(b"w" * 10)
        (path / "code.py").write_text("print(1)")
        (path / "run.sh").write_text("echo")
        (path / "run.sh").chmod(0o775)
        (path / "link").symlink_to("code.py")
    return c.base / path.name[1:].removesuffix(".partial")


@pytest.mark.usefixtures("loose_umask")
def test_checkpoints_are_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    events: list[Event] = []
    base = tmp_path / "new/ckpts"
    final = write_one(ctx(base, events))
    assert mode(base) == mode(base.parent) == 0o700  # created by us: private
    assert mode(final) == mode(final / "sub") == 0o700
    assert mode(final / "sub/weights.pt") == mode(final / "code.py") == mode(final / "metadata.json") == 0o600
    assert mode(final / "run.sh") == 0o700  # the owner keeps its executable bit
    assert events and not list(base.glob(".*.partial"))


@pytest.mark.usefixtures("loose_umask")
def test_an_existing_group_base_keeps_its_mode_and_can_share_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "project"
    base.mkdir()
    base.chmod(0o2770)  # a group project dir, set up on purpose
    private = write_one(ctx(base, []))
    assert mode(base) == 0o2770 and mode(private) == 0o700 and mode(private / "code.py") == 0o600
    monkeypatch.setenv(SHARE_ENV, "group")
    shared = write_one(ctx(base, []))
    assert mode(shared) == mode(shared / "sub") == 0o750
    assert mode(shared / "code.py") == 0o640 and mode(shared / "run.sh") == 0o750  # never group-writable


def test_share_setting_is_checked() -> None:
    assert checkpoint_modes({}) == Modes() == checkpoint_modes({SHARE_ENV: "private"})
    with pytest.raises(ValueError, match=f"{SHARE_ENV}='world': expected 'group' or nothing"):
        checkpoint_modes({SHARE_ENV: "world"})


def test_sync_tree_does_not_follow_or_change_links(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    outside.chmod(0o644)
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    (tree / "d/f").write_text("y")
    (tree / "to-outside").symlink_to(outside)
    (tree / "to-dir").symlink_to(tmp_path)
    tmp_path.chmod(0o755)
    sync_tree(tree, Modes())
    assert mode(tmp_path) == 0o755  # the linked dir: not followed, not changed
    assert mode(tree / "d") == 0o700 and mode(tree / "d/f") == 0o600 and mode(outside) == 0o644
    sync_tree(tree, None)  # fsync only: modes stay
    assert mode(tree / "d/f") == 0o600


def test_sync_tree_skips_a_fifo_without_blocking(tmp_path: Path) -> None:
    """A FIFO the trial left in its checkpoint (or swapped in for a file) is neither opened for
    good nor changed: a blocking open of a FIFO without a writer would hang the checkpoint."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "w.pt").write_bytes(b"w" * 10)
    os.mkfifo(tree / "pipe", 0o644)
    done = threading.Event()

    def walk() -> None:
        sync_tree(tree, Modes())
        done.set()

    threading.Thread(target=walk, daemon=True).start()
    assert done.wait(10), "sync_tree blocked on the FIFO"
    assert mode(tree / "pipe") == 0o644 and stat.S_ISFIFO(os.lstat(tree / "pipe").st_mode)
    assert mode(tree / "w.pt") == 0o600


def test_sync_tree_makes_files_private_whatever_they_were(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "unreadable").write_bytes(b"u")
    (tree / "unreadable").chmod(0o200)  # the owner cannot read it (root still can)
    (tree / "sub/tool.sh").write_text("#!/bin/sh\n")
    (tree / "sub/tool.sh").chmod(0o777)
    (tree / "sub").chmod(0o777)
    tree.chmod(0o755)
    if os.geteuid() == 0:
        # Root reads a 0200 file anyway: refuse the first open of that one path as the kernel
        # refuses its owner (every other path goes to the real os.open).
        real_open, target, refused = os.open, str(tree / "unreadable"), []

        def owner_open(path: str, flags: int, *args: int) -> int:
            if path == target and not refused and stat.S_IMODE(os.lstat(path).st_mode) == 0o200:
                refused.append(path)
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", owner_open)
    sync_tree(tree, Modes())
    monkeypatch.undo()
    assert mode(tree / "unreadable") == 0o600 and (tree / "unreadable").read_bytes() == b"u"
    assert mode(tree / "sub/tool.sh") == 0o700 and mode(tree / "sub") == 0o700
    assert mode(tree) == 0o755  # the root's mode is its creator's (store_path sets it)


def partial(base: Path, age_s: float, inner_age_s: float | None = None) -> Path:
    p = base / f".{uuid.uuid4()}.partial"
    p.mkdir(parents=True)
    (p / "weights.pt").write_bytes(b"w")
    now = time.time()
    os.utime(p / "weights.pt", (now - (age_s if inner_age_s is None else inner_age_s),) * 2)
    os.utime(p, (now - age_s,) * 2)
    return p


def test_killed_writers_partials_are_swept_by_the_next_writer(tmp_path: Path) -> None:
    old = STALE_PARTIAL_AFTER_S + 60
    stale = partial(tmp_path, old)
    busy = partial(tmp_path, old, inner_age_s=5)  # a big file still being written
    fresh = partial(tmp_path, 30)
    odd = tmp_path / ".not-a-uuid.partial"
    odd.mkdir()
    os.utime(odd, (time.time() - old,) * 2)
    c = ctx(tmp_path, [])
    final = write_one(c)
    assert not stale.exists() and busy.exists() and fresh.exists() and odd.exists() and final.exists()
    assert sweep_partials(tmp_path / "missing") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_sweep_leaves_another_users_partial_alone(tmp_path: Path) -> None:
    theirs = partial(tmp_path, STALE_PARTIAL_AFTER_S + 60)
    os.chown(theirs, 65534, 65534)
    assert sweep_partials(tmp_path) == [] and theirs.exists()
