"""``core.DistributedContext`` as Determined 0.38.1 has it: its defaults for a context built by
hand, ``from_tf_config`` reading TF_CONFIG, and the ports a launched job's ranks use instead.

``from_tf_config`` runs under both interpreters against a stand-in ``tensorflow`` package (the
tests do not install TensorFlow): the stand-in only names the strategy it was asked for, so the
records compare what each side read from TF_CONFIG and which strategy it chose.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from determined_oracle import SCRIPT_RECORD, oracle_python, record_script

from detslurm.protocol.secret import SECRET_ENV, new_secret

STAND_IN_TF = """
import os

class _Strategy:
    def __init__(self):
        self.kind = type(self).__name__

class distribute:
    class MultiWorkerMirroredStrategy(_Strategy): pass
    class MirroredStrategy(_Strategy): pass
    class _DefaultDistributionStrategy(_Strategy): pass
    @staticmethod
    def get_strategy():
        return distribute._DefaultDistributionStrategy()

class config:
    @staticmethod
    def list_physical_devices(kind):
        return ["gpu"] * int(os.environ.get("STAND_IN_GPUS", "0"))
"""

SCRIPT = (
    r"""
import inspect, json, os, sys
from determined import core
"""
    + SCRIPT_RECORD
    + r"""
def tf(config, gpus="0"):
    os.environ.pop("TF_CONFIG", None)
    if config is not None:
        os.environ["TF_CONFIG"] = config if isinstance(config, str) else json.dumps(config)
    os.environ["STAND_IN_GPUS"] = gpus
    dist, strategy = core.DistributedContext.from_tf_config()
    dist.close()
    return [dist.get_rank(), dist.get_size(), dist.get_local_rank(), dist.get_num_agents(), strategy.kind]

hand = core.DistributedContext(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
out["defaults"] = {k: p.default for k, p in inspect.signature(core.DistributedContext).parameters.items()
                   if p.default is not p.empty}
out["hand"] = [hand.get_rank(), hand.get_size(), hand.get_num_agents()]
out["no_tf_config"] = tf(None)
out["no_tf_config_gpus"] = tf(None, gpus="2")
out["one_worker"] = tf({"cluster": {"worker": ["n1:2222"]}, "task": {"type": "worker", "index": 0}})
attempt("ps_task", lambda: tf({"cluster": {"worker": ["a:1", "b:1"], "ps": ["c:1"]}, "task": {"type": "ps", "index": 0}}))
attempt("chief_task", lambda: tf({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}))
json.dump(out, open(sys.argv[1], "w"), sort_keys=True)
"""
)


def stand_in_env(tmp_path: Path) -> dict[str, str]:
    pkg = tmp_path / "stand-in" / "tensorflow"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(STAND_IN_TF)
    return {**os.environ, "PYTHONPATH": str(pkg.parent)}


def test_defaults_and_from_tf_config_as_determined(tmp_path: Path) -> None:
    env = stand_in_env(tmp_path)
    env.pop("INTER_TRAIN_PROCESS_COMM_PORT_1", None)
    theirs = record_script(oracle_python(), SCRIPT, tmp_path / "determined", env=env)
    ours = record_script(sys.executable, SCRIPT, tmp_path / "detslurm", env=env)
    assert theirs["defaults"] == {
        "chief_ip": None,
        "pub_port": 12360,
        "pull_port": 12376,
        "port_offset": 0,
        "force_tcp": False,
    }
    assert theirs["no_tf_config_gpus"][-1] == "MirroredStrategy" and theirs["ps_task"] == "raised RuntimeError"
    assert ours == theirs


def test_determined_port_variables_set_the_defaults(tmp_path: Path) -> None:
    code = "import inspect; from determined import core; p = inspect.signature(core.DistributedContext).parameters; print(p['pub_port'].default, p['pull_port'].default)"
    env = {**os.environ, "INTER_TRAIN_PROCESS_COMM_PORT_1": "15000"}
    for python in (oracle_python(), sys.executable):
        r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.stdout.split() == ["15000", "15016"], r.stderr


RANK = r"""
import json, os, sys
from determined import core
kind = sys.argv[1]
if kind == "tf":
    dist, strategy = core.DistributedContext.from_tf_config()
else:
    dist = core.DistributedContext.from_torch_distributed()
print(json.dumps({"rank": dist.get_rank(), "size": dist.get_size(), "port": dist.pub_port,
                  "all": dist.allgather(dist.get_rank())}), flush=True)
dist.close()
"""


def run_two_ranks(kind: str, env_of: Any, tmp_path: Path) -> list[dict[str, Any]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, kind], env=env_of(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    return [json.loads(o[0].strip().splitlines()[-1]) for o in outs]


def test_launched_ranks_use_the_launchers_port_not_determineds(tmp_path: Path) -> None:
    """Several trials may share a Slurm node: a fixed port would collide, so the framework
    constructors take the port the launcher chose (DETSLURM_DIST_PORT). Determined's default
    port is held by someone else here and the group still forms."""
    with socket.socket() as taken, socket.socket() as chosen:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        chosen.bind(("127.0.0.1", 0))
        port = chosen.getsockname()[1]
        chosen.close()
        base = {
            **stand_in_env(tmp_path),
            "INTER_TRAIN_PROCESS_COMM_PORT_1": str(taken.getsockname()[1]),  # Determined's default: taken
            "DETSLURM_DIST_PORT": str(port),
            SECRET_ENV: new_secret().hex(),
        }
        torch_env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}
        got = run_two_ranks("torch", lambda r: {**base, **torch_env, "RANK": str(r), "LOCAL_RANK": str(r)}, tmp_path)
        assert got == [{"rank": r, "size": 2, "port": port, "all": [0, 1]} for r in range(2)]
        # TF_CONFIG of two workers: one rank per node, the chief the first worker's host.
        workers = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}}
        got = run_two_ranks(
            "tf",
            lambda r: {**base, "TF_CONFIG": json.dumps({**workers, "task": {"type": "worker", "index": r}})},
            tmp_path,
        )
        assert got == [{"rank": r, "size": 2, "port": port, "all": [0, 1]} for r in range(2)]


def test_from_tf_config_without_tensorflow_names_what_to_install(tmp_path: Path) -> None:
    code = "from determined import core\ncore.DistributedContext.from_tf_config()"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "needs TensorFlow in the trial's environment (pip install tensorflow)" in r.stderr
