"""The Python SDK over ssh:// (``client.login(master="ssh://...")``) against a real OpenSSH server
on loopback (tests/sshd_harness.py): the login node's store is read and changed there as the
ssh user, checkpoints come back over SFTP. Experiments use the local executor on the "login
node", as in test_remote_ssh.py: what is tested is the SDK's path over SSH."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_remote_ssh import _chatty_context, _context, _laptop_det, _wait_for_output, hold, laptop, servers

from detslurm import client
from detslurm.download_dir import DestinationExists
from detslurm.errors import NotFoundError

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
    det: Any, sdk: Any, servers: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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
    # One SSH login for the SDK's whole session (every call is a channel of one connection),
    # and one for the `det -m ... e describe` above.
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
