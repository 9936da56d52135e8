"""Removing an experiment's TensorBoard files (``Experiment.delete_tensorboard_files``).

They lie in directories its trials can write: ``<exp>/trials/<t>/tensorboard`` (what `det
tensorboard` reads) and ``<exp>/trials/<t>/runs/<r>/tensorboard`` (what a run's chief wrote).
Each path is built from store ids (protocol/paths.py) and walked one component at a time from
the experiment dir without following a link: a trial that put a link in the place of any part
of it loses that link, never the files it names.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

from detslurm.protocol import ExpPaths

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def remove_files(exp_dir: Path, runs: Mapping[int, Sequence[int]]) -> None:
    """Remove the TensorBoard dirs of these trials (id -> its run ids) of the experiment in ``exp_dir``."""
    paths = ExpPaths(exp_dir)
    for trial_id, run_ids in runs.items():
        targets = [paths.trial_tensorboard(trial_id)] + [paths.run(trial_id, r).tensorboard for r in run_ids]
        for target in targets:
            _remove_below(paths.root, target.relative_to(paths.root).parts)


def _remove_below(root: Path, parts: Sequence[str]) -> None:
    """Remove ``root/parts...`` (a tree, a file or a link), reaching it through real directories only."""
    try:
        fd = os.open(root, _DIR)
    except FileNotFoundError:
        return
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):
                return  # not there, or a link or a file in a directory's place: nothing of ours below
            except OSError as e:
                if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                    return
                raise
            os.close(fd)
            fd = nxt
        _remove_at(fd, parts[-1])
    finally:
        os.close(fd)


def _remove_at(dir_fd: int, name: str) -> None:
    """Remove the entry ``name`` of the directory ``dir_fd``: a directory with all it holds
    (entries read through its descriptor, never through a path), anything else unlinked."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, _DIR, dir_fd=dir_fd)
    try:
        # Checked again on the opened directory: the entry could have been swapped since the stat.
        if not os.path.samestat(st, os.fstat(fd)):
            return
        with os.scandir(fd) as entries:
            names = [e.name for e in entries]
        for child in names:
            _remove_at(fd, child)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dir_fd)
