"""What the controller needs from whatever runs trial runs: local processes or Slurm jobs."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class JobState(enum.Enum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    EXITED = "EXITED"
    UNKNOWN = "UNKNOWN"  # the executor has no record of the job


class SchedulerUnavailable(Exception):
    """The scheduler did not answer a submission (down, restarting): nothing was submitted;
    the controller takes the run back and submits it again later."""


@dataclass(frozen=True)
class JobStatus:
    state: JobState
    exit_code: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class RunSpec:
    """Everything needed to start one trial run (pure data: the plan)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    run_dir: Path
    log_path: Path
    slots: int = 1
    identity: tuple[int, int, int] = (0, 0, 0)  # experiment, trial, run
    config: dict[str, Any] = field(default_factory=dict)


class Executor(Protocol):
    kind: str

    def capacity(self) -> int | None:
        """How many more runs may start now (None: no local limit, the scheduler decides)."""

    def submit(self, spec: RunSpec) -> str:
        """Start the run; returns its job id."""

    def poll(self, jobs: Mapping[str, Path]) -> dict[str, JobStatus]:
        """One batched status query for all the given jobs (job id -> run dir)."""

    def recover(self, identity: tuple[int, int, int], exp_dir: str = "") -> int | str | None:
        """The job id of a run whose submission was not recorded (the controller crashed)."""

    def kill(self, job_id: str) -> None: ...

    def signal(self, job_id: str, signum: int) -> None: ...
