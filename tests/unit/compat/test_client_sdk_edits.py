"""What Determined's SDK changes and reads beyond metrics, over detslurm's store: a
checkpoint's metadata, its deletion and partial removal (through `det checkpoint delete`/`rm`'s
operations, which only touch dirs our checkpoint code marked), a trial's logs (read as
`det trial logs` reads them), the run id of each metrics report, and ExperimentSortBy."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from test_gc import add_checkpoint, run_key, saved, setup, uid

from detslurm import client
from detslurm.errors import DetSlurmError
from detslurm.store import Checkpoint, Experiment, Store, Trial
from detslurm.store.models import Metric, TrialRun


@pytest.fixture
def sdk(tmp_path: Path) -> tuple[Any, Store, Path]:
    store, _, base = setup(tmp_path)
    return client.Determined(master=f"sqlite:///{tmp_path / 'db.sqlite'}"), store, base


def test_metadata_is_added_and_removed_in_the_store(sdk: tuple[Any, Store, Path]) -> None:
    det, store, base = sdk
    add_checkpoint(store, uid("a"), 5, datetime.now(timezone.utc), str(base / uid("a")))
    ck = det.get_checkpoint(uid("a"))
    ck.add_metadata({"note": "best", "deep": {"k": [1]}})
    ck.add_metadata({"note": "better"})  # a key already there is replaced
    assert det.get_checkpoint(uid("a")).metadata == {"note": "better", "deep": {"k": [1]}}
    ck.remove_metadata(["note", "absent"])
    assert ck.metadata == det.get_checkpoint(uid("a")).metadata == {"deep": {"k": [1]}}
    with pytest.raises(TypeError, match="JSON-serializable"):
        ck.add_metadata({"when": datetime.now()})
    with pytest.raises(TypeError, match="list of keys"):
        ck.remove_metadata("deep")


def test_another_users_checkpoint_metadata_cannot_change(sdk: tuple[Any, Store, Path]) -> None:
    det, store, base = sdk
    add_checkpoint(store, uid("a"), 5, datetime.now(timezone.utc), str(base / uid("a")))
    ck = det.get_checkpoint(uid("a"))
    with store.tx() as s:
        s.query(Experiment).one().owner = "someone-else"
    with pytest.raises(DetSlurmError):
        ck.add_metadata({"x": 1})


def test_delete_and_remove_files_go_through_the_checkpoint_operations(sdk: tuple[Any, Store, Path]) -> None:
    det, store, base = sdk
    tmp_path = base.parent
    now = datetime.now(timezone.utc)
    ours, unmarked = saved(base, uid("a"), run_key(tmp_path)), base / uid("b")
    unmarked.mkdir()
    for d in (ours, unmarked):
        (d / "w.pt").write_bytes(b"w")
        (d / "keep.txt").write_text("k")
        add_checkpoint(store, d.name, 1, now, str(d))
    with store.tx() as s:
        for row in s.query(Checkpoint):
            row.resources, row.state = {"w.pt": 1, "keep.txt": 1}, "COMPLETED"
    ck = det.get_checkpoint(ours.name)
    ck.remove_files(["*.pt"])
    assert not (ours / "w.pt").exists() and (ours / "keep.txt").exists()
    assert ck.state == client.CheckpointState.PARTIALLY_DELETED
    ck.delete()
    assert not ours.exists() and ck.state == client.CheckpointState.DELETED
    other = det.get_checkpoint(unmarked.name)
    other.delete()  # the row is DELETED; a dir our code did not mark is left alone
    assert other.state == client.CheckpointState.DELETED and (unmarked / "w.pt").exists()
    with pytest.raises(TypeError, match="list of glob"):
        ck.remove_files("*.pt")


def _log(store: Store, tmp_path: Path) -> int:
    log = tmp_path / "out.log"
    log.write_text("[rank=0] INFO: starting\n[rank=1] WARNING: slow node\n[rank=0] loss 0.5\n[rank=1] ERROR: boom\n")
    with store.tx() as s:
        run = s.query(TrialRun).one()
        run.log_path = str(log)
        return int(run.trial_id)


def test_trial_logs_are_the_runs_output_as_det_trial_logs_reads_it(sdk: tuple[Any, Store, Path]) -> None:
    det, store, base = sdk
    trial = det.get_trial(_log(store, base.parent))
    lines = list(trial.iter_logs())
    assert lines == [
        "[rank=0] INFO: starting\n",
        "[rank=1] WARNING: slow node\n",
        "[rank=0] loss 0.5\n",
        "[rank=1] ERROR: boom\n",
    ]
    assert list(trial.iter_logs(head=1)) == lines[:1]
    assert list(trial.iter_logs(tail=2)) == lines[2:]
    assert list(trial.iter_logs(rank_ids=[1])) == [lines[1], lines[3]]
    assert list(trial.iter_logs(min_level="WARNING")) == [lines[1], lines[3]]
    assert list(trial.iter_logs(search_text="loss", tail=5)) == [lines[2]]
    assert list(trial.iter_logs(timestamp_before=0)) == []  # every run started after 1970
    with pytest.warns(FutureWarning, match="iter_logs"):
        assert list(trial.logs(tail=1)) == lines[3:]
    for bad, match in (
        ({"follow": True}, "det trial logs -f"),
        ({"head": -1}, "non-negative"),
        ({"container_ids": ["c"]}, "rank_ids"),
        ({"min_level": "LOUD"}, "min_level"),
        ({"timestamp_after": "yesterday"}, "ISO 8601"),
    ):
        with pytest.raises((ValueError, DetSlurmError), match=match):
            list(trial.iter_logs(**bad))


def test_trial_metrics_carry_their_run_id(sdk: tuple[Any, Store, Path]) -> None:
    det, store, _ = sdk
    with store.tx() as s:
        tid = s.query(Trial).one().id
        for run_id, steps in ((1, 10), (2, 20)):
            s.add(
                Metric(
                    trial_id=tid,
                    run_id=run_id,
                    group="training",
                    steps_completed=steps,
                    metrics={"loss": 1.0},
                    report_time=datetime.now(timezone.utc),
                )
            )
    got = [(m.steps_completed, m.trial_run_id) for m in det.get_trial(tid).iter_metrics("training")]
    assert got == [(10, 1), (20, 2)]


def test_experiments_sort_by_experimentsortby(sdk: tuple[Any, Store, Path]) -> None:
    det, store, _ = sdk
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    with store.tx() as s:
        first = s.query(Experiment).one()
        first.name, first.end_time = "zeta", t0
        for name, end in (("alpha", None), ("mid", t0 + timedelta(days=1))):
            e = Experiment(**{c: getattr(first, c) for c in ("owner", "config", "original_config", "context_sha256")})
            e.name, e.end_time, e.state = name, end, "COMPLETED"
            e.exp_dir, e.executor, e.resource_pool, e.progress = os.devnull, "local", "", 0.0
            e.archived, e.test_mode = False, False
            s.add(e)
    names = [e.name for e in det.list_experiments(sort_by=client.ExperimentSortBy.NAME)]
    assert names == ["alpha", "mid", "zeta"]
    by_end = det.list_experiments(sort_by=client.ExperimentSortBy.END_TIME, order_by=client.OrderBy.DESCENDING)
    assert [e.name for e in by_end] == ["mid", "zeta", "alpha"]  # not ended: last either way
    assert [e.name for e in det.list_experiments()] == ["zeta", "alpha", "mid"]  # by id
    with pytest.raises(ValueError, match="sort_by may be one of ID"):
        det.list_experiments(sort_by=client.ExperimentSortBy.CHECKPOINT_SIZE)
    assert client.ExperimentSortBy.ID.value.name == "ID" and json.dumps(client.ExperimentSortBy.ID.value.value)
