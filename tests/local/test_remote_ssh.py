"""Remote mode against real OpenSSH servers (tests/sshd_harness.py): a login node and a
bastion for ProxyJump on 127.0.0.1, an ordinary Unix user with a key, its own `det` in a venv.

Most remote experiments use the local executor on the "login node" (--local): what they test is
the SSH path (upload, streaming, controls, download). The `slurm` one drives the real Slurm test
cluster through the bastion as the ssh user: create, logs -f, pause/activate, wait, download."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sshd_harness as sh
from conftest import EXAMPLES, ROOT, write

pytest.importorskip("paramiko")
pytestmark = pytest.mark.heavy  # the remote venv's build: CI's run starts these after the rest


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the remote-mode tests start sshd as root, and CI runs as root")
        pytest.skip("the remote-mode tests start sshd as root")
    try:
        sh.ensure_openssh()
        user = sh.ensure_user()
        det_bin, setup = sh.remote_det()
    except sh.Unavailable as e:
        pytest.skip(str(e))
    base = tmp_path_factory.mktemp("ssh")
    key = sh.keygen(base / "laptop_key")
    ssh_dir = Path(user.pw_dir) / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    for p in (ssh_dir, ssh_dir / "authorized_keys"):
        os.chown(p, user.pw_uid, user.pw_gid)
    login = sh.start_sshd(base / "login", ssh_dir / "authorized_keys")
    bastion = sh.start_sshd(base / "bastion", ssh_dir / "authorized_keys")
    yield {"key": key, "login": login, "bastion": bastion, "det": det_bin, "setup": setup, "user": user}
    login.stop()
    bastion.stop()


@pytest.fixture
def laptop(servers: dict[str, Any], det_env: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's laptop: a HOME with ~/.ssh/config (alias + ProxyJump), known_hosts and the
    key; no SSH agent; a detslurm config naming the remote det and its setup lines."""
    home = det_env / "laptop"
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(servers["key"], home / ".ssh/cluster_key")
    login, bastion = servers["login"], servers["bastion"]
    write(
        home / ".ssh/config",
        f"Host gw\n  HostName 127.0.0.1\n  Port {bastion.port}\n  User {sh.USER}\n  IdentityFile ~/.ssh/cluster_key\n\n"
        f"Host hpc\n  HostName 127.0.0.1\n  Port {login.port}\n  User {sh.USER}\n  IdentityFile ~/.ssh/cluster_key\n"
        "  ProxyJump gw\n\n"
        f"Host direct\n  HostName 127.0.0.1\n  Port {login.port}\n  User {sh.USER}\n  IdentityFile ~/.ssh/cluster_key\n",
    )
    write(home / ".ssh/known_hosts", login.known_hosts_line() + bastion.known_hosts_line())
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    # Each test starts with an empty upload cache and its own detslurm dirs on the login node.
    shutil.rmtree(Path(servers["user"].pw_dir) / ".cache/detslurm", ignore_errors=True)
    rdir = f"$HOME/t-{uuid.uuid4().hex[:10]}"
    setup = [*servers["setup"], f"export DETSLURM_DATA_DIR={rdir}/data DETSLURM_EXPERIMENTS_DIR={rdir}/exps"]
    setup.append(f"export DETSLURM_CHECKPOINT_DIR={rdir}/ckpts DETSLURM_POLL_INTERVAL_S=0.1")
    remote = {"det": str(servers["det"]), "setup": setup, "persist_s": 0}
    write(Path(os.environ["DETSLURM_CONFIG"]), json.dumps({"remote": remote}))
    return home


def _context(tmp: Path) -> Path:
    ctx = tmp / "ctx"
    shutil.copytree(EXAMPLES / "core_api", ctx)
    return ctx


def test_unknown_host_key_is_refused_with_its_fingerprint(det: Any, laptop: Path, servers: dict[str, Any]) -> None:
    login = servers["login"]
    (laptop / ".ssh/known_hosts").write_text(servers["bastion"].known_hosts_line())
    code, out, err = det("-m", "ssh://direct", "e", "list")
    assert code == 1 and out == ""
    assert f"unknown host key for [127.0.0.1]:{login.port}" in err
    assert sh.fingerprint(Path(f"{login.host_key}.pub")) in err
    assert login.known_hosts_line().strip() in err  # the line to add, once checked


def test_changed_host_key_is_refused(det: Any, laptop: Path, servers: dict[str, Any], tmp_path: Path) -> None:
    login = servers["login"]
    other = sh.keygen(tmp_path / "impostor")
    kind, b64 = Path(f"{other}.pub").read_text().split()[:2]
    bastion_line = servers["bastion"].known_hosts_line()
    (laptop / ".ssh/known_hosts").write_text(f"[127.0.0.1]:{login.port} {kind} {b64}\n{bastion_line}")
    code, _, err = det("-m", "ssh://direct", "e", "list")
    assert code == 1 and "HOST KEY CHANGED" in err
    assert sh.fingerprint(Path(f"{other}.pub")) in err and sh.fingerprint(Path(f"{login.host_key}.pub")) in err
    # ... and through the bastion: the login node's key is checked behind the jump too.
    code, _, err = det("-m", "ssh://hpc", "e", "list")
    assert code == 1 and "HOST KEY CHANGED" in err


@pytest.fixture
def held(laptop: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Commands share one connection through the holder (remote.persist_s > 0)."""
    # Short, like /run/user/UID: under a long pytest basetemp the socket path would not fit
    # sun_path and det would (rightly) fall back to the shared /tmp/detslurm-UID.
    run = Path(tempfile.mkdtemp(prefix="ds-run-"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    monkeypatch.setenv("DETSLURM_REMOTE_PERSIST_S", "60")
    yield run / "detslurm"
    for sock in (run / "detslurm").glob("*.sock"):
        sock.unlink()  # a holder whose socket is gone exits within a second
    time.sleep(1.5)
    shutil.rmtree(run, ignore_errors=True)


def test_create_upload_cache_reads_and_download_through_bastion(
    det: Any, laptop: Path, servers: dict[str, Any], tmp_path: Path, held: Path
) -> None:
    logins_before = servers["bastion"].log.count("Accepted publickey")
    ctx = _context(tmp_path)
    n = len([p for p in ctx.rglob("*") if p.is_file()])
    url = "ssh://hpc"  # an ~/.ssh/config alias that jumps through the bastion `gw`
    args = ("e", "create", "--local", ctx / "const.yaml", ctx, "--config", "hyperparameters.sleep=0")
    code, out, err = det("-m", url, *args)
    assert code == 0 and "Created experiment 1" in out and "Experiment 1 COMPLETED" in out, err
    assert f"Uploaded {n} of {n} context files" in err
    code, out, err = det("-m", url, *args)  # unchanged code: nothing to upload
    assert code == 0 and "Created experiment 2" in out and f"Uploaded 0 of {n} context files" in err
    with open(ctx / "train.py", "a") as f:
        f.write("# changed\n")
    code, out, err = det("-m", url, *args)  # one changed file uploads only itself
    assert code == 0 and "Created experiment 3" in out and f"Uploaded 1 of {n} context files" in err
    assert "direct-tcpip" in servers["bastion"].log  # the login node was reached through the jump

    code, out, _ = det("-m", url, "e", "list", "--json")
    assert code == 0 and [e["state"] for e in json.loads(out)] == ["COMPLETED"] * 3
    code, out, _ = det("-m", url, "t", "logs", "1")
    assert code == 0 and "=== trial 1 run" in out
    code, out, _ = det("-m", url, "e", "lc", "1", "--json")
    ck = json.loads(out)[-1]["uuid"]
    code, out, err = det("-m", url, "c", "download", ck, "-o", tmp_path / "dl")
    assert code == 0 and out == f"Local checkpoint path:\n{tmp_path / 'dl'}\n" and "Downloaded" in err
    assert json.loads((tmp_path / "dl/metadata.json").read_text())["steps_completed"] == 40
    code, out, err = det("-m", url, "c", "download", "no-such-uuid")
    assert code == 1 and err.strip() == "Error: checkpoint no-such-uuid not found"
    # Every command went through one held connection: one login at the bastion, one socket.
    assert servers["bastion"].log.count("Accepted publickey") == logins_before + 1
    (sock,) = held.glob("*.sock")
    assert sock.stat().st_mode & 0o777 == 0o600 and held.stat().st_mode & 0o777 == 0o700


def test_remote_errors_and_hostile_arguments(det: Any, laptop: Path, tmp_path: Path) -> None:
    code, out, err = det("-m", "ssh://direct", "e", "describe", "999")
    assert code == 1 and err.strip() == "Error: experiment 999 not found"
    marker = tmp_path / "pwned"
    for hostile in (f"1; touch {marker}", f"$(touch {marker})", f"`touch {marker}`", f"1' && touch {marker} '"):
        code, _, err = det("-m", "ssh://direct", "e", "describe", hostile)
        assert code == 2 and "is not a valid integer" in err and hostile in err
    assert not marker.exists()
    code, _, err = det("-m", "ssh://nobody@direct", "e", "list")
    assert code == 1 and "authentication failed" in err or "Permission denied" in err


def _laptop_det(laptop: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, HOME=str(laptop))
    return subprocess.Popen(
        [sys.executable, "-m", "detslurm.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _chatty_context(tmp: Path) -> Path:
    """The core_api example, printing a line per batch (so that streaming shows)."""
    ctx = _context(tmp)
    train = ctx / "train.py"
    sleep_line = '        time.sleep(float(hparams.get("sleep", 0.0)))\n'
    assert sleep_line in train.read_text()
    # hparams.hold: while that file exists the trial waits after batch 3 until it is told to stop,
    # so a pause reaches it mid-run however long the test's SSH round trips take.
    hold = (
        '        print(f"batch {batch}", flush=True)\n'
        '        while batch == 3 and os.path.exists(hparams.get("hold", "")) and not ctx.preempt.should_preempt():\n'
        "            time.sleep(0.2)\n"
    )
    train.write_text(train.read_text().replace(sleep_line, sleep_line + hold))
    return ctx


@pytest.fixture
def hold() -> Iterator[Path]:
    """A file the ssh user can see (its trials run as that user); removing it releases the trial."""
    (ROOT / ".state").mkdir(exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="hold-", dir=ROOT / ".state"))  # remote_det checked others may go there
    d.chmod(0o755)
    (d / "hold").touch()
    yield d / "hold"
    shutil.rmtree(d)


def _wait_for_output(det: Any, url: str, trial: int, needle: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        code, out, _ = det("-m", url, "t", "logs", str(trial))
        if code == 0 and needle in out:
            return
        time.sleep(1)
    raise AssertionError(f"trial {trial} never printed {needle!r}")


def test_logs_follow_streams_and_pause_activate(det: Any, laptop: Path, tmp_path: Path, hold: Path) -> None:
    ctx = _chatty_context(tmp_path)
    url = "ssh://hpc"
    create = _laptop_det(
        laptop,
        "-m",
        url,
        "e",
        "create",
        "--local",
        str(ctx / "const.yaml"),
        str(ctx),
        "--config",
        "hyperparameters.sleep=0.5",
        "--config",
        f"hyperparameters.hold={hold}",
    )
    follow: subprocess.Popen[str] | None = None
    try:
        _wait_for_output(det, url, 1, "batch 1")
        follow = _laptop_det(laptop, "-m", url, "t", "logs", "-f", "1")
        assert follow.stdout is not None
        first = follow.stdout.readline()  # arrives while the trial still runs: streamed, not buffered
        assert first and create.poll() is None, first
        code, out, err = det("-m", url, "e", "pause", "1")
        assert code == 0 and "Paused experiment 1" in out, err
        stdout, stderr = create.communicate(timeout=90)
        assert "Experiment 1 PAUSED" in stdout, stderr
        hold.unlink()
        code, out, err = det("-m", url, "e", "activate", "1")
        assert code == 0 and "Activated experiment 1" in out and "Experiment 1 COMPLETED" in out, err
        rest, _ = follow.communicate(timeout=600)  # follows across the pause until the trial ends
        assert first == "batch 1\n" and "batch 40\n" in rest and "done: w=" in rest
    finally:
        for p in (create, follow):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.communicate()


def on_the_cluster(slurm_cluster: Path) -> None:
    """The remote side's setup points at the test cluster (its slurm.conf and site config)."""
    cfg_path = Path(os.environ["DETSLURM_CONFIG"])
    cfg = json.loads(cfg_path.read_text())
    cfg["remote"]["setup"].append(
        f"export SLURM_CONF={slurm_cluster / 'etc/slurm.conf'} DETSLURM_SITE_CONFIG={ROOT / 'site-configs/test-cluster.yaml'}"
        " DETSLURM_DAEMON_IDLE_EXIT_S=30"
    )
    cfg_path.write_text(json.dumps(cfg))


@pytest.mark.slurm
def test_on_the_slurm_test_cluster(det: Any, laptop: Path, slurm_cluster: Path, tmp_path: Path, hold: Path) -> None:
    """The ssh user drives real Slurm jobs from the laptop: its det, its daemon, its jobs."""
    on_the_cluster(slurm_cluster)
    ctx = _chatty_context(tmp_path)
    url = "ssh://hpc"
    follow: subprocess.Popen[str] | None = None
    try:
        code, out, err = det(
            "-m",
            url,
            "e",
            "create",
            ctx / "const.yaml",
            ctx,
            "--config",
            "hyperparameters.sleep=0.4",
            "--config",
            f"hyperparameters.hold={hold}",
        )
        assert code == 0 and "Created experiment 1" in out, err
        _wait_for_output(det, url, 1, "batch 2")
        follow = _laptop_det(laptop, "-m", url, "t", "logs", "-f", "1")
        assert follow.stdout is not None
        first = follow.stdout.readline()  # streamed while the Slurm job runs
        assert first.strip(), f"`t logs -f` ended with {follow.wait(60)}: {follow.communicate()[1]}"
        code, out, err = det("-m", url, "e", "pause", "1")
        assert code == 0 and "Paused experiment 1" in out, err
        deadline = time.time() + 120
        while json.loads(det("-m", url, "e", "list", "--json")[1])[0]["state"] != "PAUSED":
            assert time.time() < deadline, "the experiment never paused"
            time.sleep(1)
        hold.unlink()
        code, out, err = det("-m", url, "e", "activate", "1")
        assert code == 0 and "Activated experiment 1" in out, err
        code, out, err = det("-m", url, "e", "wait", "1")
        assert code == 0 and "Experiment 1 COMPLETED" in out, err
        rest, _ = follow.communicate(timeout=120)
        assert "done: w=" in rest
        ck = json.loads(det("-m", url, "e", "lc", "1", "--json")[1])[-1]["uuid"]
        code, out, err = det("-m", url, "c", "download", ck, "-o", tmp_path / "dl", "-q")
        assert code == 0 and out == f"{tmp_path / 'dl'}\n", err
        assert json.loads((tmp_path / "dl/metadata.json").read_text())["steps_completed"] == 40
    finally:
        if follow is not None and follow.poll() is None:
            follow.kill()
        if follow is not None:
            follow.communicate()
        det("-m", url, "daemon", "stop")
        subprocess.run(
            ["scancel", "-u", sh.USER],
            check=False,
            env=dict(os.environ, SLURM_CONF=str(slurm_cluster / "etc/slurm.conf")),
        )


SSH_THIEF = """
import os, uuid
import determined as det
from detslurm.protocol.events import CheckpointSaved

with det.core.init() as ctx:
    base = ctx.checkpoint.base
    with ctx.checkpoint.store_path({"steps_completed": 1}) as (path, _):
        (path / "w.txt").write_text("w")
    with ctx.checkpoint.store_path({"steps_completed": 4}) as (path, _):  # a tree too deep to copy
        deep = path.joinpath(*["d"] * 70)
        deep.mkdir(parents=True)
        (deep / "leaf").write_text("x")
    # Forged reports: a checkpoint "at" ~/.ssh, and one whose dir is a link to it.
    linked = str(uuid.uuid4())
    os.symlink(os.path.expanduser("~/.ssh"), base / linked)
    for name, steps in ((str(uuid.uuid4()), 2), (linked, 3)):
        ctx.checkpoint._report(CheckpointSaved(uuid=name, metadata={"steps_completed": steps}, resources={},
                                               steps_completed=steps, size=0, storage_path=os.path.expanduser("~/.ssh")))
"""


def test_download_copies_only_the_checked_checkpoint_dir(
    det: Any, laptop: Path, servers: dict[str, Any], tmp_path: Path
) -> None:
    """A trial on the login node reports checkpoints at ~/.ssh, or puts a link to it in its
    checkpoint's place: a download over SSH copies neither; a real one lands in a fresh dir only."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text(SSH_THIEF)
    (ckpts,) = [
        w.split("=", 1)[1].replace("$HOME", servers["user"].pw_dir)
        for line in json.loads(Path(os.environ["DETSLURM_CONFIG"]).read_text())["remote"]["setup"]
        for w in line.split()
        if w.startswith("DETSLURM_CHECKPOINT_DIR=")
    ]
    # GC keeps all three: the forged rows stay COMPLETED, as a download would find them.
    storage = f"{{type: shared_fs, host_path: '{ckpts}', save_trial_latest: 5}}"
    write(
        ctx / "exp.yaml",
        f"name: thief\nentrypoint: python3 train.py\nsearcher: {{name: single, metric: x}}\ncheckpoint_storage: {storage}\n",
    )
    url = "ssh://direct"
    code, out, err = det("-m", url, "e", "create", "--local", ctx / "exp.yaml", ctx)
    assert code == 0 and "COMPLETED" in out, out + err
    code, out, _ = det("-m", url, "e", "lc", "1", "--json")
    by_steps = {c["steps_completed"]: c["uuid"] for c in json.loads(out)}
    for steps in (2, 3):
        dl = tmp_path / f"stolen-{steps}"
        code, out, err = det("-m", url, "c", "download", by_steps[steps], "-o", dl)
        assert code == 1 and "not found" in err, out + err
        assert not dl.exists()
    assert not [p for p in tmp_path.rglob("authorized_keys")]
    code, out, err = det("-m", url, "c", "download", by_steps[4], "-o", tmp_path / "deep")
    assert code == 1 and "nested deeper than 64 levels" in err and not (tmp_path / "deep").exists(), out + err
    dl = tmp_path / "dl"
    code, out, err = det("-m", url, "c", "download", by_steps[1], "-o", dl)
    assert code == 0 and (dl / "w.txt").read_text() == "w", out + err
    assert sorted(p.name for p in dl.iterdir()) == ["metadata.json", "w.txt"]  # not the run's mark
    code, out, err = det("-m", url, "c", "download", by_steps[1], "-o", dl)  # never into what is there
    assert code == 1 and "already exists" in err, out + err


def test_context_files_named_like_options_are_uploaded_as_files(
    det: Any, laptop: Path, servers: dict[str, Any], tmp_path: Path
) -> None:
    """File names become arguments of the login node's cp/chmod/ln: a `--help` must arrive as a
    file, and `--target-directory=..` must not write outside the context's tree."""
    ctx = tmp_path / "ctx"
    (ctx / "-d").mkdir(parents=True)
    names = ["--help", "--target-directory=..", "-rf", "-d/--verbose"]
    for name in names:
        (ctx / name).write_text(name)
    (ctx / "--link").symlink_to("--help")
    check = "; ".join(f"assert open({n!r}).read() == {n!r}, {n!r}" for n in names)
    write(ctx / "train.py", f"import os\n{check}\nassert os.readlink('--link') == '--help'\n")
    write(ctx / "exp.yaml", "name: dashes\nentrypoint: python3 train.py\nsearcher: {name: single, metric: x}\n")
    code, out, err = det("-m", "ssh://direct", "e", "create", "--local", ctx / "exp.yaml", ctx)
    assert code == 0 and "Experiment 1 COMPLETED" in out, out + err
    trees = Path(servers["user"].pw_dir) / ".cache/detslurm/contexts/trees"
    assert all(p.is_dir() or p.name.endswith(".done") for p in trees.iterdir()), sorted(trees.iterdir())
    # A tree that cannot be built fails the upload, never a tree marked done without its files.
    (ctx / "new.txt").write_text("a changed context: a new tree")
    trees.chmod(0o500)
    try:
        code, out, err = det("-m", "ssh://direct", "e", "create", "--local", ctx / "exp.yaml", ctx)
    finally:
        trees.chmod(0o700)
    assert code == 1 and "could not unpack the uploaded context" in err and "Permission denied" in err, out + err
    assert len(list(trees.glob("*.done"))) == 1


def test_cached_objects_and_trees_are_verified_before_reuse(
    det: Any, laptop: Path, servers: dict[str, Any], tmp_path: Path
) -> None:
    """Another process of the user (a compromised job) edits the upload cache: an edited object
    is uploaded again, an edited tree (changed file, added file, changed mode) is built again,
    and the experiment runs the code this machine has."""
    ctx = tmp_path / "ctx"
    write(ctx / "train.py", "print('the real code')\n")
    write(ctx / "lib/util.py", "X = 1\n")
    write(ctx / "exp.yaml", "name: cache\nentrypoint: python3 train.py\nsearcher: {name: single, metric: x}\n")
    args = ("e", "create", "--local", ctx / "exp.yaml", ctx)
    code, out, err = det("-m", "ssh://direct", *args)
    assert code == 0 and "Experiment 1 COMPLETED" in out, out + err
    cache = Path(servers["user"].pw_dir) / ".cache/detslurm/contexts"
    (tree,) = [p for p in (cache / "trees").iterdir() if p.is_dir()]
    evil = "raise SystemExit('edited by a job')\n"
    (cache / "objects" / hashlib.sha256(b"print('the real code')\n").hexdigest()).write_text(evil)
    (tree / "train.py").write_text(evil)
    code, out, err = det("-m", "ssh://direct", *args)
    assert code == 0 and "Experiment 2 COMPLETED" in out and "Uploaded 1 of 3 context files" in err, out + err
    assert (tree / "train.py").read_text() == "print('the real code')\n"
    for tamper in (lambda: (tree / "sitecustomize.py").write_text(evil), lambda: (tree / "lib/util.py").chmod(0o777)):
        tamper()
        code, out, err = det("-m", "ssh://direct", *args)
        assert code == 0 and "COMPLETED" in out and "Uploaded 0 of 3" in err, out + err
        assert sorted(p.name for p in tree.rglob("*")) == ["exp.yaml", "lib", "train.py", "util.py"]
        assert (tree / "lib/util.py").stat().st_mode & 0o777 == 0o644
