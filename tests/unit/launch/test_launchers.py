"""Launchers: argument vectors, literal commands, wrap_rank, rendezvous ports (no cluster)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from detslurm.launch import _common, wrap_rank
from detslurm.launch._common import LaunchError, Nodes, nodes_from_env, parse_args, rendezvous_ports
from detslurm.launch.torch_distributed import build_torchrun_cmd
from detslurm.launch.wrap_rank import resolve_rank, split_lines
from detslurm.protocol import RunPaths

# Where the launchers' workers find wrap_rank: its file, run by path (launchers/wrap_rank.py says why).
WRAP_RANK_FILE = os.path.abspath(wrap_rank.__file__)


@pytest.mark.parametrize(
    "argv,expected",
    [
        ("script arg", ([], ["script", "arg"])),
        ("override1 override2 -- script arg", (["override1", "override2"], ["script", "arg"])),
        ("-- script -- arg", ([], ["script", "--", "arg"])),
        ("--rdzv_endpoint=x -- python3 train.py --lr 1", (["--rdzv_endpoint=x"], ["python3", "train.py", "--lr", "1"])),
    ],
)
def test_parse_vectors(argv: str, expected: tuple[list[str], list[str]]) -> None:
    assert parse_args(argv.split()) == expected


def test_parse_trial_and_errors() -> None:
    overrides, script = parse_args(["--nproc_per_node=1", "--", "--trial", "model_def:MyTrial"])
    assert overrides == ["--nproc_per_node=1"] and script[-3:] == ["-m", "detslurm.exec.harness", "model_def:MyTrial"]
    with pytest.raises(LaunchError, match="extra arguments to --trial"):
        parse_args(["--trial", "model_def:MyTrial", "script.py"])
    with pytest.raises(LaunchError, match="empty script is not allowed"):
        parse_args(["x", "--"])
    with pytest.raises(LaunchError, match="unrecognized arguments: --bogus"):
        parse_args(["--bogus", "script.py"])


def test_torchrun_command_literal() -> None:
    nodes = Nodes(hosts=["c1", "c2"], node_rank=1, slots=2)
    assert build_torchrun_cmd(nodes, 41000, ["--log-dir=x"], ["python3", "t.py"], python="PY") == [
        "PY",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "2",
        "--node_rank",
        "1",
        "--max_restarts",
        "0",
        "--master_addr",
        "c1",
        "--master_port",
        "41000",
        "--log-dir=x",
        "--no-python",
        "PY",
        "-S",
        "-u",
        WRAP_RANK_FILE,
        "RANK",
        "--",
        "python3",
        "t.py",
    ]
    single = build_torchrun_cmd(Nodes(["127.0.0.1"], 0, 4), 5, [], ["s"], python="PY")
    assert single[single.index("--master_addr") + 1] == "localhost" and "4" in single


def test_nodes_from_slurm_env() -> None:
    n = nodes_from_env({"SLURM_JOB_NODELIST": "c[1-2]", "SLURM_NODEID": "1", "DET_SLOT_IDS": "[0, 1]"})
    assert (n.hosts, n.node_rank, n.slots, n.chief, n.is_chief) == (["c1", "c2"], 1, 2, "c1", False)
    with pytest.raises(LaunchError):
        nodes_from_env({"SLURM_JOB_NODELIST": "c1", "SLURM_NODEID": "3"})


@pytest.fixture(autouse=True)
def held_ports(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[socket.socket]]:
    """The ports a test's launcher code holds (launch._common._HELD), closed after the test, as
    a launcher's are when it exits."""
    held: list[socket.socket] = []
    monkeypatch.setattr(_common, "_HELD", held, raising=False)
    yield held
    for s in held:
        s.close()


def test_rendezvous_ports_published_by_chief(tmp_path: Path) -> None:
    RunPaths(tmp_path, 1, 1).dir.mkdir(parents=True)
    env = {"DETSLURM_EXP_DIR": str(tmp_path), "DET_TRIAL_ID": "1", "DET_TRIAL_RUN_ID": "1"}
    env |= {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    chief = rendezvous_ports(Nodes(["127.0.0.1", "127.0.0.2"], 0, 1), env, ["master", "dist"])
    other = rendezvous_ports(Nodes(["127.0.0.1", "127.0.0.2"], 1, 1), env, ["master", "dist"])
    assert chief == other and chief["master"] != chief["dist"]
    assert rendezvous_ports(
        Nodes(["a", "b"], 1, 1), {**env, "SLURM_STEP_RESV_PORTS": "12000-12001"}, ["master", "dist"]
    ) == {"master": 12000, "dist": 12001}
    with pytest.raises(LaunchError, match="did not publish"):
        rendezvous_ports(Nodes(["a", "b"], 1, 1), {**env, "SLURM_JOB_ID": "8"}, ["m"], timeout_s=0.2)


@pytest.mark.parametrize("hosts", [["127.0.0.1"], ["127.0.0.1", "127.0.0.2"]])
def test_the_dist_port_stays_ours_until_rank_0_listens_on_it(tmp_path: Path, hosts: list[str]) -> None:
    """The Core API's port is held bound by the launcher: nobody else can take it in the
    seconds before rank 0 binds it (CI once saw "Address already in use" there), and rank 0's
    own listener still binds and serves it. torch's master port is not held (its store may bind
    without SO_REUSEADDR)."""
    from detslurm.core._wire import _listen

    RunPaths(tmp_path, 1, 1).dir.mkdir(parents=True)
    env = {"DETSLURM_EXP_DIR": str(tmp_path), "DET_TRIAL_ID": "1", "DET_TRIAL_RUN_ID": "1", "SLURM_JOB_ID": "9"}
    ports = rendezvous_ports(Nodes(hosts, 0, 1), env, ["master", "dist"])
    other = socket.socket()
    with pytest.raises(OSError, match="Address already in use"):
        other.bind(("127.0.0.1", ports["dist"]))  # a plain bind, as another program's
    other.close()
    with socket.create_server(("127.0.0.1", ports["master"])):
        pass  # not held: free for torch's store
    listener = _listen(("127.0.0.1", ports["dist"]), socket.AF_INET, 4)
    with listener, socket.create_connection(("127.0.0.1", ports["dist"])):
        listener.accept()[0].close()


def test_split_lines_cr_and_long() -> None:
    lines, rest = split_lines(b"line with lf\nline with cr\rpartial")
    assert lines == [b"line with lf\n", b"line with cr\n"] and rest == b"partial"
    long_lines, _ = split_lines(b"x" * 20000 + b"\n")
    assert len(long_lines) == 3 and all(len(x) <= 8192 for x in long_lines)


def test_resolve_rank() -> None:
    assert resolve_rank("3", {}) == "3"
    assert resolve_rank("HOROVOD_RANK,RANK", {"RANK": "5"}) == "5"
    assert resolve_rank("A,B", {}) is None


def wrap(*args: str, **kw: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "detslurm.launch.wrap_rank", *args], capture_output=True, **kw)  # type: ignore[call-overload]


def test_wrap_rank_prefixes_and_exit_code() -> None:
    r = wrap(
        "0",
        "--",
        sys.executable,
        "-c",
        "import sys; sys.stdout.write('line with lf\\nline with cr\\r'); sys.stderr.write('err\\n'); sys.exit(7)",
    )
    assert r.returncode == 7
    assert r.stdout == b"[rank=0] line with lf\n[rank=0] line with cr\n" and r.stderr == b"[rank=0] err\n"
    assert wrap("NOPE_RANK", "true").returncode == 1


def test_wrap_rank_forwards_signals() -> None:
    code = "import signal,sys,time; signal.signal(signal.SIGTERM, lambda *a: (print('got term', flush=True), sys.exit(5))); print('ready', flush=True); time.sleep(30)"
    p = subprocess.Popen(
        [sys.executable, "-m", "detslurm.launch.wrap_rank", "2", sys.executable, "-c", code], stdout=subprocess.PIPE
    )
    assert p.stdout is not None and p.stdout.readline() == b"[rank=2] ready\n"
    p.send_signal(signal.SIGTERM)
    t0 = time.time()
    assert p.wait(600) == 5 and time.time() - t0 < 20  # the trial sleeps 30 s
    assert p.stdout.read() == b"[rank=2] got term\n"


def test_wrap_rank_as_the_launchers_start_it_needs_only_the_standard_library() -> None:
    """The launchers run wrap_rank.py by path under ``python -S``; with -I as well (no PYTHONPATH,
    no user site) nothing of detslurm is importable, so this passes only while it imports nothing
    of ours. Output, exit code and signals behave as under ``-m``."""
    code = (
        "import signal,sys,time; signal.signal(signal.SIGTERM, lambda *a: (print('got term', flush=True), sys.exit(5)));"
        " sys.stderr.write('err\\n'); print('ready', flush=True); time.sleep(30)"
    )
    cmd = wrap_rank.command("RANK", [sys.executable, "-c", code])
    assert cmd[1:3] == ["-S", "-u"]
    p = subprocess.Popen(
        [cmd[0], "-I", *cmd[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, RANK="3")
    )
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.readline() == b"[rank=3] ready\n"
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 5
    assert p.stdout.read() == b"[rank=3] got term\n" and p.stderr.read() == b"[rank=3] err\n"


def test_no_launcher_module_shadows_the_standard_library() -> None:
    """Run by path, wrap_rank has the launchers' dir first on sys.path: a module there named like
    a standard one (signal.py, threading.py) would replace it in every worker's wrapper."""
    here = Path(wrap_rank.__file__).parent
    assert not {p.stem for p in here.glob("*.py")} & set(sys.stdlib_module_names)


def test_rank_filter_in_trial_logs(det, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from conftest import write

    write(tmp_path / "ctx/two.py", "import os\nprint('hello from', os.environ['WRAP'])\n")
    cfg = write(
        tmp_path / "c.yaml",
        "searcher: {name: single, metric: m}\nentrypoint: >-\n"
        "  sh -c 'WRAP=a python3 -m determined.launch.wrap_rank 0 python3 two.py;\n"
        "  WRAP=b python3 -m determined.launch.wrap_rank 1 python3 two.py'\n",
    )
    assert det("e", "create", "--local", cfg, tmp_path / "ctx")[0] == 0
    code, out, _ = det("t", "logs", "1", "--rank-id", "1")
    assert code == 0 and out.strip() == "[rank=1] hello from b"
    json.dumps(out)


def test_deepspeed_command_and_hostfile() -> None:
    from detslurm.launch.deepspeed import build_deepspeed_cmd, hostfile_text

    nodes = Nodes(hosts=["c1", "c2"], node_rank=1, slots=2)
    assert hostfile_text(nodes) == "c1 slots=2\nc2 slots=2\n"
    assert build_deepspeed_cmd(nodes, "/hf", 41000, ["--bind_cores_to_rank"], ["python3", "t.py"], python="PY") == [
        "PY",
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        "/hf",
        "--no_ssh",
        "--node_rank",
        "1",
        "--master_addr",
        "c1",
        "--master_port",
        "41000",
        "--bind_cores_to_rank",
        "--no_python",
        "--no_local_rank",
        "PY",
        "-S",
        "-u",
        WRAP_RANK_FILE,
        "RANK",
        "--",
        "python3",
        "t.py",
    ]


def test_horovod_worker_env_and_mpi_cmd() -> None:
    from detslurm.launch.horovod import mpi_cmd, worker_env

    nodes = Nodes(hosts=["c1", "c2"], node_rank=1, slots=2)
    env = worker_env({"X": "1"}, nodes, 1, "c1", 5000, "lo")
    assert {
        k: env[k]
        for k in (
            "HOROVOD_RANK",
            "HOROVOD_SIZE",
            "HOROVOD_LOCAL_RANK",
            "HOROVOD_CROSS_RANK",
            "HOROVOD_HOSTNAME",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR",
            "HOROVOD_GLOO_IFACE",
        )
    } == {
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_HOSTNAME": "c2",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "c1",
        "HOROVOD_GLOO_IFACE": "lo",
    }
    cmd = mpi_cmd(nodes, ["--mpi", "-x", "FOO"], ["python3", "t.py"], python="PY")
    assert cmd[:8] == ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4", "-H", "c1:2,c2:2", "-bind-to"]
    assert "--mpi" not in cmd and "FOO" in cmd
    assert cmd[-4:] == ["OMPI_COMM_WORLD_RANK,PMI_RANK", "--", "python3", "t.py"]


def test_supervise_stops_the_rest_when_one_fails() -> None:
    from detslurm.launch._common import supervise

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    failing = [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)"]
    procs = [subprocess.Popen(c, start_new_session=True) for c in (sleeper, failing, sleeper)]
    t0 = time.time()
    assert supervise(procs, grace_s=2) == 3
    assert time.time() - t0 < 30 and all(p.poll() is not None for p in procs)  # they sleep 60 s
    ok = [subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True) for _ in range(3)]
    assert supervise(ok) == 0
    stubborn = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
    ]
    procs = [subprocess.Popen(c, start_new_session=True) for c in (stubborn, failing)]
    t0 = time.time()
    assert supervise(procs, grace_s=1) == 3 and time.time() - t0 < 30  # SIGKILL after the grace, not 60 s


def test_run_secret_env_one_node_is_fresh_and_random() -> None:
    from detslurm.launch._common import run_secret_env
    from detslurm.protocol.secret import SECRET_ENV, secret_from_env

    one = Nodes(["127.0.0.1"], 0, 2)
    a, b = run_secret_env({"DET_ALLOCATION_ID": "exp-1-trial-1-run-1"}, one), run_secret_env({}, one)
    assert set(a) == {SECRET_ENV} and len(secret_from_env(a)) == 32 and a != b


def test_run_secret_env_across_nodes_shares_one_private_file(tmp_path: Path) -> None:
    import os
    import stat

    from detslurm.launch._common import run_secret_env
    from detslurm.protocol.secret import SECRET_FILE_ENV, read_run_secret, write_run_secret

    env = {"DET_RUN_DIR": str(tmp_path), "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    chief = run_secret_env(env, Nodes(["c1", "c2"], 0, 1))
    other = run_secret_env(env, Nodes(["c1", "c2"], 1, 1))
    path = Path(chief[SECRET_FILE_ENV])
    assert chief == other and path.parent == tmp_path and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(read_run_secret(path)) == 32
    with pytest.raises(LaunchError, match="did not create the run secret"):
        run_secret_env({**env, "SLURM_JOB_ID": "8"}, Nodes(["c1", "c2"], 1, 1), timeout_s=0.2)
    # A file the login node named is checked before any rank starts: a readable one fails the launch.
    given = write_run_secret(tmp_path)
    assert run_secret_env({SECRET_FILE_ENV: str(given)}, Nodes(["c1", "c2"], 1, 1)) == {}
    os.chmod(given, 0o644)
    with pytest.raises(LaunchError, match="mode 644: it must be 600"):
        run_secret_env({SECRET_FILE_ENV: str(given)}, Nodes(["c1"], 0, 1))


def test_mpi_cmd_exports_secret_names_never_values() -> None:
    from detslurm.launch.horovod import mpi_cmd

    cmd = mpi_cmd(Nodes(["c1"], 0, 2), ["--mpi"], ["t.py"], python="PY", exported=["DETSLURM_DIST_SECRET"])
    i = cmd.index("DETSLURM_DIST_SECRET")
    assert cmd[i - 1] == "-x" and not any(a.startswith("DETSLURM_DIST_SECRET=") for a in cmd)


def test_wrap_rank_refuses_a_missing_script_cleanly() -> None:
    import subprocess
    import sys

    env = dict(__import__("os").environ, RANK="0")
    for argv, code, needle in (
        (["RANK", "--"], 2, "no script to run"),
        (["RANK", "--", "/nonexistent/prog"], 127, "cannot run '/nonexistent/prog'"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "detslurm.launch.wrap_rank", *argv], capture_output=True, text=True, env=env
        )
        assert r.returncode == code and needle in r.stderr and "Traceback" not in r.stderr
