"""Run trial runs as local processes (``det e create --local``), with bounded concurrency."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import psutil

from detslurm import settings
from detslurm.controller.executor import (
    Demand,
    ExitCause,
    ExpRef,
    HoldingEnded,
    JobState,
    JobStatus,
    RunSpec,
    submit_each,
)

if TYPE_CHECKING:
    from detslurm.expconf import ExperimentConfig
from detslurm.protocol import exit_outcome, exit_record_of


class LocalExecutor:
    """Trial runs as child processes of the controller, at most ``max_parallel`` at a time."""

    kind = "local"
    unreachable: str | None = None  # local processes need no scheduler

    def __init__(self, max_parallel: int) -> None:
        self.max_parallel = max_parallel
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def capacity(self, config: ExperimentConfig | None = None, exp: ExpRef | None = None) -> int | None:
        running = sum(1 for p in self._procs.values() if p.poll() is None)
        return max(0, self.max_parallel - running)

    def settle(self, demands: Sequence[Demand]) -> list[tuple[int, str | HoldingEnded]]:
        return []  # local processes need no place kept for them

    def resources_type(self) -> str:
        return "local-process"

    def submit_many(self, specs: Sequence[RunSpec]) -> list[str | Exception]:
        return submit_each(specs, self.submit)

    def submit(self, spec: RunSpec) -> str:
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        # A controller started inside a Slurm job (or a trial) must not pass its own ids on: inherited
        # SLURM_* would make the launcher treat a local run as a job step, DET_* would name another
        # trial, and the job protocol's variables (the run secret above all) are set fresh per run.
        stale = settings.protocol_names()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_", "SLURM_")) and k not in stale}
        env.update(spec.env)
        with _open_log(spec.log_path) as log:
            proc = subprocess.Popen(
                spec.argv,
                env=env,
                cwd=spec.run_dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own session: a Ctrl-C at the user's terminal reaches the CLI, not the trial directly.
                start_new_session=True,
                preexec_fn=_stop_with_parent(),
            )
        create = psutil.Process(proc.pid).create_time()
        # pid plus start time survives a controller restart and cannot match a later process that reuses
        # the pid; the run dir lets poll() find the exit record with no other state.
        job_id = f"{proc.pid}@{create:.3f}@{spec.run_dir}"
        self._procs[job_id] = proc
        return job_id

    @staticmethod
    def _parse(job_id: str) -> tuple[int, float, str]:
        # maxsplit 2: the run dir may itself contain "@".
        pid, create, run_dir = job_id.split("@", 2)
        return int(pid), float(create), run_dir

    def _alive(self, job_id: str) -> bool:
        pid, create, _ = self._parse(job_id)
        try:
            p = psutil.Process(pid)
            # A zombie has already exited and only awaits reaping: treat it as gone.
            return abs(p.create_time() - create) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def recover(self, identity: tuple[int, int, int], exp_dir: str) -> str | None:
        return None  # local runs record their job id in the run dir before anything else

    def poll(self, jobs: Mapping[str, Path]) -> dict[str, JobStatus]:
        out = {}
        for jid in jobs:
            proc = self._procs.get(jid)
            code = proc.poll() if proc is not None else None
            if proc is not None and code is None:
                out[jid] = JobStatus(JobState.RUNNING)
                continue
            # Not our child (the controller restarted since it started): psutil is the only way to ask.
            if proc is None and self._alive(jid):
                out[jid] = JobStatus(JobState.RUNNING)
                continue
            # The exit record the launcher wrote is preferred to the process's own code: it is what the
            # trial's launcher saw from the entrypoint.
            record = exit_outcome(exit_record_of(Path(self._parse(jid)[2])))
            if record.code is not None:
                cause = ExitCause.COMPLETED if record.code == 0 else ExitCause.FAILED
                out[jid] = JobStatus(JobState.EXITED, record.code, cause)
            elif record.problem is not None:
                # What the trial left is unusable: the launcher's own exit code is the next best.
                why = f"unreadable exit record: {record.problem}"
                out[jid] = JobStatus(JobState.EXITED, code, ExitCause.FAILED, why)
            elif code is not None:
                out[jid] = JobStatus(JobState.EXITED, code, ExitCause.FAILED, "killed before recording its exit")
            else:
                # Started by a driver that has ended: its end sent the launcher the preemption signal
                # (_stop_with_parent), which ends a launcher still setting up (extracting the context,
                # running the startup hook) before it can write a record. Free, as a preemption is;
                # decide.py still charges a streak of them that never checkpoints.
                out[jid] = JobStatus(
                    JobState.UNKNOWN, None, ExitCause.PREEMPTED, "its driver ended before it recorded an exit"
                )
            self._procs.pop(jid, None)
        return out

    def signal(self, job_id: str, signum: int) -> None:
        """Signal the run's launcher, which forwards to the entrypoint's process group."""
        if not self._alive(job_id):
            return
        pid, _, _ = self._parse(job_id)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    def kill_many(self, job_ids: Sequence[str]) -> None:
        for job_id in job_ids:
            self.kill(job_id)

    def kill(self, job_id: str) -> None:
        """SIGKILL the whole tree: the entrypoint runs in its own session, so a process-group
        kill of the launcher would miss it."""
        if not self._alive(job_id):
            return
        pid, _, _ = self._parse(job_id)
        try:
            root = psutil.Process(pid)
            procs = root.children(recursive=True) + [root]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)


# PR_SET_PDEATHSIG from <linux/prctl.h>.
_PR_SET_PDEATHSIG = 1


def _stop_with_parent() -> Callable[[], None] | None:
    """For the launcher's child side of the fork, on Linux: the kernel sends the launcher the
    preemption signal (SIGTERM, which it forwards to the trial) when the thread that started it
    ends (the driver's main thread: its end is the process's), however it ends (SIGKILL
    included). The trial then checkpoints and exits as after a pause, and no trial outlives the
    `det` that drives it (cli/local.py). Elsewhere None: a read that finds the driver gone
    pauses the experiment, and the trials stop at its control file."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def child() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the driver ended between the fork and the prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return child


def _open_log(path: Path) -> BinaryIO:
    """The run's log, for appending. The run dir may already hold what an earlier run of the
    trial put there: a symlink at the log's name is not followed, and a FIFO fails the open
    (ENXIO) instead of blocking the controller, as anything but a regular file does."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)  # the trial writes its output through it
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise
