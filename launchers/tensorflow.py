"""``python -m detslurm.launch.tensorflow [--port PORT] [--] SCRIPT...``

Determined's launcher for TensorFlow: the script runs once per node of the trial's allocation
(a TensorFlow strategy drives every GPU of its node from one process). On several nodes each
node's process gets ``TF_CONFIG`` for MultiWorkerMirroredStrategy: every node a worker at
``host:PORT``, in the job's node order, this node's index its place in that order
(``SLURM_NODEID``). On one node there is no ``TF_CONFIG`` (MirroredStrategy, or the default
strategy), as in Determined. ``DistributedContext.from_tf_config()`` reads it.

PORT is ``--port``, else a port the first node found free and published for the others (other
jobs may share the nodes; Determined's fixed default, 29400, could be taken), the same on every
node. The Core API's own port is chosen the same way and handed over as ``DETSLURM_DIST_PORT``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence

from detslurm import settings
from detslurm.launch import wrap_rank
from detslurm.launch._common import (
    LaunchError,
    Nodes,
    fail,
    help_requested,
    nodes_from_env,
    rendezvous_ports,
    run,
    run_secret_env,
)


def parse_args(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """Pure: ``[--port PORT] [--] SCRIPT...`` -> (port or None, script)."""
    args, port = list(argv), None
    if args and (args[0] == "--port" or args[0].startswith("--port=")):
        value = args[0].partition("=")[2] if "=" in args[0] else (args[1] if len(args) > 1 else "")
        args = args[1:] if "=" in args[0] else args[2:]
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise LaunchError(f"--port: expected a port number, got {value!r}")
        port = int(value)
    if args[:1] == ["--"]:
        args = args[1:]
    if args and args[0].startswith("-"):
        raise LaunchError(f"unrecognized arguments: {args[0]} (usage: tensorflow [--port PORT] [--] SCRIPT...)")
    if not args:
        raise LaunchError("empty script is not allowed")
    return port, args


def tf_config(nodes: Nodes, port: int) -> str:
    """Pure: this node's TF_CONFIG: every node a worker, this one at its place in the node list."""
    workers = [f"{host}:{port}" for host in nodes.hosts]
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": nodes.node_rank}})


def launch_env(env: Mapping[str, str], nodes: Nodes, ports: Mapping[str, int]) -> dict[str, str]:
    """Pure: the script's environment on this node (``ports``: "tf" and "dist", several nodes only)."""
    out = dict(env)
    out["DET_CHIEF_IP"] = nodes.chief
    out.pop("TF_CONFIG", None)  # one node: none, even if the job's environment carried one
    if nodes.nnodes > 1:
        out["TF_CONFIG"] = tf_config(nodes, ports["tf"])
        out[settings.DIST_PORT.name] = str(ports["dist"])  # for DistributedContext.from_tf_config()
    return out


def main(argv: Sequence[str]) -> int:
    if help_requested(argv, __doc__):
        return 0
    try:
        port, script = parse_args(argv)
        nodes = nodes_from_env(os.environ)
        # Several nodes need the ports (one for TensorFlow unless --port names it, one for ours).
        names = ["dist"] if port is not None else ["tf", "dist"]
        ports = {"tf": port or 0, **rendezvous_ports(nodes, os.environ, names)} if nodes.nnodes > 1 else {}
        # The run's secret for DistributedContext's sockets (docs/design/security.md).
        secret = run_secret_env(os.environ, nodes)
    except LaunchError as e:
        return fail(str(e))
    env = {**launch_env(os.environ, nodes, ports), **secret}
    # One process per node: its output lines carry [rank=<node>], as every launcher's do here.
    return run(wrap_rank.command(str(nodes.node_rank), script), env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
