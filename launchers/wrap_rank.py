"""``python -m detslurm.launch.wrap_rank [--no-redirect-stdio] RANK [--] SCRIPT...``: prefix every output line of a
worker with ``[rank=N] `` so logs can be told apart per rank (``det trial logs --rank-id N``).

RANK is a number, or a comma list of environment variables tried in order (``RANK,PMI_RANK``).
Lines are split on ``\\n`` and ``\\r`` (tqdm's redraws become lines); over-long lines are broken.
Signals are forwarded to the worker; the exit code is the worker's. ``--no-redirect-stdio`` is
accepted for Determined's command lines: output always goes to this process's own stdout and
stderr here (the trial's log), never to separate files.

Our launchers start it once per worker, so it is on the path from job start to the first step
four times on a 2 x 2 job: they run this file by path under ``python -S`` (:func:`command`),
which skips site-packages, ``.pth`` files and the detslurm package entirely. That is why this
module imports only the standard library and holds the signal sets the other launchers share.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading

# Names used only in annotations (strings here, PEP 563): mypy reads them, the interpreter never
# imports typing's machinery for them (a few ms of every worker's start). mypy treats a name
# TYPE_CHECKING as true whatever its value.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from types import FrameType
    from typing import Any, BinaryIO, Optional

# Every signal a launcher passes on to what it started (SIGINT and SIGHUP too: a user's Ctrl-C
# on a local run, a hangup of the batch shell).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# The stop signals: Slurm's SIGTERM and the warning signals. Delivered to the workers, never
# acted on by an agent in between (launchers/_agent.py).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# Set by a launcher agent's parent (launchers/_agent.py) to a private directory where a rank that
# failed leaves a mark: the agent's own teardown of the other ranks can take its full 30 s grace
# (torchrun's), and a rank stuck in a collective never acts on SIGTERM.
FAILED_RANKS_ENV = "DETSLURM_FAILED_RANKS_DIR"


def command(rank_spec: str, script: Sequence[str], python: str = sys.executable) -> list[str]:
    """Pure: the argv that runs ``script`` under this wrapper as rank ``rank_spec``.

    ``-S`` and the file's path instead of ``-m detslurm.launch.wrap_rank``: no site-packages
    scan, no ``.pth`` hooks and no package ``__init__`` (about 50 ms of start-up per worker,
    more where bytecode is not cached). ``-u``: lines reach the log as they are pumped.
    """
    return [python, "-S", "-u", os.path.abspath(__file__), rank_spec, "--", *script]


def unblock_stop_signals() -> None:
    """Undo ``run_agent(hold_stop_signals=True)``'s block in this process (wrap_rank calls it
    first thing), so it and the trial it starts receive the stop signals again. A no-op where
    nothing is blocked."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def mark_failure(rank: str, code: int, env: Mapping[str, str]) -> None:
    """Leave ``rank``'s non-zero exit where the agent's parent looks (:data:`FAILED_RANKS_ENV`).
    Best effort: the exit code still reaches the agent the usual way."""
    where = env.get(FAILED_RANKS_ENV)
    if not where or code == 0:
        return
    try:
        fd = os.open(os.path.join(where, f"rank-{os.getpid()}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{rank} {code}\n")
    except OSError:
        pass


def _wait_forwarding(proc: subprocess.Popen[Any]) -> int:
    """Wait for ``proc``, passing every FORWARDED signal on to it meanwhile; its exit code.

    To its pid, not its group: the worker shares our process group (it is not a group leader),
    and the preemption SIGTERM must reach it to checkpoint."""

    def handler(signum: int, _frame: Optional[FrameType]) -> None:
        # Popen.send_signal ignores a worker that has exited meanwhile (ProcessLookupError).
        proc.send_signal(signum)

    old = {sig: signal.signal(sig, handler) for sig in FORWARDED}
    try:
        return proc.wait()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


# Long lines are broken and each piece gets the prefix again: a line of megabytes (a tensor
# dump) keeps its rank tag on every log line, and the pump never holds more than this.
MAX_LINE = io.DEFAULT_BUFFER_SIZE - 1


def resolve_rank(spec: str, env: Mapping[str, str]) -> Optional[str]:
    # A literal number is Determined's form for a fixed rank; names are looked up so that one
    # command line serves torchrun (RANK), MPI (PMI_RANK, OMPI_...) and Horovod.
    if spec.isdigit():
        return spec
    for name in spec.split(","):
        if env.get(name.strip()):
            return env[name.strip()]
    return None


def split_lines(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines (each ending b"\\n") and the unfinished rest; \\r ends a line too."""
    out: list[bytes] = []
    start = 0
    for i, ch in enumerate(buf):
        if ch in (10, 13):
            out.append(buf[start:i] + b"\n")
            start = i + 1
        elif i - start >= MAX_LINE:
            out.append(buf[start:i] + b"\n")
            start = i
    return out, buf[start:]


def pump(src: BinaryIO, dst: BinaryIO, prefix: bytes) -> None:
    rest = b""
    while True:
        # read1: return what is available now instead of waiting for 64 KiB, so a slow trial's
        # lines reach the log as they are printed.
        chunk = src.read1(65536) if hasattr(src, "read1") else src.read(65536)
        if not chunk:
            break
        lines, rest = split_lines(rest + chunk)
        for line in lines:
            dst.write(prefix + line)
        dst.flush()
    # An unterminated last line (a crash mid-print) is still written, with a newline added.
    if rest:
        dst.write(prefix + rest + b"\n")
        dst.flush()


def main(argv: Sequence[str]) -> int:
    # Under DeepSpeed's launcher the stop signals arrive blocked (launchers/_agent.py says why);
    # this worker and its trial must receive them.
    unblock_stop_signals()
    args = list(argv)
    if args[:1] == ["--no-redirect-stdio"]:
        args = args[1:]
    if len(args) < 2:
        print("usage: python -m detslurm.launch.wrap_rank [--no-redirect-stdio] RANK [--] SCRIPT...", file=sys.stderr)
        return 2
    rank = resolve_rank(args[0], os.environ)
    if rank is None:
        print(f"wrap_rank: none of the rank variables {args[0]} is set", file=sys.stderr)
        return 1
    script = args[2:] if args[1] == "--" else args[1:]
    if not script:
        print("wrap_rank: no script to run after --", file=sys.stderr)
        return 2
    prefix = f"[rank={rank}] ".encode()
    try:
        proc = subprocess.Popen(script, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:  # a missing or non-executable program: the shell's exit code for it
        print(f"wrap_rank: cannot run {script[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
    assert proc.stdout is not None and proc.stderr is not None
    threads = [
        # One thread per stream: reading stdout and stderr in turn could deadlock when the worker
        # fills the pipe we are not reading.
        threading.Thread(target=pump, args=(proc.stdout, sys.stdout.buffer, prefix)),
        threading.Thread(target=pump, args=(proc.stderr, sys.stderr.buffer, prefix)),
    ]
    for t in threads:
        t.start()
    code = _wait_forwarding(proc)
    # Before the pumps finish: a process the trial left behind may hold its pipes open.
    mark_failure(rank, code, os.environ)
    for t in threads:
        t.join()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
