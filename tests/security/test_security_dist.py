"""Nobody but the trial's own ranks can join or kill its collectives (docs/design/security.md).

The `security` tests run the attacks as a second Unix user (tests/security_harness.py) against
real rank processes started with the environment a launcher gives them; the others check the
protocol's refusals in-process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_for
from security_attacks import C1_COLLECTIVE_PORT, C1B_BAD_CLIENTS
from security_harness import Attacker

from detslurm.core import DistributedContext
from detslurm.core._wire import HANDSHAKE_TIMEOUT_S, DistributedError, _Group, _local_address
from detslurm.launch._common import Nodes, free_port, run_secret_env
from detslurm.protocol.secret import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    RunSecretError,
    ensure_run_secret,
    ensure_run_secrets,
    new_secret,
    read_run_secret,
    write_run_secret,
    write_run_secrets,
)

# A rank as a launcher starts it; rank 0 first, the others only once GO exists, so that the
# chief sits in group formation (the window before every rank has joined) while the attacker works.
VICTIM = """
import json, os, sys, time
from detslurm.core import DistributedContext
rank, size, port, go = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
while rank != 0 and not os.path.exists(go):
    time.sleep(0.05)
d = DistributedContext(rank=rank, size=size, local_rank=rank, local_size=size, cross_rank=0, cross_size=1,
                       chief_ip="127.0.0.1", pub_port=port)
print(json.dumps({"all": d.allgather(rank), "b": d.broadcast("from0" if rank == 0 else None)}), flush=True)
d.close()
"""

# A node's local group alone (its abstract unix socket), held open the same way.
VICTIM_LOCAL = """
import json, os, sys, time
from detslurm.core._wire import _Group, _local_address
from detslurm.protocol.secret import secret_from_env
rank, port, go = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
while rank != 0 and not os.path.exists(go):
    time.sleep(0.05)
secret = secret_from_env(os.environ)
g = _Group(rank, 2, _local_address(secret, port, 0), "AF_UNIX", secret, "local0")
print(json.dumps({"all": g.exchange(rank, "allgather")}), flush=True)
g.close()
"""


def victim_env(tmp_path: Path) -> dict[str, str]:
    """The job environment of trial 1 of experiment 1, plus what the launcher adds (the secret)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_", "DETSLURM_"))}
    env.update(DET_ALLOCATION_ID="exp-1-trial-1-run-1", DET_TRIAL_ID="1", DETSLURM_DIST_JOIN_TIMEOUT_S="90")
    env.update(run_secret_env(env, Nodes(["127.0.0.1"], 0, 2)))
    return env


def start(script: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def tcp_listening(port: int) -> bool:
    """From /proc/net/tcp, without connecting (a probe connection would itself be a bad client)."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A" for r in rows)


def unix_listening(name: str) -> bool:
    return any(line.endswith("@" + name) for line in Path("/proc/net/unix").read_text().splitlines())


def finish(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"a victim rank failed:\n{err}"
    return [json.loads(out) for out, _ in outs]


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    """Where the attacker's payload would write: only the victim (this test's user) can create it."""
    os.chmod(tmp_path, 0o700)
    yield tmp_path / "owned"


@pytest.mark.security
def test_c1_payload_works_against_the_old_pickle_rpc(mallory: Attacker, marker: Path) -> None:
    """Control: the attack script does execute code through a pickle RPC keyed by public ids."""
    import hashlib
    from multiprocessing.connection import Listener

    listener = Listener(("127.0.0.1", 0), authkey=hashlib.sha256(b"exp-1-trial-1-run-1").digest())
    host, port = listener.address

    def serve() -> None:
        for _ in range(6):  # the first keys the attacker tries are wrong for this listener
            try:
                listener.accept().recv()
                return
            except Exception:  # the old server's failure mode, being demonstrated
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    r = mallory.python_snippet(C1_COLLECTIVE_PORT, f"{host}:{port}", str(marker))
    t.join(30)
    listener.close()
    assert r.returncode == 0, r.stderr
    assert marker.exists() and "uid=0" in marker.read_text()


@pytest.mark.security
def test_c1_neighbour_cannot_join_or_inject(mallory: Attacker, marker: Path, tmp_path: Path) -> None:
    """Every derivable key, old and new handshake, raw pickles: nothing gets in, nothing runs,
    and the trial completes. Files planted at the old predictable socket paths change nothing."""
    env, port, go = victim_env(tmp_path), free_port("127.0.0.1"), tmp_path / "go"
    planted = [f"/tmp/detslurm-{os.getuid()}-{port}-{c}.sock" for c in range(2)]
    plant = "import sys\nfor p in sys.argv[1:]:\n    open(p, 'w').write('mine')\n"
    assert mallory.python_snippet(plant, *planted).returncode == 0
    try:
        procs = [start(VICTIM, [str(r), "2", str(port), str(go)], env) for r in range(2)]
        wait_for(lambda: tcp_listening(port), what="rank 0 to listen", interval=0.05)
        r = mallory.python_snippet(C1_COLLECTIVE_PORT, f"127.0.0.1:{port}", str(marker))
        go.touch()
        results = finish(procs)
    finally:
        for p in planted:
            Path(p).unlink(missing_ok=True)
    assert r.returncode == 0, r.stderr
    attempts = json.loads(r.stdout)
    assert len(attempts) == 36 and not [a for a in attempts if a["accepted"]]
    assert not marker.exists()
    assert results == [{"all": [0, 1], "b": "from0"}] * 2


@pytest.mark.security
def test_c1_node_socket_is_not_joinable(mallory: Attacker, marker: Path, tmp_path: Path) -> None:
    """The node-local group's abstract socket: the attacker finds it in /proc/net/unix, and still
    gets nowhere with any key it can derive."""
    env, port, go = victim_env(tmp_path), free_port("127.0.0.1"), tmp_path / "go"
    name = _local_address(bytes.fromhex(env[SECRET_ENV]), port, 0)[1:]
    procs = [start(VICTIM_LOCAL, [str(r), str(port), str(go)], env) for r in range(2)]
    wait_for(lambda: unix_listening(name), what="the local chief to listen", interval=0.05)
    r = mallory.python_snippet(C1_COLLECTIVE_PORT, "unix", str(marker))
    go.touch()
    results = finish(procs)
    assert r.returncode == 0, r.stderr
    attempts = json.loads(r.stdout)
    assert any(name in a["addr"] for a in attempts) and not [a for a in attempts if a["accepted"]]
    assert not marker.exists() and results == [{"all": [0, 1]}] * 2


@pytest.mark.security
def test_c1b_bad_clients_during_formation_do_not_kill_the_trial(mallory: Attacker, tmp_path: Path) -> None:
    """Garbage, an oversized frame, a truncated frame, a stall: each is closed and logged, and
    the group forms once the late rank arrives; the stall is cut off after the handshake timeout."""
    env, port, go = victim_env(tmp_path), free_port("127.0.0.1"), tmp_path / "go"
    procs = [start(VICTIM, [str(r), "2", str(port), str(go)], env) for r in range(2)]
    wait_for(lambda: tcp_listening(port), what="rank 0 to listen", interval=0.05)
    r = mallory.python_snippet(C1B_BAD_CLIENTS, "127.0.0.1", str(port))
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert r.returncode == 0, r.stderr
    stall = json.loads(r.stdout)["stall_closed_after_s"]
    assert stall is not None and HANDSHAKE_TIMEOUT_S - 1 < stall < HANDSHAKE_TIMEOUT_S + 3
    assert [p.returncode for p in procs] == [0, 0], outs[0][1]
    assert [json.loads(o) for o, _ in outs] == [{"all": [0, 1], "b": "from0"}] * 2
    log = outs[0][1]
    for why in ("not JSON", "oversized handshake frame", "closed the connection before", "did not authenticate"):
        assert why in log, log


# -- in-process: the protocol's refusals ----------------------------------------------------------
@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> bytes:
    secret = new_secret()
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, secret.hex())
    monkeypatch.setenv("DETSLURM_DIST_JOIN_TIMEOUT_S", "20")
    return secret


def serve_group(rank: int, port: int, secret: bytes, out: dict[int, Any]) -> threading.Thread:
    def body() -> None:
        try:
            g = _Group(rank, 3, ("127.0.0.1", port), "AF_INET", secret, "global")
            out[rank] = g.exchange(rank, "allgather")
            g.close()
        except BaseException as e:  # handed to the test thread
            out[rank] = e

    t = threading.Thread(target=body)
    t.start()
    return t


def test_c1b_wrong_secret_duplicate_and_unknown_ranks_are_refused(secret_env: bytes) -> None:
    """A member with another run's secret, a second rank 1 and a rank 7 all fail at once with
    clear errors, and the real ranks still form the group."""
    port, out = free_port("127.0.0.1"), {}
    addr = ("127.0.0.1", port)
    server = serve_group(0, port, secret_env, out)
    with pytest.raises(DistributedError, match="refused rank 1: authentication failed"):
        _Group(1, 3, addr, "AF_INET", new_secret(), "global")
    first = _Group(1, 3, addr, "AF_INET", secret_env, "global")  # returns once admitted
    with pytest.raises(DistributedError, match="refused rank 1: rank 1 joined twice"):
        _Group(1, 3, addr, "AF_INET", secret_env, "global")
    with pytest.raises(DistributedError, match=r"refused rank 7: rank 7 is not a member \(expected \[1, 2\]\)"):
        _Group(7, 3, addr, "AF_INET", secret_env, "global")
    threads = [threading.Thread(target=lambda: out.update({1: first.exchange(1, "allgather")}))]
    threads[0].start()
    threads.append(serve_group(2, port, secret_env, out))
    for t in (server, *threads):
        t.join(30)
    first.close()
    assert out == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}


def test_missing_rank_is_named_at_the_deadline(secret_env: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETSLURM_DIST_JOIN_TIMEOUT_S", "1")
    with pytest.raises(DistributedError, match=r"did not form within 1 s: ranks \[1, 2\] never joined"):
        _Group(0, 3, ("127.0.0.1", free_port("127.0.0.1")), "AF_INET", secret_env, "global")


def test_no_secret_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """There is no derived fallback: without a secret a multi-rank context refuses to start."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv("DET_ALLOCATION_ID", "exp-1-trial-1-run-1")
    with pytest.raises(RunSecretError, match="no run secret"):
        DistributedContext(rank=0, size=2, local_rank=0, local_size=2, cross_rank=0, cross_size=1)
    assert DistributedContext(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1).size == 1


def test_collectives_carry_json_only(secret_env: bytes) -> None:
    port, out = free_port("127.0.0.1"), {}

    def member(rank: int) -> None:
        g = _Group(rank, 2, ("127.0.0.1", port), "AF_INET", secret_env, "global")
        out[rank] = g.exchange((rank, {"k": 1.5}), "allgather")
        try:
            g.exchange(object(), "broadcast")
        except TypeError as e:
            out[f"err{rank}"] = str(e)
        g.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0] == out[1] == [[0, {"k": 1.5}], [1, {"k": 1.5}]]  # tuples arrive as lists on every rank
    assert "JSON values only (never pickles); got object" in out["err0"]


def test_run_secret_file_checks(tmp_path: Path) -> None:
    path = write_run_secret(tmp_path)
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(read_run_secret(path)) == 32
    with pytest.raises(RunSecretError, match="already exists: a run secret is never reused"):
        write_run_secret(tmp_path)
    sub = tmp_path / "sub"
    sub.mkdir()
    fresh = ensure_run_secret(sub)
    assert fresh == sub / "run-secret" and read_run_secret(fresh) != read_run_secret(path)
    before = read_run_secret(fresh)
    assert ensure_run_secret(sub) == fresh and read_run_secret(fresh) == before  # the same run, again: kept
    fresh.chmod(0o640)
    with pytest.raises(RunSecretError, match="mode 640: it must be 600"):
        ensure_run_secret(sub)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(RunSecretError, match="is a symlink"):
        read_run_secret(link)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(RunSecretError, match="not a regular file"):
        read_run_secret(fifo)
    (tmp_path / "dir").mkdir()
    open_before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    for _ in range(20):  # a directory in the secret's place: refused, and no descriptor left open
        with pytest.raises(RunSecretError, match="not a regular file"):
            read_run_secret(tmp_path / "dir")
    assert (len(os.listdir("/proc/self/fd")) if open_before else 0) == open_before
    short = tmp_path / "short"
    short.write_text("abcd")
    short.chmod(0o600)
    with pytest.raises(RunSecretError, match="has 2 bytes; at least 32"):
        read_run_secret(short)
    masked = tmp_path / "masked"
    masked.mkdir()
    umask = os.umask(0o277)  # creates files 0400: the secret still ends up exactly 0600
    try:
        assert oct(write_run_secret(masked).stat().st_mode & 0o777) == "0o600"
    finally:
        os.umask(umask)


def test_run_secrets_in_a_batch_are_private_distinct_and_never_reused(tmp_path: Path) -> None:
    """A submission's secrets written at once (concurrent fsyncs) hold the same guarantees as one:
    0600, random (all distinct), no temporary file left, an existing secret kept after its check,
    a bad one refused."""
    dirs = [tmp_path / f"run{i}" for i in range(40)]
    for d in dirs:
        d.mkdir()
    kept = write_run_secret(dirs[3])  # a resubmitted run: its secret stays
    before = read_run_secret(kept)
    paths = ensure_run_secrets(dirs)
    assert paths == [d / "run-secret" for d in dirs]
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in paths)
    assert len({read_run_secret(p) for p in paths}) == 40 and read_run_secret(kept) == before
    assert sorted(os.listdir(dirs[0])) == ["run-secret"]  # the temporary name is gone
    with pytest.raises(RunSecretError, match="already exists: a run secret is never reused"):
        write_run_secrets(dirs[:2])
    assert all(sorted(os.listdir(d)) == ["run-secret"] for d in dirs[:2])  # nothing left behind on failure
    paths[5].chmod(0o644)
    with pytest.raises(RunSecretError, match="mode 644: it must be 600"):
        ensure_run_secrets(dirs)
    with pytest.raises(RunSecretError, match="cannot create the run secret in"):
        write_run_secrets([tmp_path / "missing"])


@pytest.mark.security
def test_run_secret_owned_by_someone_else_is_refused(mallory: Attacker, tmp_path: Path) -> None:
    """A secret file another user planted (mode 600, but theirs) is refused."""
    path = write_run_secret(tmp_path)
    os.chown(path, mallory.uid, mallory.user.pw_gid)
    with pytest.raises(RunSecretError, match=f"owned by uid {mallory.uid}, not by us"):
        read_run_secret(path)


def test_server_survives_a_client_that_vanishes_mid_handshake(secret_env: bytes) -> None:
    port, out = free_port("127.0.0.1"), {}
    server = serve_group(0, port, secret_env, out)
    wait_for(lambda: tcp_listening(port), what="the server", interval=0.05)
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"\x00\x00")
    members = [serve_group(r, port, secret_env, out) for r in (1, 2)]
    for t in (server, *members):
        t.join(30)
    assert out == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}


# -- on the real Slurm test cluster -----------------------------------------------------------------
LATE = Path(__file__).parents[1] / "fixtures/core_dist_late.py"


def chief_dist_port(timeout_s: float = 120) -> int:
    """The port the trial's chief serves its group on, from the rendezvous file its launcher
    publishes (an attacker gets the same from ss -ltn on a shared node, or a port scan)."""
    from sqlalchemy import select

    from detslurm import settings
    from detslurm.store import TrialRun, open_store

    found: list[Path] = []

    def published() -> bool:
        with open_store(settings.load().db_url).tx() as s:
            dirs = [Path(d) for d in s.scalars(select(TrialRun.run_dir)).all() if d]
        found[:] = [f for d in dirs for f in d.glob("rendezvous-*.json")]
        return bool(found)

    wait_for(published, what="the chief's rendezvous file", timeout=timeout_s, interval=0.05)
    port = int(json.loads(found[0].read_text())["dist"])
    wait_for(lambda: tcp_listening(port), what="the chief to listen", timeout=timeout_s, interval=0.05)
    return port


@pytest.mark.slurm
@pytest.mark.torch
@pytest.mark.security
@pytest.mark.usefixtures("slurm_env")
def test_c1_on_the_cluster_two_nodes_two_ranks(det: Any, mallory: Attacker, marker: Path, tmp_path: Path) -> None:
    """The attack that derived the key from public ids, replayed: a neighbour attacks the chief of a 2x2 trial on c1
    with every key it can derive while the other ranks are still joining. The trial completes."""
    from conftest import write

    go = tmp_path / "go"
    write(tmp_path / "ctx/late.py", LATE.read_text())
    cfg = write(
        tmp_path / "c.yaml",
        "entrypoint: python3 -m determined.launch.torch_distributed python3 late.py\n"
        "searcher: {name: single, metric: loss}\nmax_restarts: 0\nresources: {slots_per_trial: 4}\n"
        f"environment: {{environment_variables: [GO_FILE={go}]}}\n",
    )
    code, out, err = det("e", "create", cfg, tmp_path / "ctx")
    assert code == 0, out + err
    r = mallory.python_snippet(C1_COLLECTIVE_PORT, f"c1:{chief_dist_port()}", str(marker))
    go.touch()
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err
    assert r.returncode == 0, r.stderr
    attempts = json.loads(r.stdout)
    assert len(attempts) == 36 and not [a for a in attempts if a["accepted"]]
    assert not marker.exists()
    code, logs, _ = det("t", "logs", "1")
    assert "rank 3: group [[0, 'c1'], [1, 'c1'], [2, 'c2'], [3, 'c2']]" in logs
    assert "global/4 group: closed a connection from" in logs and "failed authentication" in logs


def test_a_batch_bigger_than_the_descriptor_limit_is_written_in_chunks(tmp_path: Path) -> None:
    """One descriptor per run is held while a batch is fsynced: 600 runs under a limit of 300."""
    script = f"""
import resource, sys
from pathlib import Path
from detslurm.protocol.secret import write_run_secrets
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
dirs = [Path({str(tmp_path)!r}) / f"r{{i}}" for i in range(600)]
for d in dirs:
    d.mkdir()
print(len(set(p.read_text() for p in write_run_secrets(dirs))))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "600"  # every secret written, all distinct
    assert not list(tmp_path.glob("r*/.*.tmp"))
