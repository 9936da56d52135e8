"""exec.launch runs our own torch_distributed launcher as a fork of itself (detslurm/exec/forked.py):
only where a fresh interpreter would run exactly our module, and with what the fresh process would
have (session, cwd, environment, exit code); stop signals still reach the ranks through it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from detslurm.exec import forked
from detslurm.exec.launch import COMPAT_DIR

TD = "determined.launch.torch_distributed"


def _env(**extra: str) -> dict[str, str]:
    # What child_env gives an entrypoint: this interpreter's dir first on PATH, the shim on PYTHONPATH.
    return {"PATH": str(Path(sys.executable).parent) + os.pathsep + os.defpath, **extra}


def test_our_launcher_runs_in_a_fork(tmp_path: Path) -> None:
    env = _env(PYTHONPATH=f"{tmp_path}{os.pathsep}{COMPAT_DIR}")
    for module in (TD, "detslurm.launch.torch_distributed"):
        main = forked.launcher_for([sys.executable, "-m", module, "x.py"], env, tmp_path, COMPAT_DIR, False)
        assert main is not None and main.__module__ == "detslurm.launch.torch_distributed"
    # `python3` as the entrypoint writes it: found on PATH, the same interpreter.
    name = Path(sys.executable).name
    assert forked.launcher_for([name, "-m", TD, "x.py"], env, tmp_path, COMPAT_DIR, False) is not None


@pytest.mark.parametrize(
    "case",
    [
        "other-module",
        "interpreter-flag",
        "other-interpreter",
        "other-venv",
        "user-determined",
        "relative-pythonpath",
        "user-detslurm",
        "user-detslurm-under-determined",
        "real-determined",
    ],
)
def test_anything_else_gets_a_fresh_interpreter(tmp_path: Path, case: str) -> None:
    work, user = tmp_path / "work", tmp_path / "user"
    work.mkdir()
    user.mkdir()
    env = _env(PYTHONPATH=f"{work}{os.pathsep}{COMPAT_DIR}")
    argv = [sys.executable, "-m", TD, "x.py"]
    real = False
    if case == "other-module":
        argv[2] = "determined.launch.horovod"
    elif case == "interpreter-flag":
        argv.insert(1, "-X")
    elif case == "other-interpreter":
        argv[0] = "/bin/sh"
    elif case == "user-determined":  # a vendored determined in the context shadows the shim
        (work / "determined").mkdir()
        (work / "determined" / "__init__.py").write_text("")
    elif case == "other-venv":  # a venv of the same base Python: the same binary, its own packages
        venv_bin = tmp_path / "trainenv" / "bin"
        venv_bin.mkdir(parents=True)
        (venv_bin / "python").symlink_to(os.path.realpath(sys.executable))
        argv[0] = str(venv_bin / "python")
    elif case == "relative-pythonpath":  # relative to the fresh interpreter's cwd, the workdir
        (work / "lib" / "determined").mkdir(parents=True)
        (work / "lib" / "determined" / "__init__.py").write_text("")
        env["PYTHONPATH"] = f"lib{os.pathsep}{COMPAT_DIR}"
    elif case == "user-detslurm-under-determined":  # our determined imports the user's detslurm
        (user / "detslurm").mkdir()
        (user / "detslurm" / "__init__.py").write_text("")
        env["PYTHONPATH"] = f"{user}{os.pathsep}{COMPAT_DIR}"
    elif case == "user-detslurm":  # ...and a detslurm on the user's PYTHONPATH shadows ours
        argv[2] = "detslurm.launch.torch_distributed"
        (user / "detslurm").mkdir()
        (user / "detslurm" / "__init__.py").write_text("")
        env["PYTHONPATH"] = f"{work}{os.pathsep}{user}"
    elif case == "real-determined":  # installed: no shim on PYTHONPATH, theirs wins
        env["PYTHONPATH"] = str(work)
        real = True
    assert forked.launcher_for(argv, env, work, COMPAT_DIR, real) is None


def _report(argv: Sequence[str]) -> int:
    """Stands in for a launcher's main(): writes what a fresh process would see."""
    out = Path(os.environ["OUT"])
    facts = {
        "argv": list(argv),
        "cwd": os.getcwd(),
        "sid": os.getsid(0),
        "pid": os.getpid(),
        "env": os.environ.get("X"),
    }
    out.write_text(json.dumps(facts))
    if argv[:1] == ["raise"]:
        raise RuntimeError("boom")
    if argv[:1] == ["exit"]:
        sys.exit(int(argv[1]))
    return 7


def test_the_fork_is_a_session_leader_with_the_entrypoint_s_cwd_env_and_code(tmp_path: Path) -> None:
    out = tmp_path / "facts.json"
    env = {"OUT": str(out), "X": "1"}
    child = forked.start(_report, ["py", "-m", TD, "a", "b"], tmp_path, env)
    assert child.wait(30) == 7
    facts = json.loads(out.read_text())
    assert facts == {"argv": ["a", "b"], "cwd": str(tmp_path), "sid": child.pid, "pid": child.pid, "env": "1"}
    assert os.environ.get("OUT") is None  # our own environment is untouched
    assert forked.start(_report, ["py", "-m", TD, "exit", "3"], tmp_path, env).wait(30) == 3
    assert forked.start(_report, ["py", "-m", TD, "raise"], tmp_path, env).wait(30) == 1


def test_wait_with_a_timeout_raises_as_popen_does(tmp_path: Path) -> None:
    child = forked.start(_sleep, ["py", "-m", TD], tmp_path, {})
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM


def _sleep(_argv: Sequence[str]) -> int:
    time.sleep(30)
    return 0


# A rank that waits for SIGTERM, "checkpoints", and exits 0 (what a preempted trial does).
RANK = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    pathlib.Path("ready").touch()
    deadline = time.time() + 60
    while not got and time.time() < deadline:
        time.sleep(0.05)
    pathlib.Path(os.environ["OUT"]).write_text("stopped" if got else "timeout")
    sys.exit(0 if got else 3)
    """
)


def test_sigterm_to_exec_launch_reaches_the_rank_through_the_forked_launcher(tmp_path: Path) -> None:
    """The whole path on one node: exec.launch -> forked torch_distributed -> torchrun -> wrap_rank
    -> rank. SIGTERM to exec.launch (as a local stop or the batch shell's relay sends it) reaches
    the rank, which exits 0 after its "checkpoint"; the exit record says 0."""
    pytest.importorskip("torch")
    exp = tmp_path / "exp"
    run_dir = exp / "trials" / "1" / "runs" / "1"
    run_dir.mkdir(parents=True)
    (tmp_path / "rank.py").write_text(RANK)
    with tarfile.open(exp / "context.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "rank.py", arcname="rank.py")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(
        os.environ,
        DETSLURM_EXP_DIR=str(exp),
        DET_TRIAL_ID="1",
        DET_TRIAL_RUN_ID="1",
        DET_RUN_DIR=str(run_dir),
        DET_EXPERIMENT_CONFIG=json.dumps({"entrypoint": f"python3 -m {TD} python3 rank.py"}),
        DET_CONTAINER_ADDRS='["127.0.0.1"]',
        DET_SLOT_IDS="[0]",
        DETSLURM_WORKDIR=str(work),
        OUT=str(tmp_path / "rank.out"),
    )
    proc = subprocess.Popen([sys.executable, "-m", "detslurm.exec.launch"], cwd=run_dir, env=env)
    deadline = time.monotonic() + 120
    while not (work / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the rank never started"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert (tmp_path / "rank.out").read_text() == "stopped"
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 0
