"""Checkpoint GC: "latest" by steps, not by the trial's clock; only under the storage base, only
canonical uuids, and only dirs that carry their run's mark (protocol/ckmark.py)."""

from __future__ import annotations

import uuid as uuidlib
from datetime import datetime, timedelta, timezone
from pathlib import Path

from pytest import MonkeyPatch

from detslurm import settings
from detslurm.controller import ckpt_ops, ops
from detslurm.controller.detached import EXECUTOR as DETACHED
from detslurm.controller.gc import checkpoint_dir, collect_garbage, remove_dirs
from detslurm.core import CheckpointContext, DummyDistributedContext
from detslurm.expconf import validate
from detslurm.identity import os_user
from detslurm.protocol.ckmark import write_mark
from detslurm.protocol.events import CheckpointSaved, Event
from detslurm.protocol.secret import SECRET_FILE_NAME, read_run_secret, write_run_secret
from detslurm.store import Checkpoint, Experiment, Store, Trial, open_store
from detslurm.store.models import TrialRun


def uid(c: str) -> str:
    """A canonical uuid4 that is easy to tell apart in a test: ``c`` repeated, version bits set."""
    return str(uuidlib.UUID(hex=(c * 32)[:32], version=4))


def run_key(tmp_path: Path) -> bytes:
    """The secret of the test experiment's run 1 (setup makes it)."""
    return read_run_secret(tmp_path / "run" / SECRET_FILE_NAME)


def saved(base: Path, uuid: str, key: bytes) -> Path:
    """A checkpoint dir as our checkpoint code leaves it: marked for its run."""
    d = base / uuid
    d.mkdir(parents=True)
    write_mark(d, key, uuid)
    return d


def setup(tmp_path: Path) -> tuple[Store, int, Path]:
    base = tmp_path / "ckpts"
    cfg = validate(
        {
            "name": "gc",
            "entrypoint": "x",
            "searcher": {"name": "single", "metric": "loss"},
            "checkpoint_storage": {"type": "shared_fs", "host_path": str(base), "save_trial_best": 0},
        }
    )
    store = open_store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with store.tx() as s:
        exp = Experiment(
            name="gc",
            owner=os_user(),
            config=cfg.as_dict(),
            original_config="",
            context_sha256="0",
            exp_dir=str(tmp_path / "exp"),
            executor="local",
            resource_pool="",
            progress=0.0,
            archived=False,
            test_mode=False,
            state="COMPLETED",
        )
        s.add(exp)
        s.flush()
        t = Trial(
            experiment_id=exp.id,
            request_id="r",
            hparams={},
            seed=1,
            restarts=0,
            run_count=1,
            steps_completed=20,
            progress=1.0,
            early_stopped=False,
            searcher_ops=[],
            ops_completed=0,
            ops_closed=False,
            ops_idle=False,
            state="COMPLETED",
        )
        s.add(t)
        s.flush()
        (tmp_path / "run").mkdir(mode=0o700)
        write_run_secret(tmp_path / "run")
        s.add(TrialRun(trial_id=t.id, run_id=1, executor="local", run_dir=str(tmp_path / "run"), log_path=""))
        return store, int(exp.id), base


def add_checkpoint(store: Store, uuid: str, steps: int, when: datetime, storage_path: str) -> None:
    with store.tx() as s:
        trial = s.query(Trial).one()
        s.add(
            Checkpoint(
                uuid=uuid,
                trial_id=trial.id,
                run_id=1,
                steps_completed=steps,
                storage_path=storage_path,
                metadata_={},
                resources={},
                size=0,
                report_time=when,
            )
        )


def test_latest_is_by_steps_even_when_a_node_clock_lags(tmp_path: Path) -> None:
    store, exp_id, base = setup(tmp_path)
    now = datetime.now(timezone.utc)
    for uuid, steps, when in ((uid("a"), 10, now), (uid("b"), 20, now - timedelta(minutes=10))):
        (base / uuid).mkdir(parents=True)
        add_checkpoint(store, uuid, steps, when, str(base / uuid))
    with store.tx() as s:
        doomed = collect_garbage(s, s.get(Experiment, exp_id))
    # The step-20 checkpoint was reported by a node 10 minutes behind: it is still the latest.
    assert [d.path for d in doomed] == [(base / uid("a")).resolve()]


def test_paths_outside_the_base_are_never_collected(tmp_path: Path) -> None:
    store, exp_id, base = setup(tmp_path)
    precious = tmp_path / "precious"
    precious.mkdir()
    now = datetime.now(timezone.utc)
    add_checkpoint(store, "../precious", 1, now, str(precious))  # a hostile uuid
    add_checkpoint(store, uid("c"), 2, now, str(precious))  # a hostile storage_path
    add_checkpoint(store, uid("d"), 3, now, str(base / uid("d")))
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        doomed = collect_garbage(s, exp)
        assert checkpoint_dir(exp, "../precious") is None
    paths = [d.path for d in doomed]
    assert all(p.is_relative_to(base.resolve()) for p in paths) and precious.resolve() not in paths


def test_a_checkpoint_replaced_by_a_link_is_not_followed_when_removed(tmp_path: Path) -> None:
    """A trial can put a symlink where its checkpoint dir was (to another experiment's
    checkpoint, which may share the base): GC removes real checkpoint dirs only."""
    store, exp_id, base = setup(tmp_path)
    base.mkdir()
    victim = base / "another-experiments"
    victim.mkdir()
    (victim / "w.pt").write_bytes(b"w")
    key = run_key(tmp_path)
    real = saved(base, uid("e"), key)
    link = uid("f")
    write_mark(victim, key, link)  # even a victim that looks marked is not reached through a link
    (base / link).symlink_to(victim)
    now = datetime.now(timezone.utc)
    add_checkpoint(store, uid("e"), 1, now, str(real))
    add_checkpoint(store, link, 2, now, str(base / link))
    add_checkpoint(store, uid("1"), 3, now, str(base / uid("1")))  # the one GC keeps
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        assert checkpoint_dir(exp, link) == base.resolve() / link  # the link itself
        doomed = collect_garbage(s, exp)
    remove_dirs(doomed)
    assert (victim / "w.pt").read_bytes() == b"w"  # not reached through the link
    assert not real.exists()  # the real one is gone


def test_a_forged_uuid_naming_a_dir_of_the_users_is_not_collected(tmp_path: Path) -> None:
    """A forged checkpoint event with uuid ``datasets`` under the storage base: GC at the end of
    the experiment must not remove the user's ``<base>/datasets``."""
    store, exp_id, base = setup(tmp_path)
    (base / "datasets").mkdir(parents=True)
    (base / "datasets" / "train.bin").write_bytes(b"data")
    now = datetime.now(timezone.utc)
    add_checkpoint(store, "datasets", 1, now, str(base / "datasets"))
    add_checkpoint(store, uid("a"), 2, now, str(saved(base, uid("a"), run_key(tmp_path))))
    with store.tx() as s:
        doomed = collect_garbage(s, s.get(Experiment, exp_id))
    remove_dirs(doomed)
    assert (base / "datasets" / "train.bin").read_bytes() == b"data"


def test_only_dirs_marked_for_their_run_are_removed(tmp_path: Path) -> None:
    store, exp_id, base = setup(tmp_path)
    key = run_key(tmp_path)
    now = datetime.now(timezone.utc)
    ours = saved(base, uid("a"), key)
    unmarked = base / uid("b")
    unmarked.mkdir()
    other_run = saved(base, uid("c"), b"k" * 32)  # marked, but with another key
    wrong_uuid = base / uid("d")
    wrong_uuid.mkdir()
    write_mark(wrong_uuid, key, uid("a"))  # a mark copied from another checkpoint
    for i, d in enumerate((ours, unmarked, other_run, wrong_uuid)):
        add_checkpoint(store, d.name, i + 1, now, str(d))
    add_checkpoint(store, uid("9"), 9, now, str(base / uid("9")))  # the one GC keeps
    with store.tx() as s:
        doomed = collect_garbage(s, s.get(Experiment, exp_id))
    assert len(doomed) == 4
    remove_dirs(doomed)
    assert not ours.exists()
    assert unmarked.is_dir() and other_run.is_dir() and wrong_uuid.is_dir()


def test_experiment_delete_removes_only_marked_checkpoints(tmp_path: Path) -> None:
    store, exp_id, base = setup(tmp_path)
    now = datetime.now(timezone.utc)
    ours = saved(base, uid("a"), run_key(tmp_path))
    projects = base / "projects"
    projects.mkdir()
    add_checkpoint(store, uid("a"), 1, now, str(ours))
    add_checkpoint(store, "projects", 2, now, str(projects))
    ops.delete(store, exp_id)
    assert not ours.exists() and projects.is_dir()


def test_a_detached_record_does_not_choose_the_base_of_deletes(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    """A detached run's base comes from a record its job wrote: a job that set it to the home dir
    must not get ``det e delete`` to remove a home dir, even one that looks like a checkpoint."""
    store, exp_id, home = setup(tmp_path)
    pinned = tmp_path / "configured-checkpoints"
    monkeypatch.setenv(settings.CHECKPOINT_DIR.name, str(pinned))
    with store.tx() as s:
        s.get(Experiment, exp_id).executor = DETACHED  # type: ignore[union-attr]
    key = run_key(tmp_path)
    now = datetime.now(timezone.utc)
    in_home = saved(home, uid("a"), key)
    ours = saved(pinned, uid("b"), key)
    add_checkpoint(store, uid("a"), 1, now, str(in_home))
    add_checkpoint(store, uid("b"), 2, now, str(ours))
    ops.delete(store, exp_id)
    assert in_home.is_dir() and not ours.exists()


def test_a_saved_checkpoint_carries_the_mark_gc_checks(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    """The save side writes the mark with the run's secret (named by the login side), outside the
    checkpoint's file list; GC then removes the dir."""
    store, exp_id, base = setup(tmp_path)
    monkeypatch.setenv(settings.RUN_SECRET_FILE.name, str(tmp_path / "run" / SECRET_FILE_NAME))
    events: list[Event] = []
    ctx = CheckpointContext(DummyDistributedContext(), base, events.append, require_steps=False)
    with ctx.store_path({"steps_completed": 1}) as (path, uuid):
        (path / "w.pt").write_bytes(b"w")
    saved_event = events[-1]
    assert isinstance(saved_event, CheckpointSaved) and sorted(saved_event.resources) == ["metadata.json", "w.pt"]
    now = datetime.now(timezone.utc)
    add_checkpoint(store, uuid, 1, now, str(base / uuid))
    add_checkpoint(store, uid("9"), 9, now, str(base / uid("9")))  # the one GC keeps
    with store.tx() as s:
        doomed = collect_garbage(s, s.get(Experiment, exp_id))
    remove_dirs(doomed)
    assert not (base / uuid).exists()


def test_checkpoint_rm_glob_leaves_files_of_an_unmarked_dir(tmp_path: Path) -> None:
    store, _, base = setup(tmp_path)
    now = datetime.now(timezone.utc)
    ours, theirs = saved(base, uid("a"), run_key(tmp_path)), base / uid("b")
    theirs.mkdir()
    for d in (ours, theirs):
        (d / "w.pt").write_bytes(b"w")
        add_checkpoint(store, d.name, 1, now, str(d))
    with store.tx() as s:
        for ck in s.query(Checkpoint):
            ck.resources = {"w.pt": 1}
    ckpt_ops.remove_files(store, [ours.name, theirs.name], ["*.pt"])
    assert not (ours / "w.pt").exists() and (theirs / "w.pt").read_bytes() == b"w"
