"""The store reads the CLI uses (typed rows), and moving an experiment to another pool."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from detslurm import queue as q
from detslurm import views
from detslurm.controller import ops
from detslurm.errors import StateError
from detslurm.identity import Scope, os_user
from detslurm.slurm.parse import QueuedJob, experiment_tag, trial_comment
from detslurm.slurm.states import SlurmState
from detslurm.store import Experiment, Store, Trial, TrialRun, open_store
from detslurm.store.reads import Reads


def add_experiment(
    store: Store, exp_dir: Path, *, owner: str, state: str = "ACTIVE", executor: str = "slurm", archived: bool = False
) -> int:
    with store.tx() as s:
        e = Experiment(
            name=f"exp-{exp_dir.name}",
            owner=owner,
            config={"resources": {"resource_pool": "cpu"}, "searcher": {"metric": "loss"}},
            original_config="",
            context_sha256="0",
            exp_dir=str(exp_dir),
            executor=executor,
            resource_pool="cpu",
            progress=0.25,
            archived=archived,
            test_mode=False,
            state=state,
        )
        s.add(e)
        s.flush()
        return int(e.id)


def add_trial(store: Store, exp_id: int, run_dir: Path, run_state: str) -> int:
    with store.tx() as s:
        t = Trial(
            experiment_id=exp_id,
            request_id=str(run_dir.relative_to(run_dir.parents[3])),
            hparams={},
            seed=1,
            restarts=0,
            run_count=1,
            steps_completed=0,
            progress=0.0,
            early_stopped=False,
            searcher_ops=[],
            ops_completed=0,
            ops_closed=False,
            ops_idle=False,
        )
        s.add(t)
        s.flush()
        s.add(
            TrialRun(
                trial_id=t.id,
                run_id=1,
                state=run_state,
                executor="slurm",
                job_id=f"10{t.id}",
                run_dir=str(run_dir),
                log_path=str(run_dir / "out.log"),
            )
        )
        return int(t.id)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(f"sqlite:///{tmp_path / 'db.sqlite'}")


def test_experiment_rows_and_states(store: Store, tmp_path: Path) -> None:
    a = add_experiment(store, tmp_path / "a", owner="alice")
    b = add_experiment(store, tmp_path / "b", owner="bob", state="COMPLETED", executor="local", archived=True)
    add_trial(store, a, tmp_path / "a/run", "RUNNING")
    everyone = Scope(None)
    with store.read() as s:
        rows = views.experiment_rows(s, everyone)
        every = views.experiment_rows(s, everyone, include_archived=True)
        assert [r.id for r in rows] == [a]  # archived ones only on request
        assert [(r.id, r.owner, r.state, r.progress, r.resource_pool) for r in every] == [
            (a, "alice", "ACTIVE", 0.25, "cpu"),
            (b, "bob", "COMPLETED", 0.25, "cpu"),
        ]
        for reads in (Reads.on(s.connection()), Reads.open_sqlite(store.url)):
            assert reads is not None
            assert [d["id"] for d in reads.experiment_dicts(None, include_archived=True)] == [a, b]
            assert [d["id"] for d in reads.experiment_dicts("bob")] == []  # archived
            assert reads.has_unfinished("slurm", "alice") and not reads.has_unfinished("local", "bob")
            assert not reads.has_unfinished("slurm", "bob")  # alice's are not bob's to reconcile
        assert views.experiment_state(s, b, everyone).is_terminal
        first = views.first_trial(s, a, everyone)
        assert first.trial_id is not None and not first.done
        assert views.first_trial(s, b, everyone) == views.FirstTrial(None, None, True)
        snap = views.drive_snapshot(s, a, everyone)
        assert snap.busy and snap.trial_states == {first.trial_id: "ACTIVE"}
        assert views.active_job_ids(s, a, everyone) == [f"10{first.trial_id}"]


def queued(job_id: str, comment: str) -> QueuedJob:
    return QueuedJob(
        job_id=job_id,
        raw_id=int(job_id),
        array_job_id=int(job_id),
        array_task_id=None,
        state=SlurmState.RUNNING,
        state_text="RUNNING",
        partition="cpu",
        user="alice",
        priority=1,
        reason="None",
        nodelist="n1",
        num_nodes=1,
        num_cpus=1,
        gres="",
        submit_time="2026-01-01T00:00:00",
        start_time="2026-01-01T00:00:01",
        time_limit="UNLIMITED",
        nice=0,
        name="det-trial",
        comment=comment,
    )


def test_trial_job_names_only_for_this_stores_experiments(store: Store, tmp_path: Path) -> None:
    exp = add_experiment(store, tmp_path / "a", owner="alice")
    ours = queued("1", trial_comment(exp, 3, 1, tag=experiment_tag(str(tmp_path / "a"))))
    other_store = queued("2", trial_comment(exp, 3, 1, tag=experiment_tag("/elsewhere")))
    untagged = queued("3", trial_comment(exp, 3, 1))
    external = queued("4", "")
    jobs = [ours, other_store, untagged, external]
    reads = Reads.of_store(store)  # the ORM store's connection: the path a PostgreSQL store takes
    names = q.trial_job_names(jobs, reads.experiment_names({exp}, "alice"))
    assert q.trial_job_names([ours], reads.experiment_names({exp}, "bob")) == {}  # not shown to bob
    assert names == {"1": f"exp-a ({exp}) trial 3"}


def test_move_to_pool_rewrites_config_and_preempts_running_trials(store: Store, tmp_path: Path) -> None:
    exp_dir = tmp_path / "a"
    exp = add_experiment(store, exp_dir, owner=os_user())
    add_trial(store, exp, exp_dir / "trials/1/runs/1", "RUNNING")
    add_trial(store, exp, exp_dir / "trials/2/runs/1", "QUEUED")
    ops.move_to_pool(store, exp, "gpu", tag=experiment_tag(str(exp_dir)))
    with store.tx() as s:
        e = views.get_experiment(s, exp, Scope.mine())
        assert (e.resource_pool, e.config["resources"]["resource_pool"]) == ("gpu", "gpu")
    control = json.loads((exp_dir / "trials/1/runs/1/control.json").read_text())
    assert control["preempt"] is True and control["reason"] == "pool_move"
    assert not (exp_dir / "trials/2/runs/1/control.json").exists()  # a queued job moved partition in Slurm


def test_move_to_pool_refuses_another_stores_or_users_experiment(store: Store, tmp_path: Path) -> None:
    mine = add_experiment(store, tmp_path / "a", owner=os_user())
    add_trial(store, mine, tmp_path / "a/trials/1/runs/1", "RUNNING")
    with pytest.raises(StateError, match="submitted from another store"):
        ops.move_to_pool(store, mine, "gpu", tag=experiment_tag("/another/store/exp"))
    with pytest.raises(StateError, match="submitted from another store"):
        ops.move_to_pool(store, mine, "gpu", tag="")
    with pytest.raises(StateError, match="experiment 99 is not in your detslurm store"):
        ops.move_to_pool(store, 99, "gpu", tag=experiment_tag(str(tmp_path / "a")))
    # Another user's experiment is "not in your store" even for root, unless root asks for every user's.
    theirs = add_experiment(store, tmp_path / "b", owner="someone-else")
    with pytest.raises(StateError, match=f"experiment {theirs} is not in your detslurm store"):
        ops.move_to_pool(store, theirs, "gpu", tag=experiment_tag(str(tmp_path / "b")))
    with store.read() as s:
        assert views.get_experiment(s, mine, Scope.mine()).resource_pool == "cpu"
        assert views.get_experiment(s, theirs, Scope(None)).resource_pool == "cpu"
    ops.move_to_pool(store, theirs, "gpu", tag=experiment_tag(str(tmp_path / "b")), scope=Scope(None))
    with store.read() as s:
        assert views.get_experiment(s, theirs, Scope(None)).resource_pool == "gpu"
    assert not (tmp_path / "a/run/control.json").exists()


class Cancels:
    """What replace_queued_job asks of Slurm: scancel --state=PENDING, recorded (or refused)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail

    def __call__(self, jobs: object) -> None:
        self.calls.append(list(jobs))  # type: ignore[call-overload]
        if self.fail:
            raise StateError("slurmctld did not answer")


def test_a_trials_job_is_found_by_its_tag_in_the_callers_store(store: Store, tmp_path: Path) -> None:
    from detslurm.controller import queue_store

    exp = add_experiment(store, tmp_path / "a", owner=os_user())
    job = replace(queued("7", trial_comment(exp, 2, 1, tag=experiment_tag(str(tmp_path / "a")))), user=os_user())
    found = queue_store.trial_of(job, os_user(), store=store, scope=Scope.mine(), client=None)  # type: ignore[arg-type]
    assert found is not None and found.keeper == q.Keeper(exp, experiment_tag(str(tmp_path / "a")), "your store")
    stranger = replace(job, comment=trial_comment(exp, 2, 1, tag=experiment_tag("/elsewhere")))
    lost = queue_store.trial_of(stranger, os_user(), store=store, scope=Scope.mine(), client=None)  # type: ignore[arg-type]
    assert lost is not None and lost.keeper.missing.startswith(
        f"experiment {exp} of your store did not submit this job"
    )
    # Another user's trial: root must say --all-users before anything of theirs is changed.
    theirs = replace(job, user="bob")
    asked = queue_store.trial_of(theirs, os_user(), store=store, scope=Scope.mine(), client=None)  # type: ignore[arg-type]
    assert asked is not None and "takes det --all-users" in asked.keeper.missing
    assert (
        queue_store.trial_of(replace(job, comment=""), os_user(), store=store, scope=Scope.mine(), client=None) is None
    )  # type: ignore[arg-type]


def test_replacing_a_queued_job_moves_the_experiment_and_cancels_only_that_job(store: Store, tmp_path: Path) -> None:
    exp_dir = tmp_path / "a"
    exp = add_experiment(store, exp_dir, owner=os_user())
    t = add_trial(store, exp, exp_dir / "trials/1/runs/1", "QUEUED")
    tag = experiment_tag(str(exp_dir))
    cancels = Cancels()
    ops.replace_queued_job(store, exp, "gpu", f"10{t}", tag=tag, cancel_pending=cancels)
    assert cancels.calls == [[f"10{t}"]]
    with store.read() as s:
        e = views.get_experiment(s, exp, Scope.mine())
        assert e.resource_pool == "gpu" and e.trials[0].runs[0].exit_reason == "canceled by detslurm"


def test_a_replacement_slurm_did_not_take_leaves_everything_as_it_was(store: Store, tmp_path: Path) -> None:
    exp_dir = tmp_path / "a"
    exp = add_experiment(store, exp_dir, owner=os_user())
    t = add_trial(store, exp, exp_dir / "trials/1/runs/1", "QUEUED")
    tag = experiment_tag(str(exp_dir))
    with pytest.raises(StateError, match="did not answer"):
        ops.replace_queued_job(store, exp, "gpu", f"10{t}", tag=tag, cancel_pending=Cancels(fail=True))
    with pytest.raises(StateError, match="is not a queued run of experiment"):
        ops.replace_queued_job(store, exp, "gpu", "999", tag=tag, cancel_pending=Cancels())
    with store.read() as s:
        e = views.get_experiment(s, exp, Scope.mine())
        assert e.resource_pool == "cpu" and e.config["resources"]["resource_pool"] == "cpu"
        assert e.trials[0].runs[0].exit_reason is None


def test_controller_refuses_to_drive_another_users_experiment(store: Store, tmp_path: Path) -> None:
    from detslurm.controller.controller import Controller
    from detslurm.controller.local import LocalExecutor

    theirs = add_experiment(store, tmp_path / "theirs", owner="someone-else", executor="local")
    ctl = Controller(store, LocalExecutor(1))
    assert theirs not in ctl.active_experiment_ids()  # never ticked
    with pytest.raises(StateError, match="belongs to someone-else"):
        ctl.tick_experiment(theirs)  # nor driven when asked by id


def test_job_names_are_the_scopes_own(store: Store, tmp_path: Path) -> None:
    exp = add_experiment(store, tmp_path / "a", owner="alice")
    detached = add_experiment(store, tmp_path / "d", owner="alice", executor="detached")
    with store.tx() as s:
        t = Trial(experiment_id=detached, request_id="d", hparams={}, seed=1)
        s.add(t)
        s.flush()
        for run_id in (1, 2):  # a requeued job: its latest run names it
            s.add(TrialRun(trial_id=t.id, run_id=run_id, executor="detached", run_dir="-", log_path="-", job_id="9"))
        tid = t.id
    jobs = [
        queued("1", trial_comment(exp, 3, 1, tag=experiment_tag(str(tmp_path / "a")))),
        queued("2", trial_comment(exp, 3, 1, tag=experiment_tag("/elsewhere"))),  # another store's experiment
        queued("4", ""),
        queued("9", ""),
    ]
    reads = Reads.open_sqlite(store.url)
    assert reads is not None
    wanted = {j.identity[0] for j in jobs if j.identity}
    for owner in ("alice", "bob", None):
        names = q.trial_job_names(jobs, reads.experiment_names(wanted, owner))
        detached_names = q.detached_job_names(reads.detached_runs([j.job_id for j in jobs], owner))
        if owner == "bob":  # another user's experiment names are not shown
            assert names == {} and detached_names == {}
        else:
            assert list(names) == ["1"] and "exp-a" in names["1"] and "trial 3" in names["1"]
            assert list(detached_names) == ["9"] and f"trial {tid}" in detached_names["9"]
    reads.close()
