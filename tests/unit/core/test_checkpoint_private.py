"""Checkpoints are private, durable and do not pile up (docs/design/security.md).

The cross-user read attempt is tests/security/test_security_read.py::test_checkpoints_are_private; these
check the modes, the opt-in group share, the fsync walk and the sweep of killed writers' dirs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from detslurm.ckpt_settings import SHARE_ENV, Modes, checkpoint_modes
from detslurm.core._checkpoint import (
    STALE_PARTIAL_AFTER_S,
    CheckpointContext,
    ensure_base,
    remove_partial,
    sweep_partials,
    sync_tree,
)
from detslurm.core._distributed import DummyDistributedContext
from detslurm.protocol.events import CheckpointSaved, Event


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


def finishes(fn: Callable[[], object], timeout_s: float = 10) -> bool:
    """Whether ``fn`` returns within ``timeout_s`` (run in a daemon thread: a hung call cannot
    hang the test run too)."""
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout_s)


def test_sync_tree_skips_a_fifo_without_blocking(tmp_path: Path) -> None:
    """A FIFO the trial left in its checkpoint (or swapped in for a file) is neither opened for
    good nor changed: a blocking open of a FIFO without a writer would hang the checkpoint."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "w.pt").write_bytes(b"w" * 10)
    os.mkfifo(tree / "pipe")
    os.chmod(tree / "pipe", 0o644)  # whatever the umask made of it
    assert finishes(lambda: sync_tree(tree, Modes())), "sync_tree blocked on the FIFO"
    assert mode(tree / "pipe") == 0o644 and stat.S_ISFIFO(os.lstat(tree / "pipe").st_mode)
    assert mode(tree / "w.pt") == 0o600


@pytest.fixture
def owned_dir() -> Iterator[Path]:
    """A directory that an unprivileged owner (:func:`as_owner`) can reach and owns: root reads
    and writes whatever the modes say, so what an owner meets is tried as one."""
    d = Path(tempfile.mkdtemp(prefix="detslurm-ckpt-"))
    d.chmod(0o711)
    if os.geteuid() == 0:
        os.chown(d, NOBODY, NOBODY)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


NOBODY = 65534


def as_owner(fn: Callable[[], object]) -> str:
    """Run ``fn`` as the owner of :func:`owned_dir` (a forked child as uid 65534 when we are
    root, else in this process); the repr of its exception, or "" when it returned."""
    if os.geteuid() != 0:
        try:
            fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return ""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the owner, run, report, never return into pytest
        code = 0
        try:
            os.close(r)
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            except OSError as e:  # a root without the capability to drop (a container)
                os.write(w, f"{SETUP_FAILED}{e!r}".encode())
                os._exit(2)
            fn()
        except BaseException as e:
            os.write(w, f"{type(e).__name__}: {e}".encode()[:4000])
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    if out.startswith(SETUP_FAILED):
        pytest.skip(f"cannot run as an unprivileged owner here: {out}")
    return out


SETUP_FAILED = "setup failed: "


def test_sync_tree_makes_files_private_whatever_they_were(owned_dir: Path) -> None:
    tree = owned_dir / "tree"

    def make_and_sync() -> None:
        (tree / "sub").mkdir(parents=True)
        (tree / "unreadable").write_bytes(b"u")
        (tree / "unreadable").chmod(0o200)  # its owner cannot read it
        (tree / "sub/tool.sh").write_text("#!/bin/sh\n")
        (tree / "sub/tool.sh").chmod(0o777)
        (tree / "sub").chmod(0o777)
        tree.chmod(0o755)
        sync_tree(tree, Modes())

    assert as_owner(make_and_sync) == ""
    assert mode(tree / "unreadable") == 0o600 and (tree / "unreadable").read_bytes() == b"u"
    assert mode(tree / "sub/tool.sh") == 0o700 and mode(tree / "sub") == 0o700
    assert mode(tree) == 0o755  # the root's mode is its creator's (store_path sets it)


def test_sync_tree_fails_on_a_directory_it_cannot_read(owned_dir: Path) -> None:
    """A subtree the walk cannot list would stay unsynced (and world-readable by name) inside a
    checkpoint that looks complete: the pass fails instead of skipping it."""
    tree = owned_dir / "tree"

    def make_and_sync() -> None:
        (tree / "sub").mkdir(parents=True)
        (tree / "sub/w.pt").write_bytes(b"w")
        (tree / "sub/w.pt").chmod(0o644)
        (tree / "sub").chmod(0o311)
        sync_tree(tree, Modes())

    err = as_owner(make_and_sync)
    assert "PermissionError" in err and "/sub'" in err


@pytest.mark.parametrize("swap", ["symlink", "fifo"])
def test_a_directory_swapped_after_the_listing_is_neither_followed_nor_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str
) -> None:
    """Entries are opened relative to their directory's descriptor, without following a link
    and without waiting: a directory replaced by a symlink (to outside the tree) or by a FIFO
    between the listing and its open leads nowhere and hangs nothing."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("o")
    (outside / "f").chmod(0o644)
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    (tree / "d/f").write_text("t")
    (tree / "w.pt").write_bytes(b"w")
    top = os.stat(tree).st_ino
    real_scandir = os.scandir

    def listing_then_swap(target: Any) -> Any:
        # The real listing; the swap lands right after the tree's own listing, before the pass
        # opens "d". Only this test's tree is touched.
        with real_scandir(target) as it:
            entries = list(it)
        real_dir = stat.S_ISDIR(os.lstat(tree / "d").st_mode)
        if isinstance(target, int) and os.fstat(target).st_ino == top and real_dir:
            (tree / "d").rename(tree / "moved")
            if swap == "symlink":
                (tree / "d").symlink_to(outside)
            else:
                os.mkfifo(tree / "d")
        return contextlib.nullcontext(entries)

    monkeypatch.setattr(os, "scandir", listing_then_swap)
    assert finishes(lambda: sync_tree(tree, Modes())), "the pass hung on the swapped directory"
    monkeypatch.undo()
    assert stat.S_ISLNK(os.lstat(tree / "d").st_mode) or stat.S_ISFIFO(os.lstat(tree / "d").st_mode)  # swapped
    assert mode(outside / "f") == 0o644  # never reached through a link
    assert mode(tree / "w.pt") == 0o600  # the rest of the tree is synced as ever


def test_a_symlinked_base_is_a_base(tmp_path: Path) -> None:
    """`~/ckpts -> /lustre/...` is a common checkpoint base on clusters: saved and reported."""
    real = tmp_path / "lustre"
    real.mkdir()
    (tmp_path / "ckpts").symlink_to(real)
    events: list[Event] = []
    with ctx(tmp_path / "ckpts", events).store_path({}) as (path, uuid):
        (path / "w.pt").write_bytes(b"w")
    assert (real / uuid / "w.pt").read_bytes() == b"w"
    assert [e.uuid for e in events if isinstance(e, CheckpointSaved)] == [uuid] and len(events) == 1


def test_a_dangling_link_in_a_checkpoint_is_listed_not_followed(tmp_path: Path) -> None:
    events: list[Event] = []
    with ctx(tmp_path, events).store_path({}) as (path, uuid):
        (path / "w.pt").write_bytes(b"w")
        (path / "latest.pt").symlink_to("gone.pt")
    saved = events[0]
    assert isinstance(saved, CheckpointSaved)
    resources = saved.resources
    assert resources["w.pt"] == 1 and resources["latest.pt"] == len("gone.pt")


def test_a_checkpoint_that_cannot_be_made_durable_leaves_nothing(owned_dir: Path) -> None:
    """A failure in the final pass (here a directory its owner made unreadable) fails the save
    and removes the partial dir, as a failure in the body does."""
    base = owned_dir / "ck"

    def save() -> None:
        with ctx(base, []).store_path({}) as (path, _uuid):
            (path / "sub").mkdir()
            (path / "sub/w.pt").write_bytes(b"w")
            (path / "sub").chmod(0o311)

    err = as_owner(save)
    assert "PermissionError" in err and "/sub'" in err
    assert os.listdir(base) == []


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


def test_a_partial_dir_its_owner_cannot_write_is_still_removed(owned_dir: Path) -> None:
    """A failed save removes its partial even where the trial left the partial itself
    read-only (0500): its mode is fixed first."""
    partial = owned_dir / ".p.partial"

    def make_and_remove() -> None:
        (partial / "sub").mkdir(parents=True)
        (partial / "sub/w.pt").write_bytes(b"w")
        (partial / "sub").chmod(0o500)
        partial.chmod(0o500)
        remove_partial(partial)

    assert as_owner(make_and_remove) == ""
    assert not partial.exists()


def test_a_new_base_under_a_parent_its_owner_cannot_read_is_made(owned_dir: Path) -> None:
    """The new base's parent is fsynced best effort: a parent its owner may write and enter but
    not read (0300) cannot be opened to sync, and the first save must not fail for it."""
    parent = owned_dir / "wx"
    base = parent / "ckpts"

    def make() -> None:
        parent.mkdir()
        parent.chmod(0o300)
        ensure_base(base, Modes())

    assert as_owner(make) == ""
    assert base.is_dir() and mode(base) == 0o700
