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
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from detslurm.launch._common import FORWARDED

# Delivered to the workers, never acted on by the agent: Slurm's SIGTERM and the warning signals.
TO_WORKERS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# What torchrun may still handle itself (its default list without SIGTERM).
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def children_of(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Pids whose parent is ``pid``, read from /proc (Linux; Slurm compute nodes are Linux)."""
    out: list[int] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # The command name (field 2) may hold spaces and parentheses: parse after the last ")".
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(entry.name))
    return out


def _ignore_worker_signals() -> None:
    # In the agent only (preexec): its workers re-install their own handlers (wrap_rank does).
    for sig in TO_WORKERS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def _forward_to_workers(agent: subprocess.Popen[Any]) -> Iterator[None]:
    old: dict[signal.Signals, Any] = {}

    def handler(signum: int, _frame: Optional[FrameType]) -> None:
        # Stop signals to the workers; the rest to the agent's process group (it handles those).
        targets = children_of(agent.pid) if signum in TO_WORKERS else [-agent.pid]
        for target in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(target, signum)

    for sig in FORWARDED:
        old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


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


def run_agent(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run the agent in its own session; stop signals go to its workers. Its exit code."""
    proc = subprocess.Popen(list(cmd), env=agent_env(env), start_new_session=True, preexec_fn=_ignore_worker_signals)
    with _forward_to_workers(proc):
        return proc.wait()
