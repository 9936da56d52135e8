"""``python -m detslurm.launch.horovod [HVD_OVERRIDES... --] (--trial T | SCRIPT...)``

No ssh, no horovodrun: every node's launcher starts its own workers, and they meet through
Horovod's gloo rendezvous server, which the chief node's launcher runs and whose port it
publishes in the run dir. Ranks follow the node list: node i holds ranks i*slots .. i*slots+slots-1.
``--mpi`` in the overrides uses Open MPI instead: the chief runs ``mpirun`` inside the allocation
(Open MPI starts its daemons through Slurm, not ssh) and the other nodes' launchers wait.
When one worker fails, the others are stopped and the launcher exits non-zero.

HVD_OVERRIDES are horovodrun's flags (``--fusion-threshold-mb 1 --cycle-time-ms 2``,
``--autotune``, ``--timeline-filename F``, ...), turned into Horovod's environment variables for
every worker (``_horovod_args.py``). ``--autohorovod`` (Determined's internal flag, before the
trial) runs a one-slot trial directly, as ``detslurm.launch.autohorovod`` does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from detslurm.launch import wrap_rank
from detslurm.launch._common import (
    LaunchError,
    Nodes,
    fail,
    free_port,
    help_requested,
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
from detslurm.launch._horovod_args import Controller, HorovodSettings, parse_overrides, report
from detslurm.protocol.secret import SECRET_ENV, SECRET_FILE_ENV
from detslurm.settings import DIST_PORT, NETWORK_INTERFACE, TORCH_PORT

# The first word after the overrides' `--` in Determined's legacy entrypoints.
AUTOHOROVOD = "--autohorovod"


def worker_env(
    base: Mapping[str, str], nodes: Nodes, local_rank: int, rdzv_addr: str, rdzv_port: int, iface: str | None
) -> dict[str, str]:
    """Pure: the environment Horovod's gloo controller reads for one worker."""
    size = nodes.slots * nodes.nnodes
    env = dict(base)
    env.update(
        {
            "HOROVOD_HOSTNAME": nodes.hosts[nodes.node_rank],
            # Ranks in node-list order, the same layout horovodrun's host assignment gives, so the
            # rendezvous plan on the chief and every worker's own rank agree.
            "HOROVOD_RANK": str(nodes.node_rank * nodes.slots + local_rank),
            "HOROVOD_SIZE": str(size),
            "HOROVOD_LOCAL_RANK": str(local_rank),
            "HOROVOD_LOCAL_SIZE": str(nodes.slots),
            "HOROVOD_CROSS_RANK": str(nodes.node_rank),
            "HOROVOD_CROSS_SIZE": str(nodes.nnodes),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": rdzv_addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rdzv_port),
            "HOROVOD_CONTROLLER": "gloo",
            # gloo for CPU collectives too: no MPI is needed for the default path.
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "USE_HOROVOD": "1",
            "DET_CHIEF_IP": nodes.chief,
        }
    )
    if iface:
        env["HOROVOD_GLOO_IFACE"] = iface
        # setdefault: a site's or user's NCCL interface choice wins over ours.
        env.setdefault("NCCL_SOCKET_IFNAME", iface)
    return env


def worker_cmd(script: Sequence[str], python: str = sys.executable) -> list[str]:
    return wrap_rank.command("HOROVOD_RANK", script, python)


def _start_rendezvous(nodes: Nodes) -> tuple[Any, int]:
    # Imported here, not at module top: `--help`, --mpi and the one-slot path must work
    # where Horovod's runner is not importable.
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


def gloo_main(nodes: Nodes, script: Sequence[str], env: Mapping[str, str], settings: HorovodSettings) -> int:
    try:
        secret = run_secret_env(env, nodes)
    except LaunchError as e:
        return fail(str(e))
    server = None
    local = nodes.chief if nodes.nnodes > 1 else "127.0.0.1"
    if nodes.is_chief:
        server, port = _start_rendezvous(nodes)
        # dist: the Core API's DistributedContext; torch: a legacy --trial's torch.distributed.
        dist_port, torch_port = free_port(local, hold=True), free_port(local)
        if nodes.nnodes > 1:
            # The run dir is on the shared filesystem and unique per run: the other nodes read the
            # chief's choice there, with no fixed port two jobs on a node could both want.
            publish(_ports_file(env), {"port": port, "dist": dist_port, "torch": torch_port})
    else:
        try:
            published = wait_published(_ports_file(env), settings.start_timeout_s or 120)
        except LaunchError as e:
            return fail(str(e))
        port, dist_port, torch_port = int(published["port"]), int(published["dist"]), int(published["torch"])
    addr = nodes.chief
    iface = settings.network_interface or NETWORK_INTERFACE.raw(env)
    # Gloo otherwise picks the first interface, often one the other nodes cannot reach
    # (docker0, a management net); the one that resolves to this node's name is routable.
    iface = iface or interface_for(nodes.hosts[nodes.node_rank])
    base = {**env, DIST_PORT.name: str(dist_port), TORCH_PORT.name: str(torch_port), **secret}
    base.update(settings.env)
    procs = [
        # A session per worker so supervise() can signal each worker's whole process group
        # (its data loader workers included) and none is left behind.
        subprocess.Popen(worker_cmd(script), env=worker_env(base, nodes, i, addr, port, iface), start_new_session=True)
        for i in range(nodes.slots)
    ]
    # Stops (docs/design/preemption.md): no horovodrun driver stands between Slurm and the ranks here, so nothing
    # kills them on SIGTERM. Slurm signals every process of the step itself, and supervise()
    # passes each stop signal on to every worker's process group as well (the warning signal
    # reaches only this launcher on one node); each rank checkpoints, exits 0, and so does this
    # launcher. The rendezvous server is needed only while the ranks start.
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
        # Containers often run as root, where mpirun refuses to start without this flag.
        "--allow-run-as-root",
        # Slurm has already checked the slot count; Open MPI's own count of cores may be lower
        # (e.g. GPUs per node > its view of slots) and must not refuse.
        "--oversubscribe",
        "-np",
        str(nodes.slots * nodes.nnodes),
        "-H",
        ",".join(f"{h}:{nodes.slots}" for h in nodes.hosts),
        # No binding: Slurm's cgroup already confines the job, and Open MPI's default core binding
        # would pin every rank of a GPU job to too few cores.
        "-bind-to",
        "none",
        "-map-by",
        "slot",
        "-x",
        "USE_HOROVOD=1",
        "-x",
        "DET_CHIEF_IP",
        "-x",
        DIST_PORT.name,
        *(arg for name in exported for arg in ("-x", name)),
        *rest,
        *wrap_rank.command("OMPI_COMM_WORLD_RANK,PMI_RANK", script, python),
    ]


def take_autohorovod(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``[OVERRIDES --] --autohorovod REST`` -> (argv without the flag, whether it was there)."""
    args = list(argv)
    at = args.index("--") + 1 if "--" in args else 0
    if args[at : at + 1] == [AUTOHOROVOD]:
        del args[at]
        return args, True
    return args, False


def mpi_main(nodes: Nodes, script: Sequence[str], settings: HorovodSettings) -> int:
    """The chief runs mpirun for every node; the other nodes' launchers only wait."""
    if not nodes.is_chief:
        return 0  # the chief's mpirun starts this node's ranks
    local = nodes.chief if nodes.nnodes > 1 else "127.0.0.1"
    dist_port, torch_port = free_port(local, hold=True), free_port(local)
    try:
        secret = run_secret_env(os.environ, nodes)
    except LaunchError as e:
        return fail(str(e))
    env = dict(
        os.environ,
        # mpirun starts its daemons with srun inside our step's allocation; --overlap lets that step
        # share the resources the running launcher step already holds (Slurm >= 20.11).
        OMPI_MCA_plm_slurm_args="--overlap",
        DET_CHIEF_IP=nodes.chief,
        **{DIST_PORT.name: str(dist_port), TORCH_PORT.name: str(torch_port)},
    )
    env.update(secret)
    env.update(settings.env)
    extra = list(settings.mpi_args)
    if settings.network_interface:
        env.setdefault("NCCL_SOCKET_IFNAME", settings.network_interface)
        extra += ["--mca", "btl_tcp_if_include", settings.network_interface]
    names = [n for n in (SECRET_FILE_ENV, SECRET_ENV, TORCH_PORT.name, "NCCL_SOCKET_IFNAME") if env.get(n)]
    # Stops (docs/design/preemption.md): mpirun forwards the warning signal (USR1/USR2) to every rank, which then
    # checkpoints as under gloo. SIGTERM is not solved here: mpirun aborts the job on it, and the
    # srun that starts its daemons on the other nodes runs inside this step, where Slurm's SIGTERM
    # reaches it and srun then kills the daemons' step. When the batch shell got the SIGTERM too
    # (preemption, the time limit) the run still ends as a preemption and resumes from its latest
    # periodic checkpoint, but without a checkpoint of its own at the stop (seen on the test
    # cluster; tests/cluster/test_preemption_launchers.py covers only the warning signal for --mpi).
    exported = names + sorted(settings.env)
    return run(mpi_cmd(nodes, extra, script, exported=exported), env)


def main(argv: Sequence[str]) -> int:
    if help_requested(argv, __doc__):
        return 0
    try:
        args, auto = take_autohorovod(argv)
        overrides, script = parse_args(args)
        settings = parse_overrides(overrides)
        nodes = nodes_from_env(os.environ)
    except LaunchError as e:
        return fail(str(e))
    if auto and nodes.nnodes == 1 and nodes.slots <= 1:
        from detslurm.launch.autohorovod import run_one_slot

        return run_one_slot(script)
    report(settings)
    if settings.controller is Controller.MPI:
        return mpi_main(nodes, script, settings)
    return gloo_main(nodes, script, os.environ, settings)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
