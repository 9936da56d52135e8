"""``python -m detslurm.launch.torch_distributed [TORCH_OVERRIDES... --] (--trial T | SCRIPT...)``

Runs torchrun once per node of the trial's allocation with a static rendezvous: nnodes from the
node list, node_rank from SLURM_NODEID, nproc_per_node from this node's slots, master = the first
node of the list, and a master port no other job on that node can hold (see
``_common.rendezvous_ports``). Overrides go to torchrun after ours, so they win.

Failure: torchrun runs with ``--max_restarts 0``, so a worker that fails takes its node's workers
down (killed after a short grace, ``_agent.run_agent``) and torchrun exits non-zero;
``srun --kill-on-bad-exit=1`` then ends every other node's step. No node waits in torchrun's 300 s exit barrier.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from detslurm import settings
from detslurm.launch import wrap_rank
from detslurm.launch._agent import FAILURE_GRACE_S, run_agent
from detslurm.launch._common import LaunchError, Nodes, fail, help_requested, prepare, run_secret_env


def build_torchrun_cmd(
    nodes: Nodes, master_port: int, overrides: Sequence[str], script: Sequence[str], python: str = sys.executable
) -> list[str]:
    """Pure: the torchrun command for this node."""
    # One node: the rendezvous stays on loopback, unreachable from other hosts (as Determined does).
    master = "localhost" if nodes.nnodes == 1 else nodes.chief
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes.nnodes),
        "--nproc_per_node",
        str(nodes.slots),
        "--node_rank",
        str(nodes.node_rank),
        # No elastic restarts inside the job: a failed worker must end the step, so the controller
        # sees the failure and applies max_restarts itself (from the last checkpoint).
        "--max_restarts",
        "0",
        "--master_addr",
        master,
        "--master_port",
        str(master_port),
        # After our flags: torchrun takes the last value of a repeated flag, so the user's override wins.
        *overrides,
        # Each worker runs under wrap_rank so its output lines carry [rank=N]; RANK is the variable
        # torchrun sets for every worker it starts. --no-python: torchrun runs our argv as given
        # (wrap_rank's light start, python -S on its file) instead of `python -u -m MODULE`.
        "--no-python",
        *wrap_rank.command("RANK", script, python),
    ]


def launch_env(env: Mapping[str, str], nodes: Nodes, dist_port: int) -> dict[str, str]:
    out = dict(env)
    # The flag pytorch.init() and the harness read to join torch.distributed; set in the child's
    # environment only, never in ours (Determined's launcher leaks it into os.environ).
    out["USE_TORCH_DISTRIBUTED"] = "True"
    out["DET_CHIEF_IP"] = nodes.chief
    out[settings.DIST_PORT.name] = str(dist_port)  # for core.DistributedContext.from_torch_distributed()
    return out


def main(argv: Sequence[str]) -> int:
    if help_requested(argv, __doc__):
        return 0
    try:
        overrides, script, nodes, ports = prepare(argv, os.environ)
        # The run's secret for DistributedContext's sockets (docs/design/security.md): normally the
        # login node's per-run file, checked here so a bad one fails the launch in one line.
        secret = run_secret_env(os.environ, nodes)
    except LaunchError as e:
        return fail(str(e))
    # Two ports: torch's c10d store ("master") and our own JSON collectives ("dist"); sharing one
    # would make the second bind fail.
    cmd = build_torchrun_cmd(nodes, ports["master"], overrides, script)
    # run_agent, not run: torchrun must not act on SIGTERM itself (launchers/_agent.py says why).
    # Failed workers are its to restart where the user asked for restarts, so none are killed then.
    grace = None if restarts_requested(overrides) else FAILURE_GRACE_S
    return run_agent(cmd, {**launch_env(os.environ, nodes, ports["dist"]), **secret}, grace=grace)


def restarts_requested(overrides: Sequence[str]) -> bool:
    """Pure: whether the user's torchrun flags ask for elastic restarts (the last value wins)."""
    value = "0"
    for i, arg in enumerate(overrides):
        name, eq, inline = arg.partition("=")
        if name in ("--max_restarts", "--max-restarts"):
            value = inline if eq else (overrides[i + 1] if i + 1 < len(overrides) else "0")
    return value.strip() not in ("", "0")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
