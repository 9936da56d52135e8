"""``python -m detslurm.launch.wrap_rank [--no-redirect-stdio] RANK [--] SCRIPT...``: prefix every output line of a
worker with ``[rank=N] `` so logs can be told apart per rank (``det trial logs --rank-id N``).

RANK is a number, or a comma list of environment variables tried in order (``RANK,PMI_RANK``).
Lines are split on ``\\n`` and ``\\r`` (tqdm's redraws become lines); over-long lines are broken.
Signals are forwarded to the worker; the exit code is the worker's. ``--no-redirect-stdio`` is
accepted for Determined's command lines: output always goes to this process's own stdout and
stderr here (the trial's log), never to separate files.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import BinaryIO, Optional

from detslurm.launch._agent import unblock_stop_signals
from detslurm.launch._common import forward_signals

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
    # to_group=False: the worker shares our process group (it is not a group leader), so the
    # signal goes to its pid; the preemption SIGTERM must reach it to checkpoint.
    with forward_signals(proc, to_group=False):
        code = proc.wait()
    for t in threads:
        t.join()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
