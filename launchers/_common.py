"""What every launcher shares: argument parsing, node facts, rendezvous ports, signals."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Optional

# Re-exported: FORWARDED is defined in wrap_rank, the one launcher module that must stay stdlib-only.
from detslurm.launch.wrap_rank import FORWARDED as FORWARDED
from detslurm.protocol import NotARunDir, RunPaths, expand_nodelist
from detslurm.protocol.secret import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    RunSecretError,
    new_secret,
    read_run_secret,
    wait_run_secret,
    write_run_secret,
)


class LaunchError(Exception):
    """Bad launcher arguments or environment: printed as one line, exit code 2."""


def parse_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[OVERRIDES... --] (--trial TRIAL | SCRIPT...)`` -> (overrides, script).

    Everything before the first ``--`` is passed to the framework's launcher; with no ``--``,
    every argument is the script. ``--trial T`` becomes the Trainer harness command.
    """
    args = list(argv)
    if "--" in args:
        i = args.index("--")
        overrides, rest = args[:i], args[i + 1 :]
    else:
        overrides, rest = [], args
    if rest[:1] == ["--trial"]:
        if len(rest) < 2:
            raise LaunchError("--trial needs a value (filepath:ClassName)")
        if len(rest) > 2:
            raise LaunchError(f"extra arguments to --trial: {' '.join(rest[2:])}")
        return overrides, trial_script(rest[1])
    if rest and rest[0].startswith("-"):
        raise LaunchError(f"unrecognized arguments: {rest[0]} (overrides must end with --)")
    if not rest:
        raise LaunchError("empty script is not allowed")
    return overrides, rest


def help_requested(argv: Sequence[str], usage: str | None) -> bool:
    """``-h``/``--help`` as the first argument (seed 001: ``python3 -m determined.launch.deepspeed
    -h``) prints the launcher's usage; the caller then exits 0."""
    if list(argv[:1]) not in (["-h"], ["--help"]):
        return False
    print((usage or "").strip(), flush=True)
    return True


def trial_script(trial: str) -> list[str]:
    if not re.fullmatch(r"[A-Za-z0-9_./]+:[A-Za-z0-9_.]+", trial):
        raise LaunchError(f"--trial {trial!r}: expected filepath:ClassName")
    return [sys.executable, "-m", "detslurm.exec.harness", trial]


@dataclass(frozen=True)
class Nodes:
    """This node's place in the trial's allocation."""

    hosts: list[str]
    node_rank: int
    slots: int  # processes to start on this node

    @property
    def nnodes(self) -> int:
        return len(self.hosts)

    @property
    def chief(self) -> str:
        return self.hosts[0] if len(self.hosts) > 1 else "127.0.0.1"

    @property
    def is_chief(self) -> bool:
        return self.node_rank == 0


def nodes_from_env(env: Mapping[str, str]) -> Nodes:
    """Hosts from the job's node list (never `hostname`: it can be the same on every node)."""
    raw = env.get("DET_CONTAINER_ADDRS")
    hosts = json.loads(raw) if raw else []
    if not hosts and env.get("SLURM_JOB_NODELIST"):
        try:
            hosts = expand_nodelist(env["SLURM_JOB_NODELIST"])
        except ValueError as e:
            raise LaunchError(str(e)) from None
    hosts = hosts or ["127.0.0.1"]
    rank = int(env.get("DET_CONTAINER_RANK") or env.get("SLURM_NODEID") or 0)
    slots = len(json.loads(env["DET_SLOT_IDS"])) if env.get("DET_SLOT_IDS") else 1
    if rank >= len(hosts):
        raise LaunchError(f"node rank {rank} is outside the node list {hosts}")
    return Nodes(hosts=hosts, node_rank=rank, slots=max(1, slots))


def prepare(argv: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], list[str], Nodes, dict[str, int]]:
    """What a rendezvous-based launcher needs first: its arguments, this node, and the master
    and DistributedContext ports (the same on every node)."""
    overrides, script = parse_args(argv)
    nodes = nodes_from_env(env)
    return overrides, script, nodes, rendezvous_ports(nodes, env, ["master", "dist"])


def run_secret_env(env: Mapping[str, str], nodes: Nodes, timeout_s: float = 120) -> dict[str, str]:
    """The variables that give every rank of this step the run's secret (docs/design/security.md).

    The login node normally creates the secret per run and names it in DETSLURM_RUN_SECRET_FILE;
    then we only check here that it is usable, so a bad file fails the launch in one clear line.
    Without one (local dev, a launcher run by hand, tests) this launcher makes a fresh random
    secret itself, never derived from ids: on one node it hands it to its ranks in their
    environment (only our user and root can read /proc/PID/environ); across nodes, where the
    launchers share nothing but the run dir, the chief writes it 0600 there and the others read it.
    """
    try:
        if env.get(SECRET_FILE_ENV):
            read_run_secret(env[SECRET_FILE_ENV])
            return {}
        if nodes.nnodes == 1:
            return {SECRET_ENV: new_secret().hex()}
        run_dir = Path(env.get("DET_RUN_DIR") or ".")
        name = f"run-secret-{env.get('SLURM_JOB_ID', 'local')}-{env.get('SLURM_STEP_ID', '0')}"
        if nodes.is_chief:
            path = write_run_secret(run_dir, name)
        else:
            path = run_dir / name
            wait_run_secret(path, timeout_s)
    except RunSecretError as e:
        raise LaunchError(str(e)) from None
    return {SECRET_FILE_ENV: str(path)}


# The ports this launcher chose for a listener that binds with SO_REUSEADDR (the Core API's
# DistributedContext), held bound but not listening until the launcher exits. A chosen port
# closed at once is free again: before rank 0 binds it, seconds or minutes later (after its
# framework's imports), another process's bind(0) or outgoing connection on the node can take it
# (seen in CI: "cannot listen on ('c1', 39545): Address already in use"). The kernel hands a port
# with a bound socket to neither, and lets a second SO_REUSEADDR socket bind and listen there.
_HELD: list[socket.socket] = []


def free_port(host: str = "", hold: bool = False) -> int:
    """A port free now on ``host``; ``hold``: kept from everyone but an SO_REUSEADDR listener
    until this process exits (see _HELD). Not for torch's own store, which may bind without it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if hold:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    except BaseException:
        s.close()
        raise
    if hold:
        _HELD.append(s)
    else:
        s.close()
    return port


# Rendezvous ports whose listener is ours (core._wire._listen sets SO_REUSEADDR): held.
HELD_PORTS = frozenset({"dist"})


def rendezvous_ports(
    nodes: Nodes, env: Mapping[str, str], names: Sequence[str], timeout_s: float = 120
) -> dict[str, int]:
    """Ports for this job's rendezvous that no other job on the same nodes can be using.

    Where the site reserves ports for the step (``SLURM_STEP_RESV_PORTS``, MpiParams=ports=...),
    those are used. Otherwise the chief binds port 0 on its own address, so the kernel hands out
    a port free right now on that node, and publishes the choice in the run dir (on the shared
    filesystem, unique per run) for the other nodes. Two jobs on the same node can never get the
    same port this way, unlike fixed ports or ports derived from job ids.
    """
    resv = env.get("SLURM_STEP_RESV_PORTS")
    if resv:
        ports = _expand_ports(resv)
        if len(ports) >= len(names):
            return dict(zip(names, ports[: len(names)], strict=True))
    if nodes.nnodes == 1:
        return {n: free_port("127.0.0.1", hold=n in HELD_PORTS) for n in names}
    path = run_paths(env).rendezvous(env.get("SLURM_JOB_ID", "local"), env.get("SLURM_STEP_ID", "0"))
    if nodes.is_chief:
        chosen = {n: free_port(nodes.chief, hold=n in HELD_PORTS) for n in names}
        publish(path, chosen)
        return chosen
    return {k: int(v) for k, v in wait_published(path, timeout_s).items()}


def run_paths(env: Mapping[str, str]) -> RunPaths:
    """The trial run's files; multi-node launchers publish their rendezvous there."""
    try:
        return RunPaths.from_env(env)
    except NotARunDir as e:
        raise LaunchError(f"multi-node rendezvous needs the trial's run dir: {e}") from None


def _expand_ports(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


@contextlib.contextmanager
def handling(handler: Callable[[int, Optional[FrameType]], None]) -> Iterator[None]:
    """``handler`` for every FORWARDED signal while the block runs; the old handlers after."""
    old = {sig: signal.signal(sig, handler) for sig in FORWARDED}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def forward_signals(proc: subprocess.Popen[Any], to_group: bool = True) -> contextlib.AbstractContextManager[None]:
    """Pass signals on to the child (its process group), and restore our handlers after."""

    def handler(signum: int, _frame: Optional[FrameType]) -> None:
        with contextlib.suppress(ProcessLookupError):
            if to_group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)

    return handling(handler)


def run(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run the command in its own process group with signals forwarded; its exit code."""
    proc = subprocess.Popen(list(cmd), env=dict(env), start_new_session=True)
    with forward_signals(proc):
        return proc.wait()


def fail(message: str) -> int:
    print(f"detslurm launcher: {message}", file=sys.stderr, flush=True)
    return 2


def supervise(procs: Sequence[subprocess.Popen[Any]], grace_s: float = 5.0, poll_s: float = 0.1) -> int:
    """The custom-launcher contract for workers we start ourselves: when one exits non-zero,
    stop the others (SIGTERM, SIGKILL after ``grace_s``) and return its code; 0 when all exit 0.
    Signals to this process are forwarded to every worker meanwhile."""

    def forward(signum: int, _frame: Optional[FrameType]) -> None:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signum)

    with handling(forward):
        while True:
            codes = [p.poll() for p in procs]
            bad = next((c for c in codes if c not in (None, 0)), None)
            if bad is not None:
                _stop(procs, grace_s)
                return bad
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)


def _stop(procs: Sequence[subprocess.Popen[Any]], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def publish(path: Path, values: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(values)))
    os.replace(tmp, path)


def wait_published(path: Path, timeout_s: float = 120) -> dict[str, Any]:
    """The chief's published values, read as soon as they are there.

    Every node starts at the same moment, so the chief's file usually appears within
    milliseconds: the first retries come after 5, 10, 20 ms, then every 50 ms (a shared
    filesystem is not hammered by a chief that is slow to start)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while time.monotonic() < deadline:
        try:
            data: dict[str, Any] = json.loads(path.read_text())
            return data
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
    raise LaunchError(f"the chief node did not publish {path.name} within {timeout_s:.0f} s")


def interface_for(host: str) -> Optional[str]:
    """The network interface holding ``host``'s address on this node (gloo needs a name)."""
    try:
        import psutil

        addr = socket.gethostbyname(host)
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == addr for a in addrs if a.family == socket.AF_INET):
                return str(name)
        if addr.startswith("127."):
            return "lo"
    except (OSError, ImportError):
        return None
    return None
