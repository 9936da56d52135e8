"""Our job-state enum and a total mapping from every Slurm job state (squeue %T / sacct)."""

from __future__ import annotations

import enum


class SlurmState(enum.Enum):
    """The Slurm job states detslurm tells apart; Slurm's many others fold into these (SLURM_STATES)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    REQUEUED = "REQUEUED"
    # What a newer Slurm's new state maps to: the caller keeps polling instead of crashing.
    UNKNOWN = "UNKNOWN"

    @property
    def is_terminal(self) -> bool:
        """The job is over for good: Slurm will not run it again (a requeued job shows PENDING again)."""
        return self in _TERMINAL

    @property
    def is_active(self) -> bool:
        """Slurm may still run (or be running) the job, so it must not be resubmitted yet."""
        return self in (
            SlurmState.PENDING,
            SlurmState.RUNNING,
            SlurmState.SUSPENDED,
            SlurmState.COMPLETING,
            # REQUEUED is active: Slurm puts the same job id back in the queue (an admin's scontrol requeue,
            # or a site that forces requeue), so a second submission would run the trial twice.
            SlurmState.REQUEUED,
        )


_TERMINAL = {
    SlurmState.COMPLETED,
    SlurmState.FAILED,
    SlurmState.CANCELLED,
    SlurmState.TIMEOUT,
    # PREEMPTED is terminal: a preempted job that Slurm requeues goes back to PENDING instead, and
    # the controller replaces it (controller/slurm_executor.py).
    SlurmState.PREEMPTED,
    SlurmState.NODE_FAIL,
    SlurmState.OUT_OF_MEMORY,
    SlurmState.BOOT_FAIL,
    SlurmState.DEADLINE,
}

# Every state Slurm 22.05 prints (src/common/slurm_protocol_defs.c job_state_string), long and
# compact forms. Anything else maps to UNKNOWN (a newer Slurm), never to an exception.
SLURM_STATES: dict[str, SlurmState] = {
    "PENDING": SlurmState.PENDING,
    "PD": SlurmState.PENDING,
    "CONFIGURING": SlurmState.PENDING,
    "CF": SlurmState.PENDING,
    # Held or still being configured: not running yet, and Slurm may still start it.
    "REQUEUE_HOLD": SlurmState.PENDING,
    "RH": SlurmState.PENDING,
    "REQUEUE_FED": SlurmState.PENDING,
    "RF": SlurmState.PENDING,
    "RESV_DEL_HOLD": SlurmState.PENDING,
    "RD": SlurmState.PENDING,
    "RUNNING": SlurmState.RUNNING,
    "R": SlurmState.RUNNING,
    "RESIZING": SlurmState.RUNNING,
    "RS": SlurmState.RUNNING,
    "SIGNALING": SlurmState.RUNNING,
    "SI": SlurmState.RUNNING,
    # Burst-buffer stage-out runs after the script has exited: the job is finishing, not running.
    "STAGE_OUT": SlurmState.COMPLETING,
    "SO": SlurmState.COMPLETING,
    "SUSPENDED": SlurmState.SUSPENDED,
    "S": SlurmState.SUSPENDED,
    # STOPPED: the processes were sent SIGSTOP; they still exist but do not run.
    "STOPPED": SlurmState.SUSPENDED,
    "ST": SlurmState.SUSPENDED,
    "COMPLETING": SlurmState.COMPLETING,
    "CG": SlurmState.COMPLETING,
    "COMPLETED": SlurmState.COMPLETED,
    "CD": SlurmState.COMPLETED,
    "FAILED": SlurmState.FAILED,
    "F": SlurmState.FAILED,
    # SPECIAL_EXIT: requeued into a held state after exiting with a site-chosen code; it did not
    # finish its work.
    "SPECIAL_EXIT": SlurmState.FAILED,
    "SE": SlurmState.FAILED,
    "CANCELLED": SlurmState.CANCELLED,
    "CA": SlurmState.CANCELLED,
    # REVOKED: a federated sibling cluster started the job, so this copy was withdrawn.
    "REVOKED": SlurmState.CANCELLED,
    "RV": SlurmState.CANCELLED,
    "TIMEOUT": SlurmState.TIMEOUT,
    "TO": SlurmState.TIMEOUT,
    "PREEMPTED": SlurmState.PREEMPTED,
    "PR": SlurmState.PREEMPTED,
    "NODE_FAIL": SlurmState.NODE_FAIL,
    "NF": SlurmState.NODE_FAIL,
    "OUT_OF_MEMORY": SlurmState.OUT_OF_MEMORY,
    "OOM": SlurmState.OUT_OF_MEMORY,
    "BOOT_FAIL": SlurmState.BOOT_FAIL,
    "BF": SlurmState.BOOT_FAIL,
    "DEADLINE": SlurmState.DEADLINE,
    "DL": SlurmState.DEADLINE,
    "REQUEUED": SlurmState.REQUEUED,
    "RQ": SlurmState.REQUEUED,
}


def state_from_slurm(text: str) -> SlurmState:
    """``CANCELLED by 0`` (sacct) and flags such as ``RUNNING+`` are reduced to the base state."""
    # sacct marks a value cut to its column width with "+" (``CANCELLED+``); the prefix is still the state.
    base = text.strip().split(" ")[0].rstrip("+*")
    return SLURM_STATES.get(base.upper(), SlurmState.UNKNOWN)
