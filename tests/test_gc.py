"""Checkpoint GC: "latest" by steps, not by the trial's clock; only under the storage base."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from detslurm.controller.gc import checkpoint_dir, collect_garbage, remove_dirs
from detslurm.expconf import validate
from detslurm.store import Checkpoint, Experiment, Store, Trial, open_store


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
            owner="me",
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
    for uuid, steps, when in (("a" * 8, 10, now), ("b" * 8, 20, now - timedelta(minutes=10))):
        (base / uuid).mkdir(parents=True)
        add_checkpoint(store, uuid, steps, when, str(base / uuid))
    with store.tx() as s:
        doomed = collect_garbage(s, s.get(Experiment, exp_id))
    # The step-20 checkpoint was reported by a node 10 minutes behind: it is still the latest.
    assert doomed == [(base / ("a" * 8)).resolve()]


def test_paths_outside_the_base_are_never_collected(tmp_path: Path) -> None:
    store, exp_id, base = setup(tmp_path)
    precious = tmp_path / "precious"
    precious.mkdir()
    now = datetime.now(timezone.utc)
    add_checkpoint(store, "../precious", 1, now, str(precious))  # a hostile uuid
    add_checkpoint(store, "c" * 8, 2, now, str(precious))  # a hostile storage_path
    add_checkpoint(store, "d" * 8, 3, now, str(base / ("d" * 8)))
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        doomed = collect_garbage(s, exp)
        assert checkpoint_dir(exp, "../precious") is None
    assert all(p.is_relative_to(base.resolve()) for p in doomed) and precious.resolve() not in doomed


def test_a_checkpoint_replaced_by_a_link_is_not_followed_when_removed(tmp_path: Path) -> None:
    """A trial can put a symlink where its checkpoint dir was (to another experiment's
    checkpoint, which may share the base): GC removes real checkpoint dirs only."""
    store, exp_id, base = setup(tmp_path)
    base.mkdir()
    victim = base / "another-experiments"
    victim.mkdir()
    (victim / "w.pt").write_bytes(b"w")
    real = base / ("r" * 8)
    real.mkdir()
    (base / ("l" * 8)).symlink_to(victim)
    now = datetime.now(timezone.utc)
    add_checkpoint(store, "r" * 8, 1, now, str(real))
    add_checkpoint(store, "l" * 8, 2, now, str(base / ("l" * 8)))
    add_checkpoint(store, "k" * 8, 3, now, str(base / ("k" * 8)))  # the one GC keeps
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        assert checkpoint_dir(exp, "l" * 8) == base.resolve() / ("l" * 8)  # the link itself
        doomed = collect_garbage(s, exp)
    remove_dirs(doomed)
    assert (victim / "w.pt").read_bytes() == b"w"  # not reached through the link
    assert not real.exists()  # the real one is gone
