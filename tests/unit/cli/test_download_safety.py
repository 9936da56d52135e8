"""Checkpoint downloads write only into a fresh directory (never through a link an earlier
download left), and the laptop side of a remote download re-checks what the login node named."""

from __future__ import annotations

import json
import os
import uuid as uuidlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import EXAMPLES

from detslurm import settings
from detslurm.cli.remote.target import RemoteError
from detslurm.cli.remote.transfer import _checked_source
from detslurm.download_dir import DestinationExists, fresh_download_dir
from detslurm.store import Checkpoint, open_store


@pytest.fixture
def two_checkpoints(det: Any, det_env: Path) -> tuple[str, str]:
    """Two real checkpoints of one experiment, the uuids oldest first."""
    code, out, err = det(
        "e", "create", "--local", EXAMPLES / "core_api/const.yaml", EXAMPLES / "core_api",
        "--config", "hyperparameters.sleep=0", "--config", "checkpoint_storage.type=shared_fs",
        "--config", f"checkpoint_storage.host_path={det_env / 'ckpts'}", "--config", "checkpoint_storage.save_trial_latest=5",
    )  # fmt: skip
    assert code == 0, out + err
    with open_store(settings.load().db_url).tx() as s:
        uuids = [c.uuid for c in s.query(Checkpoint).order_by(Checkpoint.steps_completed) if c.state == "COMPLETED"]
    assert len(uuids) >= 2, uuids
    return uuids[0], uuids[1]


def test_a_download_never_writes_through_a_link_an_earlier_one_left(
    det: Any, det_env: Path, two_checkpoints: tuple[str, str]
) -> None:
    """Checkpoint A holds ``sub -> victim``, checkpoint B holds ``sub/authorized_keys``: downloading
    both to one directory must not put B's file into the victim dir."""
    a, b = two_checkpoints
    victim = det_env / "victim"
    victim.mkdir()
    ckpts = det_env / "ckpts"
    (ckpts / a / "sub").symlink_to(victim)
    (ckpts / b / "sub").mkdir()
    (ckpts / b / "sub" / "authorized_keys").write_text("ssh-ed25519 AAAA attacker")
    dl = det_env / "dl"
    assert det("c", "download", a, "-o", dl)[0] == 0
    assert (dl / "sub").is_symlink()  # copied as a link, as before
    assert (ckpts / a / ".detslurm-checkpoint").is_file() and not (dl / ".detslurm-checkpoint").exists()
    code, out, err = det("c", "download", b, "-o", dl)
    assert code == 1 and f"{dl} already exists" in err, out + err
    assert list(victim.iterdir()) == []


def test_a_download_fills_an_empty_dir_and_leaves_nothing_when_it_fails(det: Any, det_env: Path) -> None:
    empty = det_env / "empty"
    empty.mkdir()
    with fresh_download_dir(empty) as tmp:
        (tmp / "f").write_text("x")
    assert (empty / "f").read_text() == "x"
    with pytest.raises(DestinationExists):
        with fresh_download_dir(empty):
            pass
    target = det_env / "t"
    with pytest.raises(OSError), fresh_download_dir(target) as tmp:
        (tmp / "half").write_text("x")
        raise OSError("the copy failed")
    assert not target.exists() and [p.name for p in det_env.iterdir() if p.name.startswith(".t.")] == []


def test_a_link_in_place_of_the_destination_is_refused(det_env: Path) -> None:
    (det_env / "elsewhere").mkdir()
    (det_env / "dl").symlink_to(det_env / "elsewhere")
    with pytest.raises(DestinationExists), fresh_download_dir(det_env / "dl"):
        pass


@pytest.mark.parametrize(
    "uuid, directory",
    [
        ("datasets", "/home/u/ckpts/datasets"),  # not a uuid as the Core API makes them
        ("3F2B8C1E-9D4A-4E7B-A1C6-5B0D2E8F7A93", "/home/u/ckpts/X"),  # not canonical (upper case)
        ("00000000-0000-1000-8000-000000000000", "/c/00000000-0000-1000-8000-000000000000"),  # uuid1
        ("9c41e7d2-0b5a-4f3e-8d16-2a7c9e4b1f08", "/home/u/.ssh"),  # a directory that is not <base>/<uuid>
        ("U", "relative/U"),
    ],
)
def test_the_laptop_refuses_a_directory_that_is_not_base_slash_uuid(uuid: str, directory: str) -> None:
    conn = SimpleNamespace(login="u@hpc")
    with pytest.raises(RemoteError, match="refusing to download it"):
        _checked_source(conn, json.dumps({"uuid": uuid, "directory": directory}))


def test_the_laptop_accepts_base_slash_uuid() -> None:
    u = str(uuidlib.uuid4())
    assert _checked_source(SimpleNamespace(login="u@hpc"), json.dumps({"uuid": u, "directory": f"/c/{u}"})) == f"/c/{u}"
    assert os.sep == "/"  # remote paths are POSIX; so is this machine's
