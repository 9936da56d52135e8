"""Checkpoint garbage collection by the expconf GC policy, once an experiment has ended.

Kept: each trial's newest ``save_trial_latest`` checkpoints, its best ``save_trial_best`` by the
searcher metric, and the experiment's best ``save_experiment_best``. The rest are deleted from
storage and marked DELETED (the rows stay, so history still shows them).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from detslurm import settings
from detslurm.controller.config import stored_config
from detslurm.controller.detached import EXECUTOR as DETACHED
from detslurm.protocol.ckmark import canonical_uuid, has_mark
from detslurm.protocol.secret import SECRET_FILE_NAME, RunSecretError, read_run_secret
from detslurm.store.models import Checkpoint, Experiment, Trial, TrialRun
from detslurm.views import validation_metric

log = logging.getLogger(__name__)


def keep_set(session: Session, exp: Experiment) -> set[str]:
    """The uuids the experiment's GC policy keeps (latest and best per trial, best of the experiment)."""
    cfg = stored_config(exp)
    policy = cfg.storage
    metric = cfg.searcher.metric or ""
    sign = 1.0 if cfg.searcher.smaller_is_better else -1.0
    keep: set[str] = set()
    scored_all: list[tuple[float, str]] = []
    for t in session.scalars(select(Trial).where(Trial.experiment_id == exp.id)):
        cks = list(
            session.scalars(
                select(Checkpoint)
                .where(Checkpoint.trial_id == t.id)
                .where(Checkpoint.state == "COMPLETED")
                # Oldest first, so the slice from the end is the newest; report_time breaks ties between runs
                # that checkpointed at the same step.
                .order_by(Checkpoint.steps_completed, Checkpoint.report_time)
            )
        )
        latest = policy.save_trial_latest
        if latest:
            keep.update(c.uuid for c in cks[-latest:])
        scored = [(sign * v, c.uuid) for c in cks if (v := validation_metric(session, c, metric)) is not None]
        scored.sort()
        keep.update(u for _, u in scored[: policy.save_trial_best])
        scored_all += scored
    scored_all.sort()
    keep.update(u for _, u in scored_all[: policy.save_experiment_best])
    return keep


# What a checkpoint uuid may look like: Core API uuids are uuid4 strings; anything with a path
# separator or only dots could make "base/uuid" point outside the storage base.
_UUID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")


def valid_checkpoint_uuid(uuid: str) -> bool:
    """Whether ``uuid`` may name a directory: one path component, no separators, no dot-names."""
    return _UUID.fullmatch(uuid) is not None


def delete_base(exp: Experiment) -> Path:
    """The base below which deletes look for this experiment's checkpoints, resolved (a link the
    user chose, such as ``~/ckpts -> /lustre/...``). A detached run's stored base comes from a
    record its job wrote, so for those it is pinned to the user's configured checkpoint dir."""
    base = settings.load().checkpoint_dir if exp.executor == DETACHED else Path(stored_config(exp).storage_base)
    return base.resolve()


def checkpoint_dir(exp: Experiment, uuid: str, base: Path | None = None) -> Path | None:
    """Where a checkpoint of this experiment lives: always ``<base>/<uuid>`` (``base`` defaults to
    :func:`delete_base`), and only for a canonical UUID4. The path a trial reported is never
    trusted for deletes (it could name any directory of the user's). The uuid, one checked path
    component, is not resolved: a symlink the trial put in its place is not a checkpoint
    (:func:`remove_own_dir` leaves it alone)."""
    if not canonical_uuid(uuid):
        return None
    return (base or delete_base(exp)) / uuid


@dataclass(frozen=True)
class Doomed:
    """A checkpoint dir to remove, with the key of the run that saved it: removed only when its
    mark (protocol/ckmark.py) is valid under that key."""

    path: Path
    uuid: str
    key: bytes | None


class Doom:
    """Builds the :class:`Doomed` entries of one experiment's checkpoints: the base is resolved
    once and each run's key read once, however many checkpoints the experiment has."""

    def __init__(self, session: Session, exp: Experiment) -> None:
        self._session = session
        self._exp = exp
        self._base: Path | None = None
        self._keys: dict[tuple[int, int], bytes | None] = {}

    def __call__(self, ck: Checkpoint) -> Doomed | None:
        """What removing ``ck``'s files means, or None when it has no dir of ours to remove."""
        if self._base is None:
            self._base = delete_base(self._exp)
        path = checkpoint_dir(self._exp, ck.uuid, self._base)
        if path is None:
            return None
        run = (ck.trial_id, ck.run_id)
        if run not in self._keys:
            self._keys[run] = _run_key(self._session, *run)
        return Doomed(path, ck.uuid, self._keys[run])


def _run_key(session: Session, trial_id: int, run_id: int) -> bytes | None:
    run = session.scalars(
        select(TrialRun).where(TrialRun.trial_id == trial_id).where(TrialRun.run_id == run_id)
    ).first()
    if run is None:
        return None
    try:
        return read_run_secret(Path(run.run_dir) / SECRET_FILE_NAME)
    except RunSecretError as e:
        log.warning("trial %s run %s: its key is unusable, its checkpoints' files are kept: %s", trial_id, run_id, e)
        return None


def collect_garbage(session: Session, exp: Experiment) -> list[Doomed]:
    """Mark the checkpoints the policy drops as DELETED; returns their directories, which the
    caller removes after the commit (a big rmtree must not hold the store's write lock)."""
    keep = keep_set(session, exp)
    doom = Doom(session, exp)
    out: list[Doomed] = []
    q = select(Checkpoint).join(Trial).where(Trial.experiment_id == exp.id).where(Checkpoint.state == "COMPLETED")
    for ck in session.scalars(q):
        if ck.uuid in keep:
            continue
        d = doom(ck)
        if d is not None:
            out.append(d)
        # Marked even when the path check failed: the directory is then not ours to remove, but the
        # policy has still dropped the checkpoint.
        ck.state = "DELETED"
    return out


def remove_dirs(dirs: list[Doomed]) -> None:
    """Remove the doomed checkpoint dirs that carry their run's mark; errors are ignored, as the
    rows are already marked DELETED."""
    for d in dirs:
        remove_checkpoint(d)


def is_ours(d: Doomed) -> bool:
    """Whether our checkpoint code made this dir for the run that saved it (its mark)."""
    return d.key is not None and has_mark(d.path, d.key, d.uuid)


def remove_checkpoint(d: Doomed) -> None:
    """Remove one checkpoint dir if our checkpoint code made it for that run (its mark)."""
    if not is_ours(d):
        if os.path.lexists(d.path):
            log.warning("not removing %s: it has no valid checkpoint mark of its run", d.path)
        return
    remove_own_dir(d.path)


def remove_own_dir(path: Path) -> None:
    """Remove ``path`` if it is a real directory of this user's. Paths come from the store,
    which other users of a shared database can write (docs/design/security.md), and below a checkpoint base a
    trial writes: a symlink (to another experiment's checkpoint, say), or a directory someone
    else owns, is left alone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        log.warning("not removing %s: not a directory of this user's", path)
        return
    # ignore_errors: the rows are already gone, so a half-removed tree must not turn into a
    # failed delete the user cannot repeat; leftovers are only disk space.
    shutil.rmtree(path, ignore_errors=True)
