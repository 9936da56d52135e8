"""A second user on the same machine cannot read another user's experiment data.

The victim's data lives under a directory the attacker may traverse but not list (0711), so only
the product's own modes stand in the way; a world-readable control file proves the attacker
could read it if those modes allowed it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES
from security_harness import Attacker, victim_base

from detslurm import settings

pytestmark = pytest.mark.security


@pytest.fixture
def finished_experiment(det: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """One completed local experiment (with a checkpoint) of this test's user, under victim_base()."""
    base = victim_base()
    for name, sub in (("DATA", "data"), ("EXPERIMENTS", "exps"), ("CHECKPOINT", "ckpts")):
        monkeypatch.setenv(f"DETSLURM_{name}_DIR", str(base / sub))
    code, out, err = det("e", "create", "--local", EXAMPLES / "core_api/const.yaml", EXAMPLES / "core_api")
    assert code == 0, out + err
    control = base / "public.txt"
    control.write_text("anyone may read this")
    control.chmod(0o644)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_experiment_dir_data_dir_and_store_are_private(mallory: Attacker, finished_experiment: Path) -> None:
    base = finished_experiment
    assert mallory.can_read(base / "public.txt")  # control: the probe reads what it is allowed to
    s = settings.load()
    (exp_dir,) = (base / "exps").glob("exp-1-*")  # exp-<id>-<random part>
    store_files = sorted(s.data_dir.glob("*.db"))
    assert exp_dir.is_dir() and store_files and s.data_dir.is_relative_to(base)
    for target in (exp_dir, exp_dir / "config.yaml", exp_dir / "context.tar.gz", s.data_dir, *store_files):
        assert target.exists() and not mallory.can_read(target), f"{mallory.user.pw_name} can read {target}"


def test_checkpoints_are_private(mallory: Attacker, finished_experiment: Path) -> None:
    """The checkpoint base and every checkpoint are the owner's alone."""
    ckpts = finished_experiment / "ckpts"
    files = sorted(ckpts.rglob("metadata.json"))
    assert files
    assert not [f for f in files if mallory.can_read(f)]
    assert not mallory.can_read(ckpts) and not [f.parent for f in files if mallory.can_read(f.parent)]


def test_run_secret_file_is_private(mallory: Attacker) -> None:
    """The collectives' key: even in a directory others may enter, only its owner reads it."""
    from detslurm.protocol.secret import write_run_secret

    base = victim_base()
    try:
        control = base / "public.txt"
        control.write_text("x")
        control.chmod(0o644)
        secret = write_run_secret(base)
        assert mallory.can_read(control) and not mallory.can_read(secret)
    finally:
        shutil.rmtree(base, ignore_errors=True)
