"""What every trial run executes first (locally or as the Slurm job step).

1. extract the experiment's context snapshot into the run's working dir;
2. run ``startup-hook.sh`` if the context has one;
3. run the entrypoint (legacy ``model_def:Trial`` -> autohorovod --trial; a string -> sh -c;
   a list as is), forwarding signals to its process group;
4. write the exit record (``RunPaths.exit_record``) atomically, so the controller learns the
   exit code even when it was not the parent (a restarted controller, or a Slurm job).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Optional

from detslurm import settings
from detslurm.context import extract
from detslurm.errors import ContextError
from detslurm.exec import forked
from detslurm.exec import workdir as workdir_mod
from detslurm.exec.workdir import Workdir, WorkdirError
from detslurm.expconf.view import ConfigView
from detslurm.launch._pidwait import ChildWait
from detslurm.protocol import (
    IN_CONTAINER_ENV,
    BadRecord,
    ControlRecord,
    ExitRecord,
    NotARunDir,
    RunPaths,
    entrypoint_from_env,
    expand_nodelist,
)

LEGACY_TRIAL = re.compile(r"^[a-zA-Z0-9_.]+:[a-zA-Z0-9_]+$")
COMPAT_DIR = Path(__file__).resolve().parent.parent / "_compat"


SHELL_SYNTAX = re.compile(r"[|&;<>()$`\\*?\[\]{}~!\n#]")


def entrypoint_argv(entrypoint: str | Sequence[str], python: str = sys.executable) -> list[str]:
    """Pure: the argv for an expconf entrypoint.

    A simple command (``python3 train.py --lr 0.1``) runs directly, without a shell in between:
    Slurm signals every process of a job step, and a shell killed by SIGTERM would report the
    run as failed while the trainer below it is still checkpointing. Only commands that need
    shell syntax go through ``sh -c``.
    """
    if isinstance(entrypoint, str):
        if LEGACY_TRIAL.match(entrypoint):
            # Seeds 000/001: a legacy trial class runs alone on one slot and under Horovod on
            # several (torch_distributed where Horovod is missing); see launch/autohorovod.py.
            return [python, "-m", "detslurm.launch.autohorovod", "--trial", entrypoint]
        if not SHELL_SYNTAX.search(entrypoint):
            try:
                words = shlex.split(entrypoint)
            except ValueError:
                words = []
            if words and "=" not in words[0]:
                return words
        return ["sh", "-c", entrypoint]
    return list(entrypoint)


def _has_real_determined() -> bool:
    """A real `determined` package installed wins over our compatibility shim."""
    import importlib.util

    spec = importlib.util.find_spec("determined")
    return spec is not None and spec.origin is not None and str(COMPAT_DIR) not in spec.origin


def child_env(env: dict[str, str], workdir: Path) -> dict[str, str]:
    out = dict(env)
    bindir = str(Path(sys.executable).parent)
    # `python3` in an entrypoint must be this interpreter (the one that has detslurm).
    out["PATH"] = bindir + os.pathsep + out.get("PATH", os.defpath)
    paths = [str(workdir)]
    # In a container detslurm comes from the host (slurm/containers.py): an image's own
    # `determined` would look for a master that does not exist, so the shim goes first there.
    if env.get(IN_CONTAINER_ENV) or not _has_real_determined():
        paths.append(str(COMPAT_DIR))
    if out.get("PYTHONPATH"):
        paths.append(out["PYTHONPATH"])
    out["PYTHONPATH"] = os.pathsep.join(paths)
    out["DET_WORKDIR"] = str(workdir)
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out


# Variables of the hook's shell that are not the hook's exports.
_SHELL_NOISE = ("PWD", "SHLVL", "_", "OLDPWD")


def _run_hook(workdir: Path, env: dict[str, str]) -> int:
    hook = workdir / "startup-hook.sh"
    if not hook.exists():
        return 0
    print(f"detslurm: running {hook.name}", flush=True)
    # The hook may export variables for the entrypoint, so source it and read the environment
    # back. Through a pipe, never a file: the environment holds the experiment config and every
    # environment_variables secret (the old .hook-env file was world-readable
    # and its predictable name could be a planted symlink). The hook runs with the pipe closed,
    # so a background process it starts cannot hold it open and hang us.
    read_fd, write_fd = os.pipe()
    fd = str(write_fd)
    script = f"set -e; . ./startup-hook.sh {fd}>&-; env -0 >&{fd}; exec {fd}>&-"
    try:
        proc = subprocess.Popen(["bash", "-c", script], cwd=workdir, env=env, pass_fds=(write_fd,))
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        dump = pipe.read()
    rc = proc.wait()
    if rc == 0:
        for item in dump.split(b"\0"):
            k, sep, v = item.decode(errors="replace").partition("=")
            if sep and k not in _SHELL_NOISE:
                env[k] = v
    return rc


# The signals that mean "stop and checkpoint" (Slurm's SIGTERM and the warning signals); SIGINT
# and SIGHUP are forwarded too but start no preemption_timeout clock.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def preemption_timeout_s(env: dict[str, str]) -> Optional[float]:
    """expconf ``preemption_timeout``: in Determined, how long the master waits for a task told to
    stop before it kills it. None (unset) means no limit of our own: Slurm's KillWait ends it."""
    # Validated at create time; the view re-checks it, as the environment is text.
    value = ConfigView.from_json(env.get("DET_EXPERIMENT_CONFIG")).preemption_timeout
    return None if value is None else float(value)


class _StopClock:
    """When the first stop request reached this launcher (a signal or the control file)."""

    def __init__(self) -> None:
        self.at: Optional[float] = None  # time.monotonic(); set by a signal handler (a plain store)

    def start(self) -> None:
        if self.at is None:
            self.at = time.monotonic()


def _start(argv: list[str], workdir: Path, env: dict[str, str]) -> subprocess.Popen[bytes] | forked.Forked:
    """The entrypoint in a session of its own: our own launcher as a fork of this process where
    a fresh interpreter would run exactly it (detslurm/exec/forked.py), else a new process."""
    main = forked.launcher_for(argv, env, workdir, COMPAT_DIR, _has_real_determined())
    if main is not None:
        return forked.start(main, argv, workdir, env)
    return subprocess.Popen(argv, cwd=workdir, env=env, start_new_session=True)


def _run(argv: list[str], workdir: Path, env: dict[str, str], control: Optional[Path] = None) -> int:
    """The entrypoint in its own process group, with our signals forwarded to that group."""
    # In a Slurm job the entrypoint usually gets Slurm's SIGTERM twice: once from slurmstepd,
    # which signals every process of the step whatever its session, and once forwarded from
    # here. Forwarding stays, for runs where only this process is signalled (local runs,
    # `kill` by hand, the batch shell's warning signal); the trial's handler treats repeats
    # as one preemption (detslurm.core._preempt explains why it must).
    from detslurm.launch._common import FORWARDED

    proc = _start(argv, workdir, env)
    clock = _StopClock()

    def forward(signum: int, _frame: Optional[FrameType]) -> None:
        if signum in _STOP_SIGNALS:
            clock.start()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    old = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        return _wait(proc, clock, preemption_timeout_s(env), control)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _wait(
    proc: subprocess.Popen[bytes] | forked.Forked,
    clock: _StopClock,
    timeout_s: Optional[float],
    control: Optional[Path],
) -> int:
    """Wait for the entrypoint; with a preemption_timeout, kill it that long after it was told
    to stop (a trial that never reaches its checkpoint must not hold the allocation)."""
    if timeout_s is None:
        # Nothing to time: block in waitpid instead of waking every few ms (Popen.wait with a
        # timeout polls) beside ranks that are importing their framework.
        return proc.wait()
    with ChildWait(proc) as child:
        while (code := child.wait(0.5)) is None:
            if _stop_clock_ran_out(clock, timeout_s, control):
                print(
                    f"detslurm: the trial did not stop within preemption_timeout ({timeout_s:.0f} s); killing it",
                    file=sys.stderr,
                    flush=True,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait()
        return code


def _stop_clock_ran_out(clock: _StopClock, timeout_s: float, control: Optional[Path]) -> bool:
    if clock.at is None and control is not None and _control_says_stop(control):
        clock.start()  # pause, kill, early stop from the controller: the same clock
    return clock.at is not None and time.monotonic() - clock.at > timeout_s


def _control_says_stop(control: Path) -> bool:
    try:
        record = ControlRecord.read(control)
    except BadRecord:
        return False  # mid-replace: read again at the next poll
    return record is not None and record.preempt


def slurm_env(env: dict[str, str]) -> dict[str, str]:
    """Inside a Slurm job step: this node's rank, every node's address, this node's slots.

    Addresses come from the job's node list (never `hostname`, which can be the same on all
    nodes); the chief is the first node of the list.
    """
    out: dict[str, str] = {}
    # A job step's own nodes: a trial run as a step of a held job has only some of the job's.
    nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    if nodes:
        out["DET_CONTAINER_ADDRS"] = json.dumps(nodes)
        out["DET_CHIEF_IP"] = nodes[0]
    out["DET_CONTAINER_RANK"] = env.get("SLURM_NODEID", "0")
    out["DET_AGENT_ID"] = env.get("SLURMD_NODENAME", os.uname().nodename)
    gpus = env.get("CUDA_VISIBLE_DEVICES", "")
    if gpus and gpus != "NoDevFiles":
        out["DET_SLOT_IDS"] = json.dumps(list(range(len(gpus.split(",")))))
    else:
        out["DET_SLOT_IDS"] = json.dumps(list(range(int(env.get("SLURM_CPUS_PER_TASK") or 1))))
    return out


def _in_slurm_job(env: dict[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID")) and env.get("DET_RESOURCES_TYPE") == "slurm-job"


def _workdir(env: dict[str, str], run: RunPaths) -> tuple[Path, Optional[Workdir]]:
    """(working dir, the node-local dir to remove at the end).

    In a Slurm job the working dir is node-local, fresh and private (detslurm/exec/workdir.py);
    our own dirs that dead launchers left on this node are swept first. A run that is not a
    Slurm job works in its run dir (inside the 0700 experiment dir).
    """
    if _in_slurm_job(env):
        base = workdir_mod.choose_base(env)
        workdir_mod.sweep_stale(base)
        wd = workdir_mod.create(base, env["SLURM_JOB_ID"], env.get("SLURM_NODEID", "0"))
        return wd.path, wd
    return settings.WORKDIR.get(env) or run.local_workdir, None


def main(argv: Sequence[str] | None = None) -> int:
    env = dict(os.environ)
    try:
        run = RunPaths.from_env(env)
    except NotARunDir as e:
        print(f"detslurm: {e}", file=sys.stderr, flush=True)
        return 2
    # In a Slurm job each node's launcher records its own exit; the batch shell writes the run's.
    exit_path = run.exit_record
    if _in_slurm_job(env):
        env.update(slurm_env(env))
        exit_path = run.node_exit_record(env.get("SLURM_NODEID", "0"))
    started = time.time()
    rc = 1
    node_local: Optional[Workdir] = None
    try:
        entrypoint = entrypoint_from_env(env)
        workdir, node_local = _workdir(env, run)
        extract(run.exp.context, workdir)
        cenv = child_env(env, workdir)
        rc = _run_hook(workdir, cenv)
        if rc != 0:
            print(f"detslurm: startup-hook.sh failed with exit code {rc}", file=sys.stderr, flush=True)
        else:
            rc = _run(entrypoint_argv(entrypoint), workdir, cenv, run.control)
    except (ContextError, WorkdirError, ValueError) as e:
        print(f"detslurm: {e}", file=sys.stderr, flush=True)
        rc = 1
    except FileNotFoundError as e:
        print(f"detslurm: cannot run the entrypoint: {e}", file=sys.stderr, flush=True)
        rc = 127
    finally:
        ExitRecord(code=rc, start=started, end=time.time()).write(exit_path)
        if node_local is not None:
            workdir_mod.remove(node_local)  # node-local scratch
    return rc


if __name__ == "__main__":
    sys.exit(main())
