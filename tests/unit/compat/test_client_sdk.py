"""Determined's Python SDK (``from determined.experimental import client``) over detslurm's store:
experiments, trials, metrics and checkpoints as Determined's objects, their sorting and
selection, state changes through the controller's operations, and the scope (another user's
experiment is "not found"). Its names and signatures are compared with determined 0.38.1 by
tests/unit/compat/test_determined_oracle_surface.py."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import write

from detslurm import client, settings
from detslurm.controller.create import execute_create, plan_create
from detslurm.errors import DetSlurmError, NotFoundError
from detslurm.expconf import from_stored
from detslurm.store import Checkpoint, Experiment, ExperimentState, Metric, Trial, TrialState, open_store

CONFIG = "name: sdk\nentrypoint: python3 train.py\nsearcher: {name: grid, metric: loss, smaller_is_better: true}\n"
T0 = datetime(2026, 1, 2, tzinfo=timezone.utc)


def _experiment(tmp_path: Path, owner: str | None = None) -> tuple[int, list[int], dict[str, str]]:
    """One experiment with two trials; trial A has checkpoints at steps 10 (loss 0.5), 20 (0.2),
    30 (0.9), 35 (deleted); trial B at step 10 (loss 0.3). (id, trial ids, step label -> uuid)."""
    st = settings.load()
    store = open_store(st.db_url)
    write(tmp_path / "ctx" / "train.py", "pass\n")
    exp_id = execute_create(store, st, plan_create(st, write(tmp_path / "c.yaml", CONFIG), tmp_path / "ctx"), "slurm")
    uuids: dict[str, str] = {}
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        if owner is not None:
            exp.owner = owner
        base = Path(from_stored(exp.config, "test").storage_base)
        trials = [
            Trial(experiment_id=exp_id, request_id=r, hparams={"lr": lr}, seed=1) for r, lr in (("a", 0.1), ("b", 0.2))
        ]
        s.add_all(trials)
        s.flush()
        points = [
            (trials[0], 10, 0.5, "COMPLETED"),
            (trials[0], 20, 0.2, "COMPLETED"),
            (trials[0], 30, 0.9, "COMPLETED"),
        ]
        points += [(trials[0], 35, 0.1, "DELETED"), (trials[1], 10, 0.3, "COMPLETED")]
        for i, (t, steps, loss, state) in enumerate(points):
            when = T0 + timedelta(minutes=i)
            reports = {"training": {"loss": loss * 2}, "validation": {"loss": loss, "acc": 1 - loss}}
            for group, metrics in reports.items():
                s.add(
                    Metric(
                        trial_id=t.id, run_id=1, group=group, steps_completed=steps, metrics=metrics, report_time=when
                    )
                )
            uuid = f"ck-{t.request_id}-{steps}"
            uuids[f"{t.request_id}{steps}"] = uuid
            s.add(
                Checkpoint(
                    uuid=uuid,
                    trial_id=t.id,
                    run_id=1,
                    steps_completed=steps,
                    state=state,
                    storage_path="/elsewhere",
                    metadata_={"steps_completed": steps},
                    resources={"w.txt": 1},
                    size=1,
                    report_time=when,
                )
            )
            write(base / uuid / "w.txt", f"weights {steps}")
        ids = [t.id for t in trials]
    return exp_id, ids, uuids


@pytest.fixture
def sdk(det_env: Path) -> Any:
    client.logout()
    yield client
    client.logout()


def test_experiments_trials_and_metrics_read_as_determineds_objects(sdk: Any, tmp_path: Path) -> None:
    exp_id, (a, b), _ = _experiment(tmp_path)
    exp = sdk.get_experiment(exp_id)
    assert (exp.id, exp.name, exp.state) == (exp_id, "sdk", sdk.ExperimentState.ACTIVE)
    assert [t.id for t in exp.list_trials()][-2:] == [a, b]  # after the one create made
    assert [t.id for t in exp.iter_trials(order_by=sdk.OrderBy.DESCENDING, limit=2)] == [b, a]
    trial = sdk.get_trial(a)
    assert (trial.experiment_id, trial.hparams, trial.get_experiment().id) == (exp_id, {"lr": 0.1}, exp_id)
    val = list(trial.iter_metrics("validation"))
    assert [(m.steps_completed, m.metrics["loss"], m.group) for m in val][:3] == [
        (10, 0.5, "validation"),
        (20, 0.2, "validation"),
        (30, 0.9, "validation"),
    ]
    assert isinstance(val[0], sdk.TrialMetrics) and val[0].trial_id == a and val[0].end_time == T0.replace(tzinfo=None)
    assert [m.metrics["loss"] for m in trial.stream_training_metrics()][:1] == [1.0]
    both = list(sdk.iter_trials_metrics([a, b], "validation"))
    assert [m.trial_id for m in both] == [a] * 4 + [b]
    assert [e.id for e in sdk.list_experiments()] == [exp_id]
    assert sdk.list_experiments(labels=["nope"]) == []
    assert [e.id for e in sdk.list_experiments(states=[sdk.ExperimentState.ACTIVE])] == [exp_id]


def test_checkpoints_sort_select_and_download(sdk: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exp_id, (a, _), uuids = _experiment(tmp_path)
    exp = sdk.get_experiment(exp_id)
    # Best first by the searcher metric (smaller is better); the deleted one is never listed.
    assert [c.uuid for c in exp.list_checkpoints()] == [uuids[k] for k in ("a20", "b10", "a10", "a30")]
    assert exp.top_checkpoint().uuid == uuids["a20"]
    assert [c.uuid for c in exp.top_n_checkpoints(2, sort_by="acc", smaller_is_better=False)] == [
        uuids["a20"],
        uuids["b10"],
    ]
    by_step = exp.list_checkpoints(sort_by=sdk.CheckpointSortBy.BATCH_NUMBER, order_by=sdk.OrderBy.DESCENDING)
    assert [c.steps_completed for c in by_step] == [30, 20, 10, 10]
    with pytest.raises(ValueError, match="together"):
        exp.list_checkpoints(sort_by=sdk.CheckpointSortBy.UUID)
    trial = sdk.get_trial(a)
    assert trial.select_checkpoint(latest=True).uuid == uuids["a30"]
    assert trial.select_checkpoint(best=True).uuid == uuids["a20"]
    assert trial.select_checkpoint(best=True, sort_by="loss", smaller_is_better=False).uuid == uuids["a30"]
    with pytest.raises(ValueError, match="exactly one of latest, best or uuid"):
        trial.select_checkpoint(latest=True, best=True)
    ck = sdk.get_checkpoint(uuids["a20"])
    assert (ck.state, ck.metadata, ck.training.trial_id) == (sdk.CheckpointState.COMPLETED, {"steps_completed": 20}, a)
    assert ck.training.validation_metrics == {"avgMetrics": {"loss": 0.2, "acc": 0.8}}
    assert [m.steps_completed for m in ck.get_metrics("validation")] == [10, 20]
    monkeypatch.chdir(tmp_path)
    path = ck.download()
    assert path == str(Path("checkpoints") / uuids["a20"]) and (tmp_path / path / "w.txt").read_text() == "weights 20"
    deleted = sdk.get_checkpoint(uuids["a35"])
    with pytest.raises(DetSlurmError, match="only COMPLETED checkpoints can be downloaded"):
        deleted.download(tmp_path / "p")


def test_state_changes_go_through_the_controllers_operations(sdk: Any, tmp_path: Path) -> None:
    exp_id, (a, _), _ = _experiment(tmp_path)
    exp = sdk.get_experiment(exp_id)
    exp.pause()
    assert exp.state == sdk.ExperimentState.PAUSED
    exp.activate()
    exp.set_labels(["x", "y"])
    exp.remove_label("x")
    exp.set_description("tuned")
    assert (exp.state, exp.labels, exp.description) == (sdk.ExperimentState.ACTIVE, ["y"], "tuned")
    sdk.get_trial(a).kill()
    assert sdk.get_trial(a).state == sdk.TrialState.STOPPING_KILLED
    exp.kill()
    assert exp.state == sdk.ExperimentState.STOPPING_KILLED
    store = open_store(settings.load().db_url)
    with store.tx() as s:
        row = s.get(Experiment, exp_id)
        assert row is not None and row.state == ExperimentState.STOPPING_KILLED
        assert s.get(Trial, a).state == TrialState.STOPPING_KILLED  # type: ignore[union-attr]
        row.state = ExperimentState.CANCELED
    assert exp.wait(interval=0.01) == sdk.ExperimentState.CANCELED


def test_another_users_experiment_is_not_found(sdk: Any, tmp_path: Path) -> None:
    exp_id, (a, _), uuids = _experiment(tmp_path, owner="someone-else")
    for get, key in ((sdk.get_experiment, exp_id), (sdk.get_trial, a), (sdk.get_checkpoint, uuids["a20"])):
        with pytest.raises(NotFoundError):
            get(key)
    assert sdk.list_experiments() == []


def test_login_takes_a_store_url_and_refuses_a_masters_address(sdk: Any, tmp_path: Path) -> None:
    exp_id, _, _ = _experiment(tmp_path)
    with pytest.raises(DetSlurmError, match="detslurm has no master"):
        sdk.login(master="https://det.example.com:8080")
    sdk.login(master=settings.load().db_url, user="ignored", password="ignored")
    assert sdk.get_experiment(exp_id).id == exp_id
    assert sdk.Determined().get_experiment(exp_id).name == "sdk"
    empty = tmp_path / "other.db"
    sdk.login(master=f"sqlite:///{empty}")
    with pytest.raises(NotFoundError):
        sdk.get_experiment(exp_id)


def test_determined_scripts_reach_the_sdk_under_determineds_names() -> None:
    import determined.experimental as experimental
    from determined.experimental import client as det_client

    assert det_client is client
    assert experimental.Determined is client.Determined and experimental.Checkpoint is client.Checkpoint
    assert issubclass(experimental.ExperimentReference, experimental.Experiment)
    metrics = client.TrainingMetrics(total_batches=5, trial_id=1, trial_run_id=1, end_time=None, metrics={})
    assert (metrics.group, metrics.steps_completed, metrics.total_batches) == ("training", 5, 5)


def test_download_code_is_the_context_as_submitted(sdk: Any, tmp_path: Path) -> None:
    import tarfile

    from detslurm.protocol import ExpPaths

    exp_id, _, _ = _experiment(tmp_path)
    write(tmp_path / "ctx" / "train.py", "changed after create\n")
    path = sdk.get_experiment(exp_id).download_code(str(tmp_path / "out"))
    assert path == str(tmp_path / "out" / f"exp-{exp_id}_model_def.tar.gz")
    with tarfile.open(path) as tar:
        member = tar.extractfile("train.py")
        assert member is not None and member.read() == b"pass\n"
    # A link a trial put in the snapshot's place is not followed.
    with open_store(settings.load().db_url).read() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        snapshot = ExpPaths(Path(exp.exp_dir)).context
    snapshot.unlink()
    snapshot.symlink_to(write(tmp_path / "secret.txt", "not code"))
    with pytest.raises(NotFoundError, match="code snapshot"):
        sdk.get_experiment(exp_id).download_code(str(tmp_path / "out2"))
