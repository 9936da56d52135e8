"""Running a per-node agent (torchrun) whose workers must see the preemption signals themselves.

Why not simply forward signals to the agent (``_common.run``): torchrun's elastic agent treats
SIGTERM as a death signal. It passes SIGTERM to its workers, gives them a short timeout, SIGKILLs
them, and exits non-zero; a second SIGTERM while it waits (Slurm signals every process of a
step, and our own launchers forward) raises again inside its shutdown. A preempted trial that
checkpointed and exited 0 was then reported failed and charged a restart. The site's warning
signal (USR2 by default) is not handled by torchrun at all and would kill it outright.

So the agent is told to leave those signals alone (``TORCHELASTIC_SIGNALS_TO_HANDLE``, and they
are ignored in it), and this process forwards them to the agent's workers directly: each
worker checkpoints and exits 0, and torchrun then exits 0 as for a finished run. The workers
are found as the agent's children because torchrun starts each in a session of its own, where
no process-group signal reaches them. Under proctrack/linuxproc Slurm also signals the workers
itself; the trial treats such repeats as one preemption (detslurm/core/_preempt.py).

DeepSpeed's launcher (``hold_stop_signals``) cannot be told to leave the signals alone, so they
are held from it instead. Its runner (``deepspeed.launcher.runner --no_ssh``) installs no handler
and dies of SIGTERM or the warning signal; it runs ``deepspeed.launcher.launch``, which catches
SIGTERM and SIGTERMs each worker's tree, waits, and exits 1 however the workers ended; the
warning signal kills it outright, and srun then SIGKILLs the orphaned workers before they can
checkpoint (seen on the test cluster: the launcher exited 241 after SIGTERM, 244 after USR2). An ignored
signal would not do, since launch.py installs its own SIGTERM handler over it; a *blocked*
one is never delivered whatever handler is installed, and the block survives fork and exec.
So the runner starts with the stop signals blocked, and wrap_rank, which is every worker's
parent under that launcher, unblocks them for itself and the trial (``wrap_rank.unblock_stop_signals``).
The forwarder then signals the runner's grandchildren, the wrap_rank processes (where only
the launcher gets the signal: the warning signal on one node); wrap_rank passes it on and the
trial acts on it, while the two DeepSpeed processes hold theirs pending; launch.py sees its
workers exit 0 after their checkpoint and exits 0 itself.

A failed rank: torchrun then stops the other workers with SIGTERM and waits up to 30 s (a
grace no setting shortens in torch 2.13) before its SIGKILL, and a rank blocked in a gloo
collective never runs its SIGTERM handler. On a loaded node that made a worker failure take
over 30 s to end the job. So each worker's wrap_rank marks a non-zero exit in a private
directory (``wrap_rank.FAILED_RANKS_ENV``), and :func:`run_agent` SIGKILLs the agent's other
workers and everything under them :data:`FAILURE_GRACE_S` after the first mark. It also tells
the step's other nodes through the run dir (:class:`PeerMarks`), whose ranks may sit in a
collective with the dead one; otherwise only srun's kill-on-bad-exit would stop them, after
the site's KillWait. A preemption never goes through this: its ranks exit 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from detslurm.launch._common import handling
from detslurm.launch._pidwait import ChildWait
from detslurm.launch.wrap_rank import STOP_SIGNALS
from detslurm.protocol import NotARunDir, RunPaths
from detslurm.settings import FAILED_RANKS_DIR

# Delivered to the workers, never acted on by the agent: Slurm's SIGTERM and the warning signals.
# (Defined in wrap_rank, which every worker runs and which must import nothing of ours.)
TO_WORKERS = STOP_SIGNALS
# What torchrun may still handle itself (its default list without SIGTERM).
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
# How long the other ranks get, after one failed, to finish on their own (an error of their own
# from the broken collective, a last log line) before they are killed.
FAILURE_GRACE_S = 1.0
# How long the agent gets, once none of its workers is left, to print its summary and exit.
AGENT_EXIT_S = 1.0


def _children_map(proc: Path) -> dict[int, list[int]]:
    """Every process's children, from one scan of /proc (Linux; Slurm compute nodes are Linux)."""
    out: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # The command name (field 2) may hold spaces and parentheses: parse after the last ")".
        fields = stat[stat.rfind(")") + 2 :].split()
        # A zombie is gone but for its parent's wait, which torchrun makes only on its monitor's
        # tick (seconds apart): counted as a worker, it held the launcher back that long.
        if fields and fields[0] in ("Z", "X"):
            continue
        if len(fields) > 1 and fields[1].isdigit():
            out.setdefault(int(fields[1]), []).append(int(entry.name))
    return out


def children_of(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Pids whose parent is ``pid``."""
    return _children_map(proc).get(pid, [])


def _generation(tree: Mapping[int, list[int]], pids: list[int], depth: int) -> list[int]:
    for _ in range(depth):
        pids = [child for parent in pids for child in tree.get(parent, [])]
    return pids


def below(pid: int, depth: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids exactly ``depth`` generations below ``pid`` (1: its children, 2: theirs)."""
    return _generation(_children_map(proc), [pid], depth)


def tree_below(pid: int, depth: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids ``depth`` generations below ``pid`` and all their descendants, from one scan."""
    tree = _children_map(proc)
    level = _generation(tree, [pid], depth)
    out: list[int] = []
    while level:
        out += level
        level = _generation(tree, level, 1)
    return out


@dataclass(frozen=True)
class PeerMarks:
    """How the launchers of one step's nodes tell each other that a rank failed: a mark each in
    the run dir, which every node shares. A rank on another node may be stuck in a collective
    with the dead one and never fail on its own."""

    mine: Path
    pattern: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional[PeerMarks]:
        """None outside a step of more than one node (nothing to tell) or outside a run."""
        nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "1"
        if not nodes.isdigit() or int(nodes) < 2:
            return None
        try:
            run = RunPaths.from_env(env)
        except NotARunDir:
            return None
        step = f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
        mine = run.failure_mark(step, env.get("SLURM_NODEID", "0"))
        return cls(mine, run.failure_mark(step, "*").name)

    def tell(self) -> None:
        with contextlib.suppress(OSError):
            self.mine.touch()

    def heard(self) -> bool:
        with contextlib.suppress(OSError):
            return any(p != self.mine for p in self.mine.parent.glob(self.pattern))
        return False


def _block_worker_signals() -> None:
    # preexec of a launcher that installs its own SIGTERM handler (DeepSpeed's): see the docstring.
    signal.pthread_sigmask(signal.SIG_BLOCK, TO_WORKERS)


def _ignore_worker_signals() -> None:
    # In the agent only (preexec): its workers re-install their own handlers (wrap_rank does).
    for sig in TO_WORKERS:
        signal.signal(sig, signal.SIG_IGN)


def _forward_to_workers(agent: subprocess.Popen[Any], deep: bool = False) -> contextlib.AbstractContextManager[None]:
    # torchrun's workers are its children; DeepSpeed's are two levels down (runner, launch.py).
    # Exactly that level and no deeper: a trial's own children (data loader workers) would die
    # of a warning signal they have no handler for.
    depth = 2 if deep else 1

    def handler(signum: int, _frame: Optional[FrameType]) -> None:
        # Stop signals to the workers; the rest to the agent's process group (it handles those).
        targets = below(agent.pid, depth) if signum in TO_WORKERS else [-agent.pid]
        for target in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(target, signum)

    return handling(handler)


def agent_env(env: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment: our signal list unless the user chose one."""
    out = dict(env)
    # torchrun reads its --signals-to-handle default from PET_SIGNALS_TO_HANDLE and then sets
    # TORCHELASTIC_SIGNALS_TO_HANDLE from it; older releases read only the latter. (Releases
    # before either still act on SIGTERM: there the trial may be reported failed after a
    # preemption, as before.)
    out.setdefault("PET_SIGNALS_TO_HANDLE", AGENT_SIGNALS)
    out.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", out["PET_SIGNALS_TO_HANDLE"])
    return out


def run_agent(
    cmd: Sequence[str],
    env: Mapping[str, str],
    hold_stop_signals: bool = False,
    grace: Optional[float] = FAILURE_GRACE_S,
) -> int:
    """Run the agent in its own session; stop signals go to its workers. Its exit code.

    ``hold_stop_signals``: for an agent that acts on SIGTERM whatever it is told (DeepSpeed's):
    the stop signals stay blocked in it and its own helper process, and go to the processes two
    levels below it instead, which must be wrap_rank (it unblocks them). ``grace``: how long the
    other workers live on after one failed (the module's docstring says why); None leaves a
    failure to the agent, for one that restarts its workers."""
    hold = _block_worker_signals if hold_stop_signals else _ignore_worker_signals
    depth = 2 if hold_stop_signals else 1
    # mkdtemp: private (0700) under a random name, so no other user can plant or remove marks.
    with tempfile.TemporaryDirectory(prefix="detslurm-ranks-") as failed:
        agent = agent_env(env) if grace is None else {**agent_env(env), FAILED_RANKS_DIR.name: failed}
        proc = subprocess.Popen(list(cmd), env=agent, start_new_session=True, preexec_fn=hold)
        with _forward_to_workers(proc, deep=hold_stop_signals):
            if grace is None:
                return proc.wait()
            return _wait_failing_fast(proc, Path(failed), depth, grace, PeerMarks.from_env(env))


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _wait_failing_fast(
    proc: subprocess.Popen[Any], failed: Path, depth: int, grace: float, peers: Optional[PeerMarks]
) -> int:
    """``proc``'s exit code. Once a worker marked a failure, the others and everything under them
    are SIGKILLed after ``grace`` s; at once where another node of the step marked one (``peers``,
    looked at every 0.4 s). The agent then has AGENT_EXIT_S to report and exit: torchrun's interpreter
    took 10-25 s to tear torch down on a loaded node, after it had printed its failure summary.
    Killed, it counts as failed (1, torchrun's code for a failed worker)."""
    with ChildWait(proc) as child:
        return _fail_fast_loop(proc, child, failed, depth, grace, peers)


def _fail_fast_loop(
    proc: subprocess.Popen[Any], child: ChildWait, failed: Path, depth: int, grace: float, peers: Optional[PeerMarks]
) -> int:
    kill_at: Optional[float] = None
    alone_since: Optional[float] = None
    polls = 0
    while True:
        code = child.wait(0.2)
        if code is not None:
            return code
        polls += 1
        now = time.monotonic()
        if kill_at is None:
            if any(failed.iterdir()):
                kill_at = now + grace
                if peers:
                    peers.tell()
            elif peers and polls % 2 == 0 and peers.heard():
                # At once: the failed rank had its grace on its own node, and the job has failed.
                kill_at = now
            continue
        if now < kill_at:
            continue
        # Workers and their trials from one snapshot: a trial orphaned by its wrap_rank's death
        # would no longer be found below the agent.
        workers = tree_below(proc.pid, depth)
        _kill(workers)
        alone_since = None if workers else alone_since or now
        if alone_since is not None and now - alone_since >= AGENT_EXIT_S:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its session: DeepSpeed's runner and launch.py
            proc.wait()
            return 1
