"""The SDK's create_experiment, Experiment.set_notes and Experiment.delete_tensorboard_files, the
store migration that keeps notes, and the request/answer exchange the SDK uses over ssh://
(its real transport is tested against sshd in tests/local/test_remote_sdk.py)."""

from __future__ import annotations

import json
import os
import sys
import tarfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, write
from determined_oracle import SCRIPT_RECORD, oracle_python, record_script
from test_create import Slurm

from detslurm import client, settings
from detslurm.client import _remote
from detslurm.client._session import Session
from detslurm.controller.create import execute_create, plan_create
from detslurm.errors import ConfigError, DetSlurmError, NotFoundError, StateError
from detslurm.identity import Scope
from detslurm.protocol import ExpPaths
from detslurm.slurm.client import Result
from detslurm.slurm.parse import REC_END, SEP, SQUEUE_FIELDS
from detslurm.store import Trial, open_store
from detslurm.store.models import Experiment, TrialRun

CORE = EXAMPLES / "core_api"
CONFIG = "name: sdk-made\nentrypoint: python3 train.py\nsearcher: {name: single, metric: loss, max_length: 1}\n"


class QueuedSlurm(Slurm):
    """The fake Slurm whose queue holds every job submitted, PENDING, until it is canceled (a
    read's tick then finds it queued, not lost)."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[str] = []

    def answer(self, argv: list[str], input: str | None) -> Result:
        got = super().answer(argv, input)
        if argv[:2] == ["sbatch", "--parsable"]:
            self.pending.append(got.stdout.strip())
        elif argv[0] == "scancel" and not self.scancel:
            self.pending = [j for j in self.pending if j not in argv]
        elif argv[0] == "squeue":
            return Result(0, "".join(_pending_record(j) for j in self.pending), "")
        return got


def _pending_record(job: str) -> str:
    fields = dict.fromkeys(SQUEUE_FIELDS, "")
    fields.update({"JobArrayID": job, "JobID": job, "State": "PENDING", "Reason": "Resources", "NumNodes": "1"})
    fields.update({"NumCPUs": "1", "RestartCnt": "0"})
    return SEP.join(fields[k] for k in SQUEUE_FIELDS) + REC_END


@pytest.fixture
def sdk(det_env: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The SDK on a private store, with a fake Slurm behind it and no daemon started."""
    from detslurm import daemon
    from detslurm.slurm import client as slurm_client

    fake = QueuedSlurm()
    monkeypatch.setattr(slurm_client, "client_from_env", lambda *_, **__: slurm_client.SlurmClient(fake, user="alice"))
    started: list[object] = []
    monkeypatch.setattr(daemon, "start", lambda st: started.append(st) or 0)
    client.logout()
    yield client, fake, started
    client.logout()


def _code_names(exp: Any, tmp_path: Path) -> set[str]:
    with tarfile.open(exp.download_code(str(tmp_path / "code"))) as tar:
        return {Path(n).name for n in tar.getnames()}


def test_create_experiment_is_det_e_create_on_slurm(sdk: Any, tmp_path: Path) -> None:
    sdk_client, fake, started = sdk
    ctx = write(tmp_path / "model" / "train.py", "print('hi')\n").parent
    extra = write(tmp_path / "shared" / "util.py", "X = 1\n")
    config = {"name": "from-a-dict", "entrypoint": "python3 train.py", "hyperparameters": {"lr": 0.1}}
    config["searcher"] = {"name": "single", "metric": "loss", "max_length": 1}
    exp = sdk_client.create_experiment(config, str(ctx), includes=[extra])
    assert isinstance(exp, sdk_client.Experiment) and exp.name == "from-a-dict"
    assert exp.state == sdk_client.ExperimentState.ACTIVE and exp.config["hyperparameters"]["lr"]["val"] == 0.1
    # Checked by sbatch --test-only, then its first job queued, before create_experiment returns;
    # the daemon is then started to carry it on.
    assert (fake.count("sbatch", "--test-only"), fake.count("sbatch", "--parsable")) == (1, 1)
    assert len(started) == 1
    assert {"train.py", "util.py"} <= _code_names(exp, tmp_path)
    # A YAML file's path, and no model_dir (Determined sends no model definition then).
    again = client.Determined().create_experiment(write(tmp_path / "c.yaml", CONFIG))
    assert (again.id, again.name) == (exp.id + 1, "sdk-made")
    assert _code_names(again, tmp_path / "2") <= {"", "."}


def test_create_experiment_refuses_what_it_cannot_do(sdk: Any, tmp_path: Path) -> None:
    sdk_client, fake, _ = sdk
    with pytest.raises(ValueError, match="no projects"):
        sdk_client.create_experiment(write(tmp_path / "c.yaml", CONFIG), project_id=1)
    with pytest.raises(ValueError, match="template 'base'"):
        sdk_client.create_experiment(write(tmp_path / "c.yaml", CONFIG), template="base")
    with pytest.raises(ValueError, match="config must be a dict or the path"):
        sdk_client.create_experiment(42)
    with pytest.raises(ConfigError, match="searcher"):
        sdk_client.create_experiment({"name": "x", "entrypoint": "python3 t.py", "searcher": {"name": "nope"}})
    # Nothing was created or submitted by any of them.
    assert fake.count("sbatch", "--parsable") == 0 and sdk_client.list_experiments() == []


ORACLE_CREATE = (
    SCRIPT_RECORD
    + r"""
import inspect, json, sys
from determined.experimental import client
d = object.__new__(client.Determined)  # no master: the call fails before any request
attempt("int_config", lambda: d.create_experiment(42))
sig = inspect.signature(client.create_experiment)
attempt("defaults", lambda: [[p.name, "required" if p.default is p.empty else p.default] for p in sig.parameters.values()])
json.dump(out, open(sys.argv[1], "w"))
"""
)


def test_create_experiment_refuses_a_config_that_is_no_dict_or_path_as_determined_does(tmp_path: Path) -> None:
    theirs = record_script(oracle_python(), ORACLE_CREATE, tmp_path / "determined")
    ours = record_script(sys.executable, ORACLE_CREATE, tmp_path / "detslurm", dict(os.environ))
    assert theirs["int_config"] == "raised ValueError" and ours == theirs


def _experiment(tmp_path: Path, owner: str | None = None) -> int:
    st = settings.load()
    ctx = write(tmp_path / "ctx" / "train.py", "pass\n").parent
    exp_id = execute_create(
        open_store(st.db_url), st, plan_create(st, write(tmp_path / "c.yaml", CONFIG), ctx), "slurm"
    )
    if owner is not None:
        with open_store(st.db_url).tx() as s:
            row = s.get(Experiment, exp_id)
            assert row is not None
            row.owner = owner
    return exp_id


def test_notes_are_kept_and_shown_by_describe(sdk: Any, det: Any, tmp_path: Path) -> None:
    sdk_client = sdk[0]
    exp_id = _experiment(tmp_path)
    exp = sdk_client.get_experiment(exp_id)
    assert exp.notes is None
    exp.set_notes("lr sweep\nsecond line")
    assert exp.notes == "lr sweep\nsecond line"
    assert sdk_client.get_experiment(exp_id).notes == "lr sweep\nsecond line"
    code, out, err = det("e", "describe", str(exp_id))
    assert code == 0, err
    assert "Notes:\nlr sweep\nsecond line\n" in out
    code, out, _ = det("e", "describe", str(exp_id), "--json")
    assert json.loads(out)[0]["experiment"]["notes"] == "lr sweep\nsecond line"
    with pytest.raises(TypeError, match="str"):
        exp.set_notes(3)
    other = _experiment(tmp_path / "b", owner="someone-else")
    with pytest.raises(NotFoundError):
        Session().set_notes(other, "mine now")


def test_a_store_of_the_previous_revision_upgrades_and_keeps_its_rows(tmp_path: Path) -> None:
    from alembic import command
    from sqlalchemy import create_engine, text

    from detslurm.store import db

    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    engine = create_engine(url)
    with engine.begin() as conn:
        cfg = db._alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0003_preempt2")
        cols = [r[1] for r in conn.execute(text("PRAGMA table_info('experiments')"))]
        assert "notes" not in cols
        conn.execute(
            text(
                "INSERT INTO experiments (name, owner, state, config, original_config, context_sha256, exp_dir, "
                "executor, resource_pool, progress, archived, test_mode, start_time) VALUES ('old', :me, 'ACTIVE', "
                "'{}', '', '0', '/nowhere', 'local', '', 0, 0, 0, '2026-01-01 00:00:00')"
            ),
            {"me": Scope.mine().owner},
        )
    engine.dispose()
    session = Session(url)
    info, _ = session.reads.experiment(1, session.owner)  # the store is upgraded on first open
    assert (info["name"], info["notes"]) == ("old", None)
    session.set_notes(1, "kept")
    assert Session(url).reads.experiment(1, session.owner)[0]["notes"] == "kept"


def test_delete_tensorboard_files_removes_only_the_trials_tensorboard_dirs(sdk: Any, tmp_path: Path) -> None:
    sdk_client = sdk[0]
    exp_id = _experiment(tmp_path)
    st = settings.load()
    store = open_store(st.db_url)
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        paths = ExpPaths(Path(exp.exp_dir))
        trials = [Trial(experiment_id=exp_id, request_id=f"r{i}", hparams={}, seed=1) for i in range(3)]
        s.add_all(trials)
        s.flush()
        ids = [t.id for t in trials]
        for t in ids:
            rd = paths.run_dir(t, 1)
            s.add(TrialRun(trial_id=t, run_id=1, executor="slurm", run_dir=str(rd), log_path=str(rd / "out")))
    a, b, c = ids
    events = write(paths.trial_tensorboard(a) / "events.out.tfevents.1", "e")
    chief = write(paths.run(a, 1).tensorboard / "rank-0" / "events.out.tfevents.2", "e")
    kept = [write(paths.trial_metadata(a), "{}"), write(paths.run(a, 1).output_log, "log")]
    # Trial b put a link where its tensorboard dir goes; trial c made its whole dir a link.
    victim = write(tmp_path / "victim" / "tensorboard" / "precious", "keep me").parent
    paths.trial_dir(b).mkdir(parents=True)
    paths.trial_tensorboard(b).symlink_to(victim)
    paths.trial_dir(c).parent.mkdir(parents=True, exist_ok=True)
    paths.trial_dir(c).symlink_to(victim.parent)

    sdk_client.get_experiment(exp_id).delete_tensorboard_files()

    assert not events.exists() and not paths.trial_tensorboard(a).exists()
    assert not chief.exists() and not paths.run(a, 1).tensorboard.exists()
    assert all(p.read_text() for p in kept)
    # The links went (b's) or stayed unfollowed (c's dir): what they name is untouched.
    assert not os.path.lexists(paths.trial_tensorboard(b))
    assert (victim / "precious").read_text() == "keep me"
    # An experiment of another user is not found, and its files stay.
    other = _experiment(tmp_path / "o", owner="someone-else")
    with pytest.raises(NotFoundError):
        Session().delete_tensorboard_files(other)


# -- the exchange over ssh:// (the login node's side runs on this store) --------------------------
def _ask(call: str, *args: Any) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads(_remote.serve(json.dumps({"call": call, "args": list(args)}), Session()))
    return answer


def test_requests_run_with_the_login_nodes_own_scope(det_env: Path, tmp_path: Path) -> None:
    mine, theirs = _experiment(tmp_path), _experiment(tmp_path / "b", owner="someone-else")
    got = _remote.decode(_ask("reads.experiment", mine)["ok"])
    assert got[0]["id"] == mine and got[0]["state"] == "ACTIVE" and isinstance(got[0]["start_time"], datetime)
    # Another user's experiment is "not found", and an owner smuggled in is no parameter.
    assert _ask("reads.experiment", theirs) == {"error": "not_found", "kind": "experiment", "ident": theirs}
    assert _ask("reads.experiment", theirs, None)["error"] == "type"
    assert [d["id"] for d, _ in _remote.decode(_ask("reads.experiments", True)["ok"])] == [mine]
    # Changes are the session's methods; anything else is refused by name.
    assert _ask("change_state", "pause", mine) == {"ok": None}
    assert _remote.decode(_ask("reads.experiment", mine)["ok"])[0]["state"] == "PAUSED"
    assert _ask("change_state", "explode", mine)["error"] == "value"
    assert _ask("store.tx")["error"] == "detslurm" and _ask("__class__")["error"] == "detslurm"
    assert _remote.serve("not json", Session()).startswith('{"error": "value"')


def test_answers_raise_the_errors_the_login_node_raised() -> None:
    when = datetime(2026, 1, 2, 3, 4, tzinfo=timezone.utc)
    assert _remote.decode(json.loads(json.dumps(_remote.encode({"t": (when, 1)})))) == {"t": [when, 1]}
    cases = [NotFoundError("trial", 7), StateError("not now"), ConfigError(["a: b"]), ValueError("v"), TypeError("t")]
    for e in cases:
        with pytest.raises(type(e)) as raised:
            _remote.raise_error(json.loads(json.dumps(_remote.error_answer(e))))
        assert str(raised.value) == str(e)
    with pytest.raises(DetSlurmError, match="x"):
        _remote.raise_error({"error": "detslurm", "message": "x"})


def test_the_login_node_creates_from_the_uploaded_code_and_names_its_snapshot(sdk: Any, tmp_path: Path) -> None:
    """What RemoteSession.create_experiment and download_code ask after their uploads and
    before their SFTP copies (the whole path runs against sshd in tests/local/test_remote_sdk.py)."""
    _, fake, started = sdk
    tree = write(tmp_path / "tree" / "train.py", "pass\n").parent
    exp_id = _ask("create_experiment", str(write(tmp_path / "c.yaml", CONFIG)), str(tree), [])["ok"]
    assert fake.count("sbatch", "--parsable") == 1 and len(started) == 1
    snapshot = Path(_ask("code_snapshot", exp_id)["ok"])
    with tarfile.open(snapshot) as tar:
        assert "train.py" in {Path(n).name for n in tar.getnames()}
    # A link in the snapshot's place (the experiment dir is the trials' to write) is not named.
    snapshot.rename(snapshot.with_name("moved"))
    snapshot.symlink_to(snapshot.with_name("moved"))
    assert _ask("code_snapshot", exp_id)["error"] == "not_found"
