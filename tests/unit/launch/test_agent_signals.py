"""Preemption (docs/design/preemption.md): how the stop signals reach ranks under a launcher agent that would act on them
itself (DeepSpeed's), without a cluster. A stand-in agent behaves as DeepSpeed's two processes
do (launchers/_agent.py): the outer one dies of SIGTERM and of the warning signal, the inner one
kills its workers on SIGTERM and exits 1. Slurm is played by signalling every process of the
tree, as proctrack/linuxproc does, or only the launcher, as the batch shell's warning does."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from detslurm.launch._agent import below, tree_below

# A rank: waits for a stop signal, "checkpoints" for a second (duplicates arrive meanwhile),
# then writes which signal it saw and exits 0.
WORKER = textwrap.dedent(
    """
    import pathlib, signal, sys, time
    out = pathlib.Path(sys.argv[1])
    got = []
    for sig in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, lambda s, f: got.append(s))
    out.with_suffix(".ready").touch()
    deadline = time.time() + 20
    while not got and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    out.write_text(signal.Signals(got[0]).name if got else "none")
    sys.exit(0 if got else 3)
    """
)
# DeepSpeed's launch.py in miniature: on SIGTERM, terminate the workers, wait, and exit 1.
INNER = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    kid = subprocess.Popen([sys.executable, "-m", "detslurm.launch.wrap_rank", "0", "--", *sys.argv[1:]])
    def stop(signum, frame):
        kid.terminate()
        time.sleep(3)  # its wait for the workers (not kid.wait(): the main thread holds that lock)
        sys.exit(1)
    signal.signal(signal.SIGTERM, stop)
    sys.exit(kid.wait())
    """
)
# DeepSpeed's runner in miniature: no handler at all, its child's exit code.
OUTER = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', *sys.argv[1:]]))"
# Our launcher, three ways: "hold" (DeepSpeed's now), "ignore" (torchrun's), "forward" (the old
# _common.run, which DeepSpeed's launcher used).
LAUNCHER = textwrap.dedent(
    """
    import os, sys
    from detslurm.launch._agent import run_agent
    from detslurm.launch._common import run
    mode, cmd = sys.argv[1], sys.argv[2:]
    sys.exit(run(cmd, os.environ) if mode == "forward" else run_agent(cmd, os.environ, mode == "hold"))
    """
)


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / "rank0"
    agent = [sys.executable, "-c", OUTER, INNER, sys.executable, "-c", WORKER, str(out)]
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, mode, *agent])
    deadline = time.monotonic() + 180  # a guard: three Pythons start on a loaded machine first
    while not out.with_suffix(".ready").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the stand-in rank never started"
        time.sleep(0.05)
    return proc, out


def every_process(root: int) -> list[int]:
    """``root`` and everything below it: whom proctrack/linuxproc signals."""
    return [root] + [pid for depth in range(1, 6) for pid in below(root, depth)]


def deliver(proc: subprocess.Popen[bytes], how: str, sig: signal.Signals) -> None:
    for pid in every_process(proc.pid) if how == "every-process" else [proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@pytest.mark.parametrize(
    "how,sig",
    [("every-process", signal.SIGTERM), ("every-process", signal.SIGUSR2), ("launcher-only", signal.SIGUSR2)],
    ids=["preemption", "warning-to-step", "warning-to-launcher"],
)
def test_held_signals_reach_the_rank_and_the_launcher_exits_0(tmp_path: Path, how: str, sig: signal.Signals) -> None:
    proc, out = start(tmp_path, "hold")
    deliver(proc, how, sig)
    assert proc.wait(30) == 0
    assert out.read_text() == sig.name  # the rank saw the stop and finished its "checkpoint"


@pytest.mark.parametrize(
    "mode,sig",
    [("forward", signal.SIGTERM), ("forward", signal.SIGUSR2), ("ignore", signal.SIGTERM)],
    ids=["forward-term", "forward-warning", "ignore-term"],
)
def test_without_holding_the_launcher_reports_a_failure(tmp_path: Path, mode: str, sig: signal.Signals) -> None:
    """Why the signals are held: forwarded, the agent dies of them (the ranks are orphaned, and
    srun kills them with the step); ignored, DeepSpeed's inner process still handles SIGTERM and
    exits 1 after its ranks checkpointed, which counts as the trial's failure."""
    proc, _ = start(tmp_path, mode)
    deliver(proc, "every-process", sig)
    assert proc.wait(30) != 0


def test_a_zombie_is_no_longer_a_child() -> None:
    """A worker killed but not yet reaped (torchrun reaps on its monitor's tick) is gone: the
    launcher must not wait for the agent's next tick to count its workers out."""
    child = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 60
        while Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.02)
        assert child.pid not in below(os.getpid(), 1)
        assert child.pid not in tree_below(os.getpid(), 1)
    finally:
        child.wait()


def test_below_gives_one_generation() -> None:
    code = "import subprocess, sys; subprocess.Popen(['sleep', '30']).wait()"
    child = subprocess.Popen([sys.executable, "-c", code])
    grandchildren: list[int] = []
    try:
        deadline = time.monotonic() + 10
        while not grandchildren:
            assert time.monotonic() < deadline
            time.sleep(0.02)
            grandchildren = below(child.pid, 1)
        (grandchild,) = grandchildren
        assert child.pid in below(os.getpid(), 1) and child.pid not in below(os.getpid(), 2)
        assert grandchild in below(os.getpid(), 2) and grandchild not in below(os.getpid(), 1)
        assert not below(grandchild, 1)
    finally:
        for pid in grandchildren:
            os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait()


# torchrun's failure handling in miniature: workers in sessions of their own under wrap_rank; when
# one fails, SIGTERM the others and wait for them however long they take (torchrun gives 30 s),
# then a teardown that never ends (torchrun's interpreter took up to 25 s on a loaded node).
FAILING_AGENT = textwrap.dedent(
    """
    import subprocess, sys, time
    wrap = [sys.executable, "-m", "detslurm.launch.wrap_rank"]
    workers = [subprocess.Popen([*wrap, str(rank), "--", sys.executable, "-c", code], start_new_session=True)
               for rank, code in enumerate(sys.argv[1:])]
    while all(w.poll() is None for w in workers):
        time.sleep(0.05)
    for w in workers:
        if w.poll() is None:
            w.terminate()
    code = max(abs(w.wait()) for w in workers)
    time.sleep(600)
    sys.exit(code)
    """
)
# A rank stuck in a collective: SIGTERM does nothing, and it has a child of its own.
STUCK = textwrap.dedent(
    """
    import pathlib, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kid = subprocess.Popen(["sleep", "600"])
    pathlib.Path(sys.argv[1]).write_text(f"{kid.pid}")
    time.sleep(600)
    """
)


def test_a_failed_rank_gets_the_stuck_ranks_killed_after_the_grace(tmp_path: Path) -> None:
    pids = tmp_path / "stuck"
    fail = f"import pathlib, sys, time\nwhile not pathlib.Path({str(pids)!r}).exists(): time.sleep(0.05)\nsys.exit(3)"
    launcher = "import os, sys\nfrom detslurm.launch._agent import run_agent\nsys.exit(run_agent(sys.argv[1:], os.environ, grace=0.5))"
    stuck = STUCK.replace("sys.argv[1]", repr(str(pids)))
    proc = subprocess.Popen([sys.executable, "-c", launcher, sys.executable, "-c", FAILING_AGENT, fail, stuck])
    try:
        code = proc.wait(120)  # without the marks it would wait for the stuck rank and the agent for ever
    finally:
        for pid in [proc.pid, *tree_below(proc.pid, 1)]:  # whatever a failure left
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    assert code == 1
    kid = int(pids.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{kid}").exists() and Path(f"/proc/{kid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the stuck rank's own child outlived the job"
        time.sleep(0.05)


def test_wrap_rank_marks_a_failure_and_nothing_else(tmp_path: Path) -> None:
    from detslurm.launch.wrap_rank import FAILED_RANKS_ENV, command

    env = {**os.environ, FAILED_RANKS_ENV: str(tmp_path)}
    assert subprocess.run(command("4", ["sh", "-c", "exit 0"]), env=env).returncode == 0
    assert not list(tmp_path.iterdir())
    assert subprocess.run(command("5", ["sh", "-c", "exit 3"]), env=env).returncode == 3
    (mark,) = tmp_path.iterdir()
    assert mark.read_text() == "5 3\n" and mark.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "overrides,wanted",
    [
        ([], False),
        (["--max_restarts", "0"], False),
        (["--max-restarts=2"], True),
        (["--max_restarts", "3", "--nproc_per_node", "2"], True),
        (["--max_restarts=3", "--max_restarts", "0"], False),  # torchrun keeps the last value
    ],
)
def test_restarts_asked_of_torchrun_leave_failures_to_it(overrides: list[str], wanted: bool) -> None:
    from detslurm.launch.torch_distributed import restarts_requested

    assert restarts_requested(overrides) is wanted


def test_peer_marks_tell_the_other_nodes_of_the_step_only(tmp_path: Path) -> None:
    from detslurm.launch._agent import PeerMarks

    run_dir = tmp_path / "exp/trials/3/runs/1"
    run_dir.mkdir(parents=True)
    env = {"DET_RUN_DIR": str(run_dir), "SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2"}
    node0 = PeerMarks.from_env({**env, "SLURM_NODEID": "0"})
    node1 = PeerMarks.from_env({**env, "SLURM_NODEID": "1"})
    other_step = PeerMarks.from_env({**env, "SLURM_NODEID": "0", "SLURM_STEP_ID": "1"})
    assert node0 and node1 and other_step and not node0.heard()
    node1.tell()
    assert node0.heard() and not node1.heard() and not other_step.heard()
    assert PeerMarks.from_env({**env, "SLURM_STEP_NUM_NODES": "1"}) is None  # nobody to tell
    assert PeerMarks.from_env({**env, "SLURM_STEP_NUM_NODES": "two"}) is None
