"""``python -m detslurm.launch.horovod [HVD_OVERRIDES... --] (--trial T | SCRIPT...)``

No ssh, no horovodrun: every node's launcher starts its own workers, and they meet through
Horovod's gloo rendezvous server, which the chief node's launcher runs and whose port it
publishes in the run dir. Ranks follow the node list: node i holds ranks i*slots .. i*slots+slots-1.
``--mpi`` in the overrides uses Open MPI instead: the chief runs ``mpirun`` inside the allocation
(Open MPI starts its daemons through Slurm, not ssh) and the other nodes' launchers wait.
When one worker fails, the others are stopped and the launcher exits non-zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from detslurm.launch._common import (
    LaunchError,
    Nodes,
    fail,
    free_port,
    interface_for,
    nodes_from_env,
    parse_args,
    publish,
    run,
    run_paths,
    run_secret_env,
    supervise,
    wait_published,
)
from detslurm.protocol.secret import SECRET_ENV, SECRET_FILE_ENV


def worker_env(
    base: Mapping[str, str], nodes: Nodes, local_rank: int, rdzv_addr: str, rdzv_port: int, iface: str | None
) -> dict[str, str]:
    """Pure: the environment Horovod's gloo controller reads for one worker."""
    size = nodes.slots * nodes.nnodes
    env = dict(base)
    env.update(
        {
            "HOROVOD_HOSTNAME": nodes.hosts[nodes.node_rank],
            "HOROVOD_RANK": str(nodes.node_rank * nodes.slots + local_rank),
            "HOROVOD_SIZE": str(size),
            "HOROVOD_LOCAL_RANK": str(local_rank),
            "HOROVOD_LOCAL_SIZE": str(nodes.slots),
            "HOROVOD_CROSS_RANK": str(nodes.node_rank),
            "HOROVOD_CROSS_SIZE": str(nodes.nnodes),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": rdzv_addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rdzv_port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "USE_HOROVOD": "1",
            "DET_CHIEF_IP": nodes.chief,
        }
    )
    if iface:
        env["HOROVOD_GLOO_IFACE"] = iface
        env.setdefault("NCCL_SOCKET_IFNAME", iface)
    return env


def worker_cmd(script: Sequence[str], python: str = sys.executable) -> list[str]:
    return [python, "-m", "detslurm.launch.wrap_rank", "HOROVOD_RANK", "--", *script]


def _start_rendezvous(nodes: Nodes) -> tuple[Any, int]:
    from horovod.runner.common.util import hosts as hvd_hosts
    from horovod.runner.http.http_server import RendezvousServer

    plan = hvd_hosts.get_host_assignments(
        hvd_hosts.parse_hosts(",".join(f"{h}:{nodes.slots}" for h in nodes.hosts)), nodes.slots * nodes.nnodes
    )
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    return server, int(port)


def _ports_file(env: Mapping[str, str]) -> Path:
    return run_paths(env).horovod_rendezvous(env.get("SLURM_JOB_ID", "local"))


def gloo_main(nodes: Nodes, script: Sequence[str], env: Mapping[str, str]) -> int:
    try:
        secret = run_secret_env(env, nodes)
    except LaunchError as e:
        return fail(str(e))
    server = None
    if nodes.is_chief:
        server, port = _start_rendezvous(nodes)
        dist_port = free_port(nodes.chief if nodes.nnodes > 1 else "127.0.0.1")
        if nodes.nnodes > 1:
            publish(_ports_file(env), {"port": port, "dist": dist_port})
    else:
        published = wait_published(_ports_file(env))
        port, dist_port = int(published["port"]), int(published["dist"])
    addr = nodes.chief
    iface = env.get("DETSLURM_NETWORK_INTERFACE") or interface_for(nodes.hosts[nodes.node_rank])
    base = dict(env, DETSLURM_DIST_PORT=str(dist_port), **secret)
    procs = [
        subprocess.Popen(worker_cmd(script), env=worker_env(base, nodes, i, addr, port, iface), start_new_session=True)
        for i in range(nodes.slots)
    ]
    try:
        return supervise(procs)
    finally:
        if server is not None:
            server.stop()


def mpi_cmd(
    nodes: Nodes,
    overrides: Sequence[str],
    script: Sequence[str],
    python: str = sys.executable,
    exported: Sequence[str] = (),
) -> list[str]:
    """Pure: mpirun on the chief; Open MPI starts its daemons through Slurm (srun), not ssh.
    ``exported`` names more variables for every rank (``-x NAME``: the name, never the value,
    goes on the command line, which every user can read in ps)."""
    rest = [o for o in overrides if o != "--mpi"]
    return [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        str(nodes.slots * nodes.nnodes),
        "-H",
        ",".join(f"{h}:{nodes.slots}" for h in nodes.hosts),
        "-bind-to",
        "none",
        "-map-by",
        "slot",
        "-x",
        "USE_HOROVOD=1",
        "-x",
        "DET_CHIEF_IP",
        "-x",
        "DETSLURM_DIST_PORT",
        *(arg for name in exported for arg in ("-x", name)),
        *rest,
        python,
        "-m",
        "detslurm.launch.wrap_rank",
        "OMPI_COMM_WORLD_RANK,PMI_RANK",
        "--",
        *script,
    ]


def main(argv: Sequence[str]) -> int:
    try:
        overrides, script = parse_args(argv)
        nodes = nodes_from_env(os.environ)
    except LaunchError as e:
        return fail(str(e))
    if "--mpi" in overrides:
        if not nodes.is_chief:
            return 0  # the chief's mpirun starts this node's ranks
        dist_port = free_port(nodes.chief if nodes.nnodes > 1 else "127.0.0.1")
        try:
            secret = run_secret_env(os.environ, nodes)
        except LaunchError as e:
            return fail(str(e))
        env = dict(
            os.environ, OMPI_MCA_plm_slurm_args="--overlap", DET_CHIEF_IP=nodes.chief, DETSLURM_DIST_PORT=str(dist_port)
        )
        env.update(secret)
        exported = [n for n in (SECRET_FILE_ENV, SECRET_ENV) if env.get(n)]
        return run(mpi_cmd(nodes, overrides, script, exported=exported), env)
    if overrides:
        return fail(f"unsupported horovod overrides {overrides}: only --mpi is understood without horovodrun")
    return gloo_main(nodes, script, os.environ)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
