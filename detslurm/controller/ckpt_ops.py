"""`det checkpoint delete` and `det checkpoint rm --glob`: checkpoints a user removes by hand.

As with GC (controller/gc.py) the rows stay, marked DELETED (or PARTIALLY_DELETED when only
some files went), so history still shows them; the files are removed after the commit. Only
``<storage base>/<uuid>`` is ever touched, never the path a trial reported, and only
by the checkpoint's owner.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from detslurm.controller.gc import Doom, Doomed, is_ours, remove_checkpoint
from detslurm.errors import StateError
from detslurm.identity import Scope, os_user
from detslurm.store import Store
from detslurm.store.models import Checkpoint, Trial
from detslurm.views import get_checkpoint


@dataclass(frozen=True)
class Removal:
    """What one checkpoint loses: its whole directory, or only these files in it."""

    uuid: str
    directory: Doomed | None
    files: tuple[Path, ...] = ()


def _check(s: Session, uuid: str, scope: Scope) -> tuple[Checkpoint, Doomed | None]:
    ck = get_checkpoint(s, uuid, scope)
    trial = s.get(Trial, ck.trial_id)
    assert trial is not None  # get_checkpoint found it through this trial
    exp = trial.experiment
    if exp.owner != os_user():
        raise StateError(f"checkpoint {uuid} belongs to {exp.owner}; only its owner can delete it")
    # A live trial resumes from its latest checkpoint: deleting it would lose the trial's progress.
    if trial.latest_checkpoint == uuid and not trial.state.is_terminal:
        raise StateError(f"checkpoint {uuid} is the latest of trial {trial.id}, which is still {trial.state}")
    return ck, Doom(s, exp)(ck)


def delete_checkpoints(store: Store, uuids: Sequence[str], scope: Scope | None = None) -> list[str]:
    """Delete whole checkpoints; every uuid is checked before any is deleted. The uuids deleted."""
    plan: list[Removal] = []
    # All rows in one transaction: one refused uuid (not found, in use) deletes none of them.
    with store.tx() as s:
        for uuid in dict.fromkeys(uuids):  # a uuid given twice is deleted once
            ck, path = _check(s, uuid, scope or Scope.mine())
            ck.state = "DELETED"
            plan.append(Removal(uuid, path))
    # After the commit: a big tree on a network filesystem must not hold the store's write lock.
    for r in plan:
        if r.directory is not None:
            remove_checkpoint(r.directory)
    return [r.uuid for r in plan]


def remove_files(store: Store, uuids: Sequence[str], globs: Sequence[str], scope: Scope | None = None) -> list[Removal]:
    """Remove the files matching any of ``globs`` (relative to each checkpoint's top) from these
    checkpoints; a checkpoint left with no files is DELETED, otherwise PARTIALLY_DELETED."""
    if not globs:
        raise StateError("give at least one --glob pattern (det checkpoint delete removes whole checkpoints)")
    plan: list[Removal] = []
    with store.tx() as s:
        for uuid in dict.fromkeys(uuids):
            ck, path = _check(s, uuid, scope or Scope.mine())
            # Matched against the recorded file list (names relative to the checkpoint's top, as
            # Determined's --glob is), not by walking the disk: the row and the files stay in step.
            names = [n for n in ck.resources if any(fnmatch.fnmatch(n, g) for g in globs)]
            if not names:
                continue
            left = {k: v for k, v in ck.resources.items() if k not in names}
            # A fresh dict: the JSON column notices a reassignment, not an in-place edit.
            ck.resources = left
            # Sizes come from the trial's report (untrusted): anything but an int counts as nothing.
            ck.size = sum(int(v) for v in left.values() if isinstance(v, int))
            ck.state = "PARTIALLY_DELETED" if left else "DELETED"
            # Files of a dir without its run's mark are not ours to remove (controller/gc.py).
            top = path.path if path is not None and is_ours(path) else None
            files = tuple(f for n in names if top is not None and (f := _inside(top, n)) is not None)
            plan.append(Removal(uuid, path, files))
    for r in plan:
        for f in r.files:
            _unlink_own(f)
    return plan


def _inside(top: Path, name: str) -> Path | None:
    """``top/name`` when it stays inside ``top``: the names come from the trial's report, so a
    ``..``, an absolute name or a directory link leading out is refused. The last component is
    not resolved: a link there is the thing named (and _unlink_own leaves links alone)."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        return None
    path = top / rel
    return path if path.parent.resolve().is_relative_to(top) else None


def _unlink_own(path: Path) -> None:
    """Remove one regular file of this user's; anything else (a link, a directory, another
    user's file) is left alone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
        path.unlink(missing_ok=True)
