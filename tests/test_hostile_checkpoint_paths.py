"""Checkpoint rows are written from what a trial reported, so their paths are untrusted
(docs/design/security.md): `det e delete` and `det checkpoint download` touch only
``<storage base>/<uuid>`` and ``./checkpoints/<uuid>``, whatever a row says."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES

from detslurm import settings
from detslurm.store import Checkpoint, Trial, open_store

CORE = EXAMPLES / "core_api"


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def hostile(det: Any, det_env: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A completed experiment with its real checkpoints, plus two rows a hostile trial could
    have made: a plausible uuid whose storage_path is a precious dir, and the uuid ``../x``
    (``<base>/../x`` is a sibling of the storage base)."""
    code, out, err = det("e", "create", "--local", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=0")
    assert code == 0, out + err
    precious, sibling = det_env / "precious", det_env / "x"
    for d in (precious, sibling):
        d.mkdir()
        (d / "keep.txt").write_text("do not delete")
    store = open_store(settings.load().db_url)
    with store.tx() as s:
        trial = s.get(Trial, 1)
        assert trial is not None and trial.experiment.state == "COMPLETED"
        for uuid, path in (("plausible-uuid", precious), ("../x", sibling)):
            s.add(
                Checkpoint(
                    uuid=uuid,
                    trial_id=1,
                    run_id=1,
                    steps_completed=99,
                    state="COMPLETED",
                    storage_path=str(path),
                    metadata_={},
                    resources={},
                    size=0,
                    report_time=datetime.now(timezone.utc),
                )
            )
    work = det_env / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return {"precious": precious, "sibling": sibling, "work": work, "ckpts": det_env / "ckpts"}


def test_delete_removes_only_checkpoints_under_the_storage_base(det: Any, hostile: dict[str, Path]) -> None:
    real = [p for p in hostile["ckpts"].iterdir()]
    exp_dirs = list((hostile["ckpts"].parent / "exps").iterdir())
    assert real and exp_dirs  # the experiment's own checkpoints and dir, which delete must remove
    code, out, err = det("e", "delete", "--yes", 1)
    assert code == 0, out + err
    assert not [p for p in real if p.exists()]
    for name in ("precious", "sibling"):
        assert _tree(hostile[name]) == {"keep.txt": b"do not delete"}, name
    assert not [p for p in exp_dirs if p.exists()]


def test_download_refuses_a_uuid_that_leaves_checkpoints_dir(det: Any, hostile: dict[str, Path]) -> None:
    def files() -> dict[str, bytes]:  # everything under the test's dirs but the store
        return {k: v for k, v in _tree(hostile["sibling"].parent).items() if not k.startswith("data/")}

    before = files()
    code, out, err = det("checkpoint", "download", "../x")
    assert code == 1 and "checkpoint uuid '../x' is not a valid checkpoint id" in err, out + err
    assert "Traceback" not in err
    assert files() == before  # nothing written anywhere


def test_download_copies_from_the_storage_base_never_the_reported_path(det: Any, hostile: dict[str, Path]) -> None:
    code, out, err = det("checkpoint", "download", "plausible-uuid")
    assert code == 1 and "checkpoint files for plausible-uuid not found" in err, out + err
    assert not (hostile["work"] / "checkpoints/plausible-uuid").exists()  # precious/ was not copied
    # A real checkpoint downloads to ./checkpoints/<uuid>, from <storage base>/<uuid>.
    uuid = next(p.name for p in hostile["ckpts"].iterdir())
    code, out, err = det("checkpoint", "download", uuid)
    assert code == 0, out + err
    dst = hostile["work"] / "checkpoints" / uuid
    assert _tree(dst) == _tree(hostile["ckpts"] / uuid) and _tree(dst)
