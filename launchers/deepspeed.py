"""``python -m detslurm.launch.deepspeed [DEEPSPEED_ARGS... --] (--trial T | SCRIPT...)``

Runs DeepSpeed's launcher once per node, without ssh: a hostfile ``host slots=N`` built from
the job's node list, ``--no_ssh --node_rank <this node>`` (each node starts its own workers),
the first node as master, and a master port published by the chief (no collisions between jobs
sharing a node). Workers are wrapped by wrap_rank, so logs carry ``[rank=N]``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from detslurm import settings
from detslurm.launch import wrap_rank
from detslurm.launch._agent import run_agent
from detslurm.launch._common import LaunchError, Nodes, fail, help_requested, prepare, run_secret_env


def hostfile_text(nodes: Nodes) -> str:
    # DeepSpeed's hostfile format; every node gets the same slot count because the sbatch
    # request asks for equal tasks/GPUs per node.
    return "".join(f"{host} slots={nodes.slots}\n" for host in nodes.hosts)


def write_hostfile(directory: Path, nodes: Nodes) -> Path:
    """The hostfile, 0600 under a fresh random name in ``directory`` (the trial's private
    working dir): a predictable name there could have been a planted symlink."""
    fd, name = tempfile.mkstemp(prefix="hostfile-", suffix=".txt", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(hostfile_text(nodes))
    return Path(name)


def build_deepspeed_cmd(
    nodes: Nodes,
    hostfile: str,
    master_port: int,
    overrides: Sequence[str],
    script: Sequence[str],
    python: str = sys.executable,
) -> list[str]:
    """Pure: the deepspeed launcher command for this node."""
    master = "127.0.0.1" if nodes.nnodes == 1 else nodes.chief
    return [
        python,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        hostfile,
        # No ssh between nodes (clusters rarely allow it): srun already started this launcher on
        # every node, and --node_rank tells each which part it is.
        "--no_ssh",
        "--node_rank",
        str(nodes.node_rank),
        "--master_addr",
        master,
        "--master_port",
        str(master_port),
        *overrides,
        # --no_python/--no_local_rank: DeepSpeed runs our command as given (wrap_rank, then the
        # script) instead of prefixing python and appending --local_rank to the user's argv.
        "--no_python",
        "--no_local_rank",
        *wrap_rank.command("RANK", script, python),
    ]


def launch_env(env: Mapping[str, str], nodes: Nodes, dist_port: int, hostfile: str) -> dict[str, str]:
    out = dict(env)
    # Read by the harness to derive torch.distributed's variables from DeepSpeed's.
    out["USE_DEEPSPEED"] = "1"
    out["DET_CHIEF_IP"] = nodes.chief
    out["DET_DEEPSPEED_HOSTFILE_PATH"] = hostfile
    out[settings.DIST_PORT.name] = str(dist_port)
    # DeepSpeed's CPU accelerator counts NUMA nodes as devices unless told the local size.
    out.setdefault("LOCAL_SIZE", str(nodes.slots))
    return out


def main(argv: Sequence[str]) -> int:
    if help_requested(argv, __doc__):
        return 0
    try:
        overrides, script, nodes, ports = prepare(argv, os.environ)
        secret = run_secret_env(os.environ, nodes)
    except LaunchError as e:
        return fail(str(e))
    # The cwd is the trial's private working dir (exec/workdir.py), so the file needs no
    # cleanup of its own: the dir is removed at the end of the run.
    hostfile = write_hostfile(Path.cwd(), nodes)
    cmd = build_deepspeed_cmd(nodes, str(hostfile), ports["master"], overrides, script)
    # Not _common.run: DeepSpeed's launcher acts on SIGTERM itself and dies of the warning
    # signal, killing or orphaning ranks that are still checkpointing; the stop signals are held
    # from it and go to the ranks (launchers/_agent.py says how and why).
    env = {**launch_env(os.environ, nodes, ports["dist"], str(hostfile)), **secret}
    return run_agent(cmd, env, hold_stop_signals=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
