"""What a Slurm job's state means for its trial run: pure mappings from squeue's and sacct's
states, Slurm's restart count and the run's own exit record to a ``JobStatus``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from detslurm.controller.executor import ExitCause, JobState, JobStatus
from detslurm.protocol import NotARunDir, RunPaths
from detslurm.slurm.parse import QueuedJob
from detslurm.slurm.states import SlurmState

# What a job in the queue is, for the controller. COMPLETING counts as running: the final
# state (PREEMPTED, TIMEOUT, ...) comes next, and deciding now would lose how the run ended.
JOB_STATE: dict[SlurmState, JobState] = {
    SlurmState.PENDING: JobState.QUEUED,
    SlurmState.REQUEUED: JobState.QUEUED,
    SlurmState.RUNNING: JobState.RUNNING,
    SlurmState.SUSPENDED: JobState.RUNNING,
    SlurmState.COMPLETING: JobState.RUNNING,
    # A state this Slurm does not know yet (a newer version): still in the queue, so active.
    SlurmState.UNKNOWN: JobState.RUNNING,
    SlurmState.COMPLETED: JobState.EXITED,
    SlurmState.FAILED: JobState.EXITED,
    SlurmState.CANCELLED: JobState.EXITED,
    SlurmState.TIMEOUT: JobState.EXITED,
    SlurmState.PREEMPTED: JobState.EXITED,
    SlurmState.NODE_FAIL: JobState.EXITED,
    SlurmState.OUT_OF_MEMORY: JobState.EXITED,
    SlurmState.BOOT_FAIL: JobState.EXITED,
    SlurmState.DEADLINE: JobState.EXITED,
}

# How a job ended, by Slurm's final state. A boot failure is the node's fault, not the
# trial's; a deadline is a time limit the user set.
EXIT_CAUSE: dict[SlurmState, ExitCause] = {
    SlurmState.COMPLETED: ExitCause.COMPLETED,
    SlurmState.FAILED: ExitCause.FAILED,
    SlurmState.OUT_OF_MEMORY: ExitCause.FAILED,
    SlurmState.CANCELLED: ExitCause.CANCELED_BY_USER,
    SlurmState.TIMEOUT: ExitCause.TIME_LIMIT,
    SlurmState.DEADLINE: ExitCause.TIME_LIMIT,
    SlurmState.PREEMPTED: ExitCause.PREEMPTED,
    SlurmState.NODE_FAIL: ExitCause.NODE_FAILURE,
    SlurmState.BOOT_FAIL: ExitCause.NODE_FAILURE,
}


def requeued_status(code: Optional[int], image_failed: bool, stopped: bool, still_queued: bool) -> JobStatus:
    """How a requeued trial run ended: as Slurm's stop (a preemption), decided by the exit
    record the stopped start wrote and its acknowledged checkpoint, never charged as a restart.

    The requeued job is not let run again: every start of a trial keeps its own run dir and
    exit record, and the controller stays the one place that decides restarts and resumes (a
    start Slurm makes runs nothing, see the template). So the trial is resubmitted from its
    checkpoint as a new run, and a job still queued is cancelled by the controller once the run's
    end is recorded (``cancel_job``). Its later CANCELLED (or COMPLETED) state says nothing of the
    run: Slurm's restart count, read in the same squeue, keeps it Slurm's stop.

    Slurm also requeues a job whose node failed, and squeue does not say which it was: a start
    that left neither an exit record nor a stop signal (its batch shell records each one it
    gets, and writes the record when its step ends) lost its node. Either way no restart is
    charged; only the words differ."""
    lost_node = code is None and not stopped
    end = ended(SlurmState.NODE_FAIL if lost_node else SlurmState.PREEMPTED, code, image_failed, stopped)
    return JobStatus(end.state, end.exit_code, end.cause, SlurmState.REQUEUED.value, cancel_job=still_queued)


def in_queue(q: Optional[QueuedJob]) -> bool:
    """Slurm still holds the job: it waits, runs, or may start again."""
    return q is not None and JOB_STATE[q.state] != JobState.EXITED


def stop_signalled(run_dir: Path) -> bool:
    """Whether the batch shell recorded a stop signal (SIGTERM or the warning signal) for this run.
    Only the file's size is looked at: nothing the run dir holds is parsed here."""
    try:
        return RunPaths.from_run_dir(run_dir).signals.stat().st_size > 0
    except (OSError, NotARunDir):  # no signal file, or a run dir of another executor's shape
        return False


def ended(
    state: Optional[SlurmState], code: Optional[int], image_failed: bool = False, stopped: bool = False
) -> JobStatus:
    """A finished job: Slurm's final state says why, the run's own record gives the code."""
    cause = EXIT_CAUSE.get(state) if state is not None else None
    if cause is None or cause == ExitCause.COMPLETED:
        cause = ExitCause.COMPLETED if code == 0 else ExitCause.FAILED
    if stopped and code != 0 and cause == ExitCause.FAILED:
        # Slurm (or a user's scancel) signalled the job to stop and the trial died of it: a stop
        # that landed where the trial could not checkpoint (starting up, or already finishing) is
        # still Slurm's stop, not the trial's failure. Resubmitted from its latest checkpoint
        # without spending a restart, as a preemption is.
        cause = ExitCause.PREEMPTED
    if image_failed and code != 0 and cause == ExitCause.FAILED:
        # Not the trial's failure (no trial code ran), and one the next run would repeat; a
        # preemption or node failure meanwhile keeps its own cause and is retried as usual.
        cause = ExitCause.IMAGE_UNAVAILABLE
    detail = state.value if state is not None and state != SlurmState.COMPLETED else None
    return JobStatus(JobState.EXITED, code, cause, detail)
