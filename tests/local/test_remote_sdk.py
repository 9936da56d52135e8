"""The Python SDK over ssh:// (``client.login(master="ssh://...")``) against a real OpenSSH server
on loopback (tests/sshd_harness.py): the login node's store is read and changed there as the
ssh user, checkpoints come back over SFTP. Experiments use the local executor on the "login
node", as in test_remote_ssh.py: what is tested is the SDK's path over SSH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
import sshd_harness as sh
import yaml
from conftest import write
from test_remote_ssh import (
    _chatty_context,
    _context,
    _laptop_det,
    _wait_for_output,
    hold,
    laptop,
    on_the_cluster,
    servers,
)

from detslurm import client
from detslurm.client._remote import RemoteSession
from detslurm.download_dir import DestinationExists
from detslurm.errors import ConfigError, DetSlurmError, NotFoundError

pytest.importorskip("paramiko")
pytestmark = pytest.mark.heavy  # the remote venv's build, as test_remote_ssh.py

__all__ = ["hold", "laptop", "servers"]  # the fixtures, shared with test_remote_ssh.py

URL = "ssh://direct"


@pytest.fixture
def sdk(laptop: Path) -> Any:
    client.logout()
    yield client
    client.logout()


def _described(det: Any, exp_id: int) -> dict[str, Any]:
    code, out, err = det("-m", URL, "e", "describe", str(exp_id), "--json")
    assert code == 0, err
    found: dict[str, Any] = json.loads(out)[0]["experiment"]
    return found


def test_reads_edits_logs_and_download_over_ssh(
    det: Any,
    sdk: Any,
    servers: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    ctx = _context(tmp_path)
    code, out, err = det(
        "-m", URL, "e", "create", "--local", ctx / "const.yaml", ctx, "--config", "hyperparameters.sleep=0"
    )
    assert code == 0 and "Experiment 1 COMPLETED" in out, err
    logins = servers["login"].log.count("Accepted publickey")

    sdk.login(master=URL)
    exp = sdk.get_experiment(1)
    assert (exp.id, exp.state) == (1, sdk.ExperimentState.COMPLETED)
    assert exp.wait(interval=0.1) == sdk.ExperimentState.COMPLETED
    assert [e.id for e in sdk.list_experiments()] == [1]
    (trial,) = exp.list_trials()
    assert trial.state == sdk.TrialState.COMPLETED and trial.get_experiment().name == exp.name
    training = list(trial.iter_metrics("training"))
    assert training and training[-1].steps_completed == 40 and training[-1].end_time is not None
    assert any("done: w=" in line for line in trial.iter_logs(tail=20))
    with pytest.raises(NotFoundError, match="experiment 99 not found"):
        sdk.get_experiment(99)

    # Changes land in the login node's store: `det -m` reads them back there.
    exp.set_notes("seen from the laptop")
    exp.add_label("remote")
    assert exp.notes == "seen from the laptop" and exp.labels == ["remote"]
    remote = _described(det, 1)
    assert (remote["notes"], remote["labels"]) == ("seen from the laptop", ["remote"])

    best = exp.top_checkpoint()
    best.add_metadata({"by": "sdk"})
    assert sdk.get_checkpoint(best.uuid).metadata["by"] == "sdk"
    monkeypatch.chdir(tmp_path)
    path = Path(best.download())  # ./checkpoints/<uuid>, copied over SFTP
    assert path == Path("checkpoints") / best.uuid
    assert json.loads((path / "metadata.json").read_text())["steps_completed"] == best.steps_completed
    with pytest.raises(DestinationExists):
        best.download(str(path))  # a download never writes into one made before
    # The code as submitted, copied over SFTP from the login node's experiment dir.
    code_tar = Path(exp.download_code(str(tmp_path / "code")))
    assert code_tar == tmp_path / "code" / "exp-1_model_def.tar.gz"
    with tarfile.open(code_tar) as tar:
        assert {"train.py", "const.yaml"} <= {Path(n).name for n in tar.getnames()}
    # One SSH login for the SDK's whole session (every call and SFTP copy is a channel of one
    # connection), and one for the `det -m ... e describe` above.
    assert servers["login"].log.count("Accepted publickey") == logins + 2


def test_pause_activate_kill_and_wait_over_ssh(det: Any, sdk: Any, laptop: Path, tmp_path: Path, hold: Path) -> None:
    ctx = _chatty_context(tmp_path)
    args = ["e", "create", "--local", str(ctx / "const.yaml"), str(ctx), "--config", f"hyperparameters.hold={hold}"]
    create = _laptop_det(laptop, "-m", URL, *args)
    waiter = None
    try:
        _wait_for_output(det, URL, 1, "batch 1")
        exp = client.Determined(master=URL).get_experiment(1)
        assert exp.state == client.ExperimentState.ACTIVE
        exp.pause()
        assert exp.state == client.ExperimentState.PAUSED
        stdout, stderr = create.communicate(timeout=90)  # the driver on the login node saw it
        assert "Experiment 1 PAUSED" in stdout, stderr
        exp.activate()
        assert exp.state == client.ExperimentState.ACTIVE and _described(det, 1)["state"] == "ACTIVE"
        exp.kill()
        assert _described(det, 1)["state"] in ("STOPPING_KILLED", "CANCELED")
        # A local experiment is driven by a `det` on the login node: `det e wait` there ends it
        # while the SDK waits for it from here.
        waiter = _laptop_det(laptop, "-m", URL, "e", "wait", "1")
        started = time.monotonic()
        assert exp.wait(interval=0.2) == client.ExperimentState.CANCELED
        assert time.monotonic() - started < 300
        assert _described(det, 1)["state"] == "CANCELED"
    finally:
        for p in (create, waiter):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.communicate()


GRID = """name: grid
entrypoint: python3 train.py
hyperparameters: {lr: {type: categorical, vals: [0.1, 0.2]}, noise: 0.1, sleep: 0}
searcher: {name: grid, metric: validation_loss, smaller_is_better: true}
"""


def test_a_listing_is_one_call_over_ssh_whatever_its_length(
    det: Any,
    sdk: Any,
    servers: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    ctx = _context(tmp_path)
    write(ctx / "grid.yaml", GRID)
    # Every checkpoint kept: 8 a trial (one each 5 of its 40 batches), in the ssh user's home.
    where = Path(servers["user"].pw_dir) / f"ckpts-{tmp_path.name}"
    request.addfinalizer(lambda: shutil.rmtree(where, ignore_errors=True))
    keep = f"checkpoint_storage={{type: shared_fs, host_path: {where}, save_trial_latest: 8}}"
    for config in ("grid.yaml", "const.yaml"):
        code, out, err = det("-m", URL, "e", "create", "--local", ctx / config, ctx, "--config", keep)
        assert code == 0 and "COMPLETED" in out, err
    calls: list[str] = []
    real = RemoteSession._call
    monkeypatch.setattr(RemoteSession, "_call", lambda self, name, *args: calls.append(name) or real(self, name, *args))
    sdk.login(master=URL)  # after the count starts: the session's reads hold its _call

    def one_call(listing: Any) -> Any:
        calls.clear()
        got = listing()
        assert len(calls) == 1, calls
        return got

    grid, const = one_call(sdk.list_experiments)
    assert (grid.name, const.name) == ("grid", "core-api-const") and grid.config["searcher"]["name"] == "grid"
    trials = one_call(grid.list_trials)
    assert sorted(t.hparams["lr"] for t in trials) == [0.1, 0.2] and trials[1].steps_completed == 40
    # Two trials of 8 checkpoints each, best first by validation_loss.
    best = one_call(grid.list_checkpoints)
    assert len(best) == 16 and [c.searcher_metric for c in best] == sorted(c.searcher_metric for c in best)
    by_metric = one_call(lambda: grid.list_checkpoints(sort_by="batches", order_by=client.CheckpointOrderBy.DESC))
    assert [c.steps_completed for c in by_metric[:2]] == [40, 40]
    assert len(one_call(trials[0].list_checkpoints)) == 8
    latest = one_call(lambda: trials[1].select_checkpoint(latest=True))
    assert (latest.trial_id, latest.steps_completed) == (trials[1].id, 40)
    top = one_call(trials[0].top_checkpoint)
    # Built from the listing's rows, each is what a read of its own gives.
    fresh = sdk.get_checkpoint(top.uuid)
    assert (top.metadata, top.state, top.report_time) == (fresh.metadata, fresh.state, fresh.report_time)


def test_create_experiment_over_ssh_uploads_the_code_and_creates_on_the_login_node(
    det: Any, sdk: Any, servers: dict[str, Any], tmp_path: Path
) -> None:
    """Without Slurm on this login node the create stops at the login node's Slurm check, after
    the upload: what `det -m ... e create` would say there (the test on the cluster goes on)."""
    ctx = _context(tmp_path)
    extra = write(tmp_path / "shared" / "helpers.py", "X = 1\n")
    sdk.login(master=URL)
    config = {"name": "sdk-remote", "entrypoint": "python3 train.py", "searcher": {"name": "single", "metric": "x"}}
    with pytest.raises(DetSlurmError, match="no Slurm cluster is configured on this machine"):
        sdk.create_experiment(config, str(ctx), [extra])
    cache = Path(servers["user"].pw_dir) / ".cache/detslurm/contexts"
    (tree,) = [p for p in (cache / "trees").iterdir() if p.is_dir()]
    assert {"train.py", "const.yaml", "helpers.py"} <= {p.name for p in tree.iterdir()}
    (uploaded,) = (cache / "configs").iterdir()
    assert yaml.safe_load(uploaded.read_text())["name"] == "sdk-remote"
    # A bad config is the login node's ConfigError, raised here as one.
    with pytest.raises(ConfigError, match="searcher"):
        sdk.create_experiment({"name": "x", "entrypoint": "python3 train.py"}, str(ctx))
    assert sdk.list_experiments() == []


def _squeue(slurm_cluster: Path, *args: str) -> str:
    env = dict(os.environ, SLURM_CONF=str(slurm_cluster / "etc/slurm.conf"))
    return subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, check=True, env=env).stdout


@pytest.mark.slurm
def test_on_the_slurm_test_cluster_create_and_kill_over_ssh_end_the_job_at_once(
    det: Any, sdk: Any, laptop: Path, slurm_cluster: Path, tmp_path: Path, hold: Path
) -> None:
    """create_experiment over ssh:// submits the laptop's code on the cluster; kill() cancels
    its running job at once, with no daemon left to do it at a tick (as `det e kill`)."""
    on_the_cluster(slurm_cluster)
    ctx = _chatty_context(tmp_path)
    config = yaml.safe_load((ctx / "const.yaml").read_text())
    config["hyperparameters"].update(sleep=0.2, hold=str(hold))  # it waits at batch 3 while hold exists
    try:
        sdk.login(master=URL)
        exp = sdk.create_experiment(config, str(ctx))
        assert (exp.name, exp.state) == ("core-api-const", sdk.ExperimentState.ACTIVE)
        deadline = time.time() + 120
        while not (running := _squeue(slurm_cluster, "-u", sh.USER, "--states=RUNNING", "-o", "%i").split()):
            assert time.time() < deadline, "the experiment's job never started"
            time.sleep(0.5)
        (job,) = running
        # No daemon from here on: what happens at once is the SDK's own doing.
        assert det("-m", URL, "daemon", "stop")[0] == 0
        started = time.monotonic()
        exp.kill()
        assert exp.state == sdk.ExperimentState.STOPPING_KILLED
        while _squeue(slurm_cluster, "--states=all", "-j", job, "-o", "%T").strip() in ("RUNNING", "COMPLETING"):
            assert time.monotonic() - started < 10, "the killed job still runs"
            time.sleep(0.2)
        assert _squeue(slurm_cluster, "--states=all", "-j", job, "-o", "%T").strip() in ("CANCELLED", "")
    finally:
        det("-m", URL, "daemon", "stop")
        env = dict(os.environ, SLURM_CONF=str(slurm_cluster / "etc/slurm.conf"))
        subprocess.run(["scancel", "-u", sh.USER], check=False, env=env)
