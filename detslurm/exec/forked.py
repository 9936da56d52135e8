"""Start one of our own launchers as a fork of ``exec.launch`` instead of a fresh interpreter.

``python3 -m determined.launch.torch_distributed ...`` is the usual entrypoint of a multi-node
trial, and ``exec.launch`` (already running, with the protocol modules loaded) would otherwise
start a second Python only to import the same modules again before torchrun can start: interpreter
start-up, ``site`` and its ``.pth`` hooks, and the launcher's imports, on the path from job
start to the first step on every node (bench/launch_overhead.py). A fork skips all of that and
keeps everything a trial can observe: the same process tree (exec.launch -> launcher in a
session of its own -> torchrun -> workers), the same working dir, environment, argv and exit
code, the same signal dispositions (forked before exec.launch installs its forwarding handlers).

Only where a fresh interpreter would run exactly our module (:func:`launcher_for`); anything
else (another interpreter, a ``determined`` or ``detslurm`` of the user's on PYTHONPATH or in
the context, a real ``determined`` installed) still gets a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Optional

# Entrypoint modules this process may run in a fork, and the module whose main() does it. Only
# torch_distributed: the goal's path, and a launcher that imports nothing after start-up.
OWN_LAUNCHERS = {
    "determined.launch.torch_distributed": "detslurm.launch.torch_distributed",
    "detslurm.launch.torch_distributed": "detslurm.launch.torch_distributed",
}

LauncherMain = Callable[[Sequence[str]], int]


def _first_on_path(top: str, entries: Sequence[str]) -> Optional[str]:
    """Where the first of ``entries`` that provides package/module ``top`` has it, or None."""
    for entry in entries:
        if not entry:
            continue
        spec = importlib.machinery.PathFinder.find_spec(top, [entry])
        if spec is not None:
            return spec.origin or entry
    return None


def _ours(module: str, env: Mapping[str, str], workdir: Path, compat_dir: Path, real_determined: bool) -> bool:
    """Whether a fresh ``python -m module`` in ``workdir`` with ``env`` would import our module.

    Its sys.path starts with the working dir (``-m``) and PYTHONPATH, ahead of site-packages:
    a ``determined`` or ``detslurm`` there (the user's context, the user's PYTHONPATH) wins."""
    top = module.partition(".")[0]
    # Relative PYTHONPATH entries are relative to the fresh interpreter's cwd: the workdir.
    entries = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
    ahead = [str(workdir), *(os.path.join(workdir, e) for e in entries)]
    ours = Path(importlib.import_module("detslurm").__file__ or "").resolve().parent
    found_detslurm = _first_on_path("detslurm", ahead)
    # Our determined package imports detslurm: a user's own detslurm ahead of ours would run.
    if found_detslurm is not None and not Path(found_detslurm).resolve().is_relative_to(ours):
        return False
    if top == "determined":
        found = _first_on_path(top, ahead)
        if found is None:
            return not real_determined  # our finder answers last, only when nothing else does
        return Path(found).resolve().is_relative_to(compat_dir.resolve())
    return True


def launcher_for(
    argv: Sequence[str], env: Mapping[str, str], workdir: Path, compat_dir: Path, real_determined: bool
) -> Optional[LauncherMain]:
    """The main() to run in a fork for entrypoint ``argv``, or None for a fresh process.

    ``argv`` must be exactly ``PYTHON -m MODULE ARGS...`` with PYTHON this interpreter (as found
    on the entrypoint's PATH) and MODULE one of :data:`OWN_LAUNCHERS` that resolves to ours."""
    if len(argv) < 3 or argv[1] != "-m" or argv[2] not in OWN_LAUNCHERS:
        return None
    exe = shutil.which(argv[0], path=env.get("PATH"))
    # The same file in the same bin dir: every venv made from one base Python links to the same
    # binary, but a venv's own site-packages (the user's torch) come with where it was started.
    try:
        same = exe is not None and os.path.samefile(exe, sys.executable)
    except OSError:
        same = False
    if exe is None or not same or os.path.dirname(os.path.abspath(exe)) != os.path.dirname(sys.executable):
        return None
    if not _ours(argv[2], env, workdir, compat_dir, real_determined):
        return None
    main: LauncherMain = importlib.import_module(OWN_LAUNCHERS[argv[2]]).main
    return main


class Forked:
    """The forked launcher, waited for as a ``subprocess.Popen`` is (pid, wait, poll)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Its exit code (negative: the signal that killed it); TimeoutExpired as Popen raises."""
        if self.returncode is not None:
            return self.returncode
        if timeout is None:
            _, status = os.waitpid(self.pid, 0)  # retried after our signal handlers run (PEP 475)
            self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout)
            time.sleep(0.05)
        return code


def start(main: LauncherMain, argv: Sequence[str], workdir: Path, env: Mapping[str, str]) -> Forked:
    """Run ``main(argv[3:])`` in a child in a session of its own, cwd ``workdir``, environment
    ``env`` (what ``subprocess.Popen(argv, cwd=..., env=..., start_new_session=True)`` gives)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child would write our buffered output a second time
    # The parent returns once the child leads its own session, as Popen returns after the exec:
    # a signal forwarded to the child's process group right after this returns must find it.
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        os.read(ready_r, 1)  # b"" once the child closed its end
        os.close(ready_r)
        return Forked(pid)
    code = 1
    try:
        os.close(ready_r)
        os.setsid()
        os.close(ready_w)
        os.chdir(workdir)
        os.environ.clear()
        os.environ.update(env)
        # What the fresh interpreter's sys.argv[0] would be (`-m`: the module's file).
        sys.argv = [str(sys.modules[main.__module__].__file__), *argv[3:]]
        code = main(list(argv[3:]))
    except SystemExit as e:  # sys.exit(None) is 0; a message instead of a number is 1
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:  # as an uncaught exception ends a fresh interpreter: a traceback, 1
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            # A closed or broken stream must not keep the child from exiting.
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        # Never return into exec.launch's main: its exit record and clean-up are the parent's.
        os._exit(code & 0xFF if isinstance(code, int) else 1)
