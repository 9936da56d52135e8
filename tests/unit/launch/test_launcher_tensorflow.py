"""``determined.launch.tensorflow``: TF_CONFIG for every node from the job's node list, the script
run once per node, and ``DistributedContext.from_tf_config()`` joining on the launcher's ports.

TensorFlow is not installed for the tests: the scripts use a stand-in ``tensorflow`` package that
only names the strategy asked for (the launcher never imports TensorFlow itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from detslurm.launch._common import LaunchError, Nodes
from detslurm.launch.tensorflow import launch_env, parse_args
from detslurm.protocol import RunPaths

STAND_IN_TF = """
class _S:
    pass
class distribute:
    class MultiWorkerMirroredStrategy(_S): pass
    class MirroredStrategy(_S): pass
    @staticmethod
    def get_strategy():
        return _S()
class config:
    @staticmethod
    def list_physical_devices(kind):
        return []
"""

# What each node's process saw: its TF_CONFIG, and the ranks a DistributedContext from it joined.
SCRIPT = """
import json, os
from determined import core
dist, strategy = core.DistributedContext.from_tf_config()
seen = {"tf_config": json.loads(os.environ.get("TF_CONFIG", "null")), "strategy": type(strategy).__name__,
        "ranks": dist.allgather(dist.get_rank())}
print("SEEN " + json.dumps(seen), flush=True)
dist.close()
"""


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ("python3 train.py", (None, ["python3", "train.py"])),
        ("-- python3 train.py --port 1", (None, ["python3", "train.py", "--port", "1"])),
        ("--port 2222 python3 train.py", (2222, ["python3", "train.py"])),
        ("--port=2222 -- python3 train.py", (2222, ["python3", "train.py"])),
    ],
)
def test_parse_args(argv: str, expected: tuple[int | None, list[str]]) -> None:
    assert parse_args(argv.split()) == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("", "empty script is not allowed"),
        ("--port 2222", "empty script is not allowed"),
        ("--port x python3 t.py", "--port: expected a port number, got 'x'"),
        ("--trial model_def:T", "unrecognized arguments: --trial"),
    ],
)
def test_parse_args_refuses_with_a_message(argv: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        parse_args(argv.split())


def test_launch_env_gives_tf_config_on_several_nodes_only() -> None:
    two = Nodes(["c1", "c2"], 1, 4)
    env = launch_env({"TF_CONFIG": "stale"}, two, {"tf": 2222, "dist": 3333})
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"worker": ["c1:2222", "c2:2222"]},
        "task": {"type": "worker", "index": 1},
    }
    assert env["DETSLURM_DIST_PORT"] == "3333" and env["DET_CHIEF_IP"] == "c1"
    one = launch_env({"TF_CONFIG": "stale"}, Nodes(["c1"], 0, 4), {})
    assert "TF_CONFIG" not in one and "DETSLURM_DIST_PORT" not in one


def launcher(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "determined.launch.tensorflow", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def seen(out: str) -> dict[str, Any]:
    line = next(x for x in out.splitlines() if "SEEN " in x)
    return dict(json.loads(line.split("SEEN ", 1)[1]))


def job_env(tmp_path: Path, hosts: list[str], rank: int) -> dict[str, str]:
    stand_in = tmp_path / "stand-in" / "tensorflow"
    stand_in.mkdir(parents=True, exist_ok=True)
    (stand_in / "__init__.py").write_text(STAND_IN_TF)
    run = RunPaths(tmp_path, 1, 1).dir
    run.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "PYTHONPATH": str(stand_in.parent),
        "DET_CONTAINER_ADDRS": json.dumps(hosts),
        "DET_CONTAINER_RANK": str(rank),
        "DETSLURM_EXP_DIR": str(tmp_path),
        "DET_TRIAL_ID": "1",
        "DET_TRIAL_RUN_ID": "1",
        "DET_RUN_DIR": str(run),
        "SLURM_JOB_ID": "41",
        "SLURM_STEP_ID": "0",
    }


def test_two_nodes_get_one_tf_config_each_and_form_one_group(tmp_path: Path) -> None:
    """Two launchers as srun starts them, one per node (both on this host): each script sees the
    workers in node order and its own index, with the port the first node chose."""
    hosts = ["127.0.0.1", "127.0.0.1"]
    procs = [launcher([sys.executable, "-c", SCRIPT], job_env(tmp_path, hosts, r)) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    got = [seen(o[0]) for o in outs]
    port = got[0]["tf_config"]["cluster"]["worker"][0].rpartition(":")[2]
    for rank, g in enumerate(got):
        assert g["tf_config"] == {
            "cluster": {"worker": [f"127.0.0.1:{port}"] * 2},
            "task": {"type": "worker", "index": rank},
        }
        assert g["strategy"] == "MultiWorkerMirroredStrategy" and g["ranks"] == [0, 1]
    assert all(line.startswith("[rank=1] ") for line in outs[1][0].splitlines() if line)


def test_one_node_runs_the_script_without_tf_config(tmp_path: Path) -> None:
    env = {**job_env(tmp_path, ["127.0.0.1"], 0), "TF_CONFIG": '{"stale": 1}'}
    p = launcher(["--port", "2222", sys.executable, "-c", SCRIPT], env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert seen(out) == {"tf_config": None, "strategy": "_S", "ranks": [0]}
    failing = launcher([sys.executable, "-c", "raise SystemExit(7)"], env)
    assert failing.wait(timeout=120) == 7  # the script's exit code is the launcher's


def test_usage_and_bad_arguments_are_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "determined.launch.tensorflow", "-h"], capture_output=True, text=True)
    assert r.returncode == 0 and "tensorflow [--port PORT] [--] SCRIPT..." in r.stdout
    r = subprocess.run([sys.executable, "-m", "determined.launch.tensorflow", "--port"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--port" in r.stderr
