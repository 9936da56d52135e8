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
from detslurm.protocol.ckmark import MARKER_NAME
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
    # Everything the trial saved, less the run's delete mark (it stays with the storage copy).
    saved = {k: v for k, v in _tree(hostile["ckpts"] / uuid).items() if k != MARKER_NAME}
    assert _tree(dst) == saved and saved


FORGING_TRIAL = """
import determined as det
from detslurm.protocol.events import CheckpointSaved

with det.core.init() as ctx:
    # Forged: the uuid names a directory of the user's beside the checkpoints.
    ctx.checkpoint._report(CheckpointSaved(uuid="datasets", metadata={"steps_completed": 1}, resources={},
                                           steps_completed=1, size=0, storage_path="x"))
    with ctx.checkpoint.store_path({"steps_completed": 2}) as (path, _):
        (path / "w.txt").write_text("w")
"""


def test_gc_leaves_a_dir_a_trial_named_in_a_forged_checkpoint_event(det: Any, det_env: Path) -> None:
    """The trial itself forges a checkpoint event whose uuid is ``datasets``, with the storage
    base at a scratch dir holding the user's ``datasets``: GC at the experiment's end (which drops
    the older, forged checkpoint) leaves that dir alone."""
    scratch = det_env / "scratch"
    (scratch / "datasets").mkdir(parents=True)
    (scratch / "datasets" / "keep.txt").write_text("do not delete")
    ctx = det_env / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text(FORGING_TRIAL)
    (ctx / "exp.yaml").write_text(
        "name: forge\nentrypoint: python3 train.py\nsearcher: {name: single, metric: loss}\nmax_restarts: 0\n"
        f"checkpoint_storage: {{type: shared_fs, host_path: '{scratch}', save_trial_latest: 1, save_trial_best: 0,"
        " save_experiment_best: 0}\n"
    )
    code, out, err = det("e", "create", "--local", ctx / "exp.yaml", ctx)
    assert code == 0, out + err
    store = open_store(settings.load().db_url)
    with store.tx() as s:
        trial = s.get(Trial, 1)
        assert trial is not None and trial.experiment.state == "COMPLETED", trial and trial.experiment.state
        states = {c.uuid: c.state for c in s.query(Checkpoint)}
    assert states.pop("datasets") == "DELETED"  # the forged row was stored and dropped by the policy
    assert list(states.values()) == ["COMPLETED"]
    assert _tree(scratch / "datasets") == {"keep.txt": b"do not delete"}


@pytest.mark.slurm
@pytest.mark.security
def test_on_slurm_gc_removes_only_marked_checkpoints(slurm_env: Path, det: Any) -> None:
    """The forging trial as a Slurm job: GC at the end removes the real checkpoint the policy drops
    (marked in the job with the secret the login side made) and never the user's ``datasets``."""
    scratch = slurm_env / "scratch"
    (scratch / "datasets").mkdir(parents=True)
    (scratch / "datasets" / "keep.txt").write_text("do not delete")
    ctx = slurm_env / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text(FORGING_TRIAL.replace('"steps_completed": 2', '"steps_completed": 0'))
    with open(ctx / "train.py", "a") as f:  # a newer checkpoint: GC keeps it and drops the first
        f.write(
            "    with ctx.checkpoint.store_path({'steps_completed': 3}) as (path, _):\n"
            "        (path / 'w.txt').write_text('w')\n"
        )
    (ctx / "exp.yaml").write_text(
        "name: forge\nentrypoint: python3 train.py\nsearcher: {name: single, metric: loss}\nmax_restarts: 0\n"
        f"checkpoint_storage: {{type: shared_fs, host_path: '{scratch}', save_trial_latest: 1, save_trial_best: 0,"
        " save_experiment_best: 0}\n"
    )
    assert det("e", "create", ctx / "exp.yaml", ctx)[0] == 0
    code, out, err = det("e", "wait", "1")
    assert code == 0 and "COMPLETED" in out, out + err
    with open_store(settings.load().db_url).read() as s:
        states = {c.steps_completed: (c.uuid, c.state) for c in s.query(Checkpoint)}
    assert [st for _, (_, st) in sorted(states.items())] == ["DELETED", "DELETED", "COMPLETED"], states
    assert not (scratch / states[0][0]).exists()  # the real checkpoint GC dropped is gone
    assert (scratch / states[3][0] / ".detslurm-checkpoint").is_file()
    assert _tree(scratch / "datasets") == {"keep.txt": b"do not delete"}
