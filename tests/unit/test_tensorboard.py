"""TensorBoard: the event files the controller writes, read back with TensorBoard's own reader;
the Core API's get_tensorboard_path()/upload_tensorboard_files(); `det tensorboard start`."""

from __future__ import annotations

import http.client
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
from conftest import EXAMPLES, ROOT

from detslurm import settings, tbevents
from detslurm.core._events import NullWriter
from detslurm.core._train import TrainContext
from detslurm.protocol import ExpPaths, RunPaths
from detslurm.store import Experiment, Metric, MetricPoint, open_store

CORE = EXAMPLES / "core_api"


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``directory``'s event files, as TensorBoard itself reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_crc32c_is_castagnoli() -> None:
    # The standard check value of CRC-32C (iSCSI), which TFRecord framing uses.
    assert tbevents.crc32c(b"123456789") == 0xE3069283
    assert tbevents.crc32c_tables(b"123456789") == 0xE3069283


def test_the_python_crc_equals_google_crc32c_s() -> None:
    # The Python tables serve where google-crc32c has no C code (no wheel for ppc64le); they must
    # frame the same records, at every length and alignment of the 4-byte steps.
    rng = random.Random(3)
    for n in [*range(70), 1000, 4097, 65536]:
        data = rng.randbytes(n)
        assert tbevents.crc32c_tables(data) == google_crc32c.value(data) == tbevents.crc32c(data), n


def test_event_files_read_back_with_tensorboard(tmp_path: Path) -> None:
    d = tmp_path / "tb"
    assert tbevents.append(d, "training", 10, 1000.0, {"loss": 0.5, "lr": 1e-3, "name": "x", "flag": True}) == 2
    tbevents.append(d, "training", 20, 1001.0, {"loss": 0.25})
    tbevents.append(d, "validation", 20, 1002.0, {"loss": 0.3, "val_acc": 0.9, "bad": float("inf")})
    tbevents.append(d, "inference", 20, 1003.0, {"latency": 7})
    assert len(list(d.glob("events.out.tfevents.*"))) == 1  # appended to one file
    got = scalars(d)
    assert got["loss"] == [(10, 0.5), (20, 0.25)]
    assert got["lr"] == [(10, pytest.approx(1e-3))]
    # Determined's names: validation metrics get a val_ prefix unless they have one.
    assert got["val_loss"] == [(20, pytest.approx(0.3))] and got["val_acc"] == [(20, pytest.approx(0.9))]
    assert got["inference/latency"] == [(20, 7.0)]
    assert set(got) == {"loss", "lr", "val_loss", "val_acc", "inference/latency"}


def test_a_write_the_disk_cuts_short_leaves_only_whole_records(tmp_path: Path) -> None:
    """A record cut short by a full disk or a quota would make every later record unreadable:
    the append fails and the file keeps its whole records; later appends read back."""
    d = tmp_path / "tb"
    tbevents.append(d, "training", 1, 1000.0, {"loss": 1.0})
    size = tbevents.event_file(d).stat().st_size
    records = b"".join(tbevents.report_record("training", s, 1000.0, {"loss": 0.5, "acc": 0.9}) for s in (2, 3))
    pid = os.fork()
    if pid == 0:  # the child: a file size limit (what a nearly full disk does to the write)
        code = 3
        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (size + 20, resource.RLIM_INFINITY))
            tbevents.append_records(d, records, 1000.0)
            code = 0
        except OSError:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1  # the append failed, as it should
    assert tbevents.event_file(d).stat().st_size == size  # and left no half record
    tbevents.append(d, "training", 4, 1000.0, {"loss": 0.25})
    assert scalars(d)["loss"] == [(1, 1.0), (4, 0.25)]


@pytest.mark.parametrize("planted", ["fifo", "file-link", "dir-link"])
def test_appends_never_block_on_or_follow_what_a_trial_planted(tmp_path: Path, planted: str) -> None:
    """The trial owns its run's files: a FIFO at the event file's name fails the append (the
    daemon would wait for a reader), and a symlink, at the file or at its dir, is not followed."""
    d = tmp_path / "tb"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_bytes(b"precious")
    if planted == "dir-link":
        d.symlink_to(victim)
    else:
        d.mkdir()
        if planted == "fifo":
            os.mkfifo(tbevents.event_file(d))
        else:
            tbevents.event_file(d).symlink_to(victim / "precious")
    done: list[BaseException | None] = []

    def append() -> None:
        try:
            tbevents.append(d, "training", 1, 1000.0, {"loss": 1.0})
            done.append(None)
        except OSError as e:
            done.append(e)

    t = threading.Thread(target=append, daemon=True)
    t.start()
    t.join(10)
    assert done and isinstance(done[0], OSError), "the append must fail, not block or succeed"
    assert (victim / "precious").read_bytes() == b"precious" and os.listdir(victim) == ["precious"]


def test_core_api_uploads_selected_files_where_det_tensorboard_looks(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "exp", 3, 1)
    train = TrainContext(NullWriter(), 1, paths, rank=1)
    src = train.get_tensorboard_path()
    assert src == paths.tensorboard / "rank-1" and src.is_dir()
    (src / "sub").mkdir()
    (src / "events.out.tfevents.1.host").write_bytes(b"abc")
    (src / "sub" / "keep.pb").write_bytes(b"x")
    (src / "skip.tmp").write_bytes(b"y")
    train.upload_tensorboard_files(selector=lambda p: p.suffix != ".tmp", mangler=lambda p, rank: Path(f"r{rank}") / p)
    dst = ExpPaths(tmp_path / "exp").trial_tensorboard(3)
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()) == [
        "r1/events.out.tfevents.1.host",
        "r1/sub/keep.pb",
    ]
    # Event files grow: only the new bytes are copied, and the copy matches.
    with (src / "events.out.tfevents.1.host").open("ab") as f:
        f.write(b"def")
    train.upload_tensorboard_files(mangler=lambda p, rank: Path(f"r{rank}") / p)
    assert (dst / "r1/events.out.tfevents.1.host").read_bytes() == b"abcdef"
    with pytest.raises(ValueError, match="leaves the trial's dir"):
        train.upload_tensorboard_files(mangler=lambda p, rank: Path("..") / p)
    # AUTO mode (the chief): files written since the last upload go up when the context closes.
    auto = TrainContext(NullWriter(), 1, RunPaths(tmp_path / "exp", 4, 1), rank=0, tb_auto=True)
    auto.final_tensorboard_upload()  # nothing asked for the path yet: nothing to do, no dir made
    assert not ExpPaths(tmp_path / "exp").trial_tensorboard(4).exists()
    (auto.get_tensorboard_path() / "events.out.tfevents.2.host").write_bytes(b"xyz")
    auto.final_tensorboard_upload()
    assert (ExpPaths(tmp_path / "exp").trial_tensorboard(4) / "events.out.tfevents.2.host").read_bytes() == b"xyz"
    # Off-cluster (no run dir) there is nowhere to upload to: nothing happens, as in Determined.
    TrainContext(NullWriter(), 0).upload_tensorboard_files()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_for_runs(base: str, cookie: str, deadline_s: float = 90.0) -> dict[str, Any]:
    end = time.monotonic() + deadline_s
    while True:
        try:
            code, body = _get(base + "data/plugin/scalars/tags", {"Cookie": cookie})
            tags: dict[str, Any] = json.loads(body) if code == 200 else {}
            if tags:
                return tags
        except OSError:
            pass
        if time.monotonic() > end:
            raise AssertionError(f"TensorBoard at {base} showed no runs in {deadline_s} s")
        time.sleep(1)


@pytest.mark.e2e
def test_trial_metrics_reach_tensorboard(det: Any) -> None:
    """A local experiment's reported metrics are in its trial's event file (step for step, as
    in the store), and `det tensorboard start` serves them on 127.0.0.1."""
    code, out, err = det("e", "create", "--local", CORE / "const.yaml", CORE)
    assert code == 0, err
    store = open_store(settings.load().db_url)
    with store.read() as s:
        rows = [(m.group, m.steps_completed, m.metrics) for m in s.query(Metric).filter(Metric.trial_id == 1)]
        exp = s.get(Experiment, 1)
        assert exp is not None
        exp_dir = Path(exp.exp_dir)
    got = scalars(ExpPaths(exp_dir).trial_tensorboard(1))
    for group, step, metrics in rows:
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert (step, pytest.approx(value, rel=1e-6)) in got[tbevents.tag_for(group, name)]
    assert sum(len(v) for v in got.values()) == sum(
        1 for _, _, m in rows for v in m.values() if isinstance(v, (int, float)) and not isinstance(v, bool)
    )
    # Ingest also unpacked every numeric value for the dashboard's curves (metric_points).
    with store.read() as s:
        points = sorted(
            (p.group, p.steps_completed, p.name, p.value)
            for p in s.query(MetricPoint).filter(MetricPoint.trial_id == 1)
        )
    assert points == sorted(
        (g, step, k, float(v))
        for g, step, m in rows
        for k, v in m.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    )
    code, _, err = det("tensorboard", "start", "1", "--host", "0.0.0.0")
    assert code != 0 and "binds only to 127.0.0.1" in err
    proc = subprocess.Popen(
        [sys.executable, "-m", "detslurm.cli.main", "tensorboard", "start", "1"],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("Open http://127.0.0.1:"), line
        url = urllib.parse.urlsplit(line.split()[1])
        base, token = f"http://{url.netloc}/", urllib.parse.parse_qs(url.query)["token"][0]
        cookie = f"detslurm_tb_{url.port}={token}"
        tags = _wait_for_runs(base, cookie)
        # --logdir_spec names each trial's run (TensorBoard adds the relative dir, ".").
        assert list(tags) == ["exp1_trial1/."]
        assert {"loss", "validation_loss"} <= set(tags["exp1_trial1/."]) and "val_validation_loss" not in tags[
            "exp1_trial1/."
        ]
        # The dashboard's guard: no token, a wrong one, or a foreign Host (DNS rebinding through
        # the forward) is refused; the printed URL moves the token into a cookie.
        tags_url = base + "data/plugin/scalars/tags"
        assert _get(tags_url)[0] == 403 and _get(base)[0] == 403
        assert _get(tags_url, {"Cookie": f"detslurm_tb_{url.port}=wrong"})[0] == 403
        assert _get(tags_url, {"Cookie": cookie, "Host": f"evil.example:{url.port}"})[0] == 403
        assert _get(tags_url + "?token=" + token, {"Cookie": f"detslurm_tb_{url.port}=stale"})[0] == 200
        conn = http.client.HTTPConnection(url.hostname or "", url.port)
        conn.request("GET", "/?token=" + token)
        first = conn.getresponse()
        assert first.status == 303 and first.getheader("Location") == "/"
        assert f"{cookie}; HttpOnly" in (first.getheader("Set-Cookie") or "")
        conn.close()
        assert _get(base, {"Cookie": cookie})[0] == 200
    finally:
        proc.terminate()
        proc.wait(30)
    # det's SIGTERM stopped TensorBoard too (it runs in det's process): the port is closed.
    with pytest.raises(OSError):
        socket.create_connection((url.hostname, url.port), timeout=5).close()
    # Remote mode's --exit-on-eof: the laptop's side going away (stdin closed) stops it.
    eof = subprocess.Popen(
        [sys.executable, "-m", "detslurm.cli.main", "tensorboard", "start", "1", "--exit-on-eof"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert eof.stdout is not None and eof.stdin is not None
    assert eof.stdout.readline().startswith("Open http://127.0.0.1:")
    eof.stdin.close()
    assert eof.wait(60) == 0
