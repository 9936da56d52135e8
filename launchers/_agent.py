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
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from detslurm.launch._common import handling
from detslurm.launch.wrap_rank import STOP_SIGNALS

# Delivered to the workers, never acted on by the agent: Slurm's SIGTERM and the warning signals.
# (Defined in wrap_rank, which every worker runs and which must import nothing of ours.)
TO_WORKERS = STOP_SIGNALS
# What torchrun may still handle itself (its default list without SIGTERM).
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


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
        if len(fields) > 1 and fields[1].isdigit():
            out.setdefault(int(fields[1]), []).append(int(entry.name))
    return out


def children_of(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Pids whose parent is ``pid``."""
    return _children_map(proc).get(pid, [])


def below(pid: int, depth: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids exactly ``depth`` generations below ``pid`` (1: its children, 2: theirs)."""
    tree = _children_map(proc)
    level = [pid]
    for _ in range(depth):
        level = [child for parent in level for child in tree.get(parent, [])]
    return level


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


def run_agent(cmd: Sequence[str], env: Mapping[str, str], hold_stop_signals: bool = False) -> int:
    """Run the agent in its own session; stop signals go to its workers. Its exit code.

    ``hold_stop_signals``: for an agent that acts on SIGTERM whatever it is told (DeepSpeed's):
    the stop signals stay blocked in it and its own helper process, and go to the processes two
    levels below it instead, which must be wrap_rank (it unblocks them)."""
    hold = _block_worker_signals if hold_stop_signals else _ignore_worker_signals
    proc = subprocess.Popen(list(cmd), env=agent_env(env), start_new_session=True, preexec_fn=hold)
    with _forward_to_workers(proc, deep=hold_stop_signals):
        return proc.wait()
