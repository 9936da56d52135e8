"""What the controller needs from whatever runs trial runs: local processes or Slurm jobs.

The controller never asks which executor it has: everything it may call is declared in
:class:`Executor`, and how a run ended reaches it as an :class:`ExitCause`, never as text.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from detslurm.expconf import ExperimentConfig


class JobState(enum.Enum):
    """The executor's coarse view of a job; how it ended is in JobStatus.cause."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    EXITED = "EXITED"
    UNKNOWN = "UNKNOWN"  # the executor has no record of the job


class ExitCause(enum.Enum):
    """How a trial run ended. Restart accounting decides on this (controller/decide.py); the
    text users see is :attr:`text`, derived here and nowhere else."""

    COMPLETED = "completed"
    FAILED = "failed"
    PREEMPTED = "preempted"
    # Spends a restart (controller/decide.py): a run that never checkpoints before its limit would
    # otherwise be resubmitted forever.
    TIME_LIMIT = "time limit"
    NODE_FAILURE = "node failure"
    CANCELED_BY_USER = "canceled by user"
    CANCELED_BY_DETSLURM = "canceled by detslurm"
    # The controller died between recording a run and submitting it.
    NEVER_STARTED = "never started"
    # Gone from the scheduler with no exit record and no accounting to say how it ended.
    LOST = "lost"
    # sbatch's reply never came (timeout): the job may or may not exist until the queue says.
    SUBMIT_UNKNOWN = "submit unknown"
    # The trial itself reported invalid hyperparameters (Core API InvalidHP) before exiting.
    INVALID_HP = "invalid hyperparameters"
    # The scheduler will never start the job as submitted (Slurm pends it for a reason that never
    # clears: PartitionNodeLimit, InvalidAccount, ...). Ends the trial; a restart would only
    # queue the same impossible job again.
    UNSCHEDULABLE = "unschedulable"
    # The container runtime could not provide the image (missing, unpullable, no python3): no
    # trial code ran, and a new run would fail the same way, so the trial ends without retries.
    IMAGE_UNAVAILABLE = "image unavailable"

    @property
    def text(self) -> str:
        return _TEXT[self]

    @classmethod
    def parse(cls, stored: str | None) -> ExitCause | None:
        """A stored value back to a cause; values written by older versions are mapped too."""
        if stored is None:
            return None
        try:
            return cls(stored)
        except ValueError:
            return _LEGACY.get(stored)


_TEXT = {
    ExitCause.COMPLETED: "exited normally",
    ExitCause.FAILED: "failed",
    ExitCause.PREEMPTED: "preempted by the scheduler",
    ExitCause.TIME_LIMIT: "reached its time limit",
    ExitCause.NODE_FAILURE: "lost its node (node failure)",
    ExitCause.CANCELED_BY_USER: "the Slurm job was canceled outside detslurm (scancel)",
    ExitCause.CANCELED_BY_DETSLURM: "canceled by detslurm",
    ExitCause.NEVER_STARTED: "never started (the controller stopped before submitting it)",
    ExitCause.LOST: "left the queue without an exit record",
    ExitCause.SUBMIT_UNKNOWN: "submission not confirmed by the scheduler",
    ExitCause.INVALID_HP: "reported invalid hyperparameters",
    ExitCause.UNSCHEDULABLE: "can never start on this cluster (canceled)",
    ExitCause.IMAGE_UNAVAILABLE: "the container runtime could not provide the image",
}
# Display strings stored by versions before the enum (TrialRun.exit_reason).
_LEGACY = {
    "canceled": ExitCause.CANCELED_BY_USER,
    "job left the queue without an exit record": ExitCause.LOST,
    "process gone without an exit record": ExitCause.LOST,
    "killed before recording its exit": ExitCause.FAILED,
    "submit failed": ExitCause.FAILED,
    "out of memory": ExitCause.FAILED,
    "boot failure": ExitCause.NODE_FAILURE,
    "deadline": ExitCause.TIME_LIMIT,
    "INVALID_HP": ExitCause.INVALID_HP,
}


class SchedulerUnavailable(Exception):
    """The scheduler did not answer a submission (down, restarting): nothing was submitted;
    the controller takes the run back and submits it again later."""


class SubmitLater(SchedulerUnavailable):
    """Slurm refused the submission for a limit that frees up as jobs end (MaxSubmitJobs,
    MaxJobCount): nothing was submitted, so like an unreachable scheduler the run is taken back
    and submitted on a later tick, spending no restart and failing nothing. ``warn`` is set on
    the first refusal of a throttled stretch only, so the trial's events say it once."""

    def __init__(self, message: str, warn: bool = True) -> None:
        super().__init__(message)
        self.warn = warn


class HoldingEnded(Exception):
    """The job the experiment's trials run in as job steps (``slurm.in_allocation``) has ended,
    or ends before a run could checkpoint: nothing more starts there. The controller pauses the
    experiment, as the allocation's end is a preemption; ``det e activate`` continues it."""


class SubmitUnknown(Exception):
    """The submission was sent but its reply never came: the job may exist. The controller
    must look for it (by its identity) before it may submit the run again."""


@dataclass(frozen=True)
class JobStatus:
    """What poll() reports for one job; exit_code and cause are set once it has ended."""

    state: JobState
    exit_code: int | None = None
    cause: ExitCause | None = None
    # Scheduler detail shown beside the cause (e.g. Slurm's OUT_OF_MEMORY) or a pending reason.
    detail: str | None = None
    # The run has ended but the scheduler still holds its job (Slurm requeued it): the controller
    # cancels it once the run's end is recorded (Controller.tick), so the store says how the run
    # ended before the job's own final state (CANCELLED) could be read as a user's cancel.
    cancel_job: bool = False


@dataclass(frozen=True)
class ExpRef:
    """An experiment, as an executor that keeps places for its runs (pilot workers) tells its
    jobs apart: its id and its dir (whose tag is in the jobs' comments)."""

    id: int
    dir: Path


@dataclass(frozen=True)
class Demand:
    """What one experiment with pilot workers needs of them after its step: ``runs`` of its
    trial runs are in workers or wait for a place (0 once it is paused or has ended)."""

    exp: ExpRef
    config: ExperimentConfig
    runs: int


@dataclass(frozen=True)
class RunSpec:
    """Everything needed to start one trial run (pure data: the plan)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    run_dir: Path
    log_path: Path
    exp_dir: Path
    identity: tuple[int, int, int]  # experiment, trial, run
    config: ExperimentConfig


class Executor(Protocol):
    """A backend for trial runs. ``submit_many`` and ``kill_many`` are the batch forms the
    controller always uses (a backend may implement them one run at a time)."""

    kind: str
    # Why the last capacity() said 0 without asking the scheduler's limits (it did not answer),
    # for the controller to tell the waiting trials; None when it answered.
    unreachable: str | None

    def capacity(self, config: ExperimentConfig | None = None, exp: ExpRef | None = None) -> int | None:
        """How many more runs (of ``config``, where the room depends on a run's shape; of
        experiment ``exp``, where its own pilot workers hold them) may start now (None: no
        limit, the scheduler decides); the rest wait for a later tick. Raises
        :class:`HoldingEnded` when runs of ``config`` can never start where they go."""

    def settle(self, demands: Sequence[Demand]) -> list[tuple[int, str | HoldingEnded]]:
        """After a tick: keep the places that experiments' runs need (pilot workers: submit the
        missing, end the idle); (experiment, problem) for each that failed, a HoldingEnded
        where its runs can never start in the places kept (the experiment is paused). An
        executor that keeps no places does nothing."""

    def resources_type(self) -> str:
        """``DET_RESOURCES_TYPE`` for runs of this backend."""

    def submit_many(self, specs: Sequence[RunSpec]) -> list[str | Exception]:
        """Start runs; each spec's job id, or the error that kept it from starting
        (:class:`SchedulerUnavailable`, :class:`SubmitUnknown` or any other)."""

    def poll(self, jobs: Mapping[str, Path]) -> dict[str, JobStatus]:
        """One batched status query for all the given jobs (job id -> run dir)."""

    def recover(self, identity: tuple[int, int, int], exp_dir: str) -> str | None:
        """The job id of a run whose submission was not recorded (the controller crashed, or
        the submission's reply was lost), found by the run's identity; None if no such job."""

    def kill_many(self, job_ids: Sequence[str]) -> None:
        """Stop these jobs now (one call for all of them where the backend allows it)."""

    def signal(self, job_id: str, signum: int) -> None: ...


def submit_each(specs: Sequence[RunSpec], start: Callable[[RunSpec], str]) -> list[str | Exception]:
    """``submit_many`` for executors that start runs one by one: each run's job id, or the
    error that kept it from starting (one that fails leaves the others their chance)."""
    out: list[str | Exception] = []
    for spec in specs:
        try:
            out.append(start(spec))
        except Exception as e:  # this run did not start; the others may
            out.append(e)
    return out
