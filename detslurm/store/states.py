"""The states of experiments, trials and runs: the one definition the ORM models, the read
layer (store.reads) and the controller share. The standard library only: the read commands use
it without importing SQLAlchemy."""

from __future__ import annotations

import enum


# Determined's experiment and trial states and names, so ``det experiment list`` reads the same.
# Stored as strings (not a DB enum) so adding a state needs no migration of existing rows.
class _ValueEnum(str, enum.Enum):
    """A state that prints as its value ("COMPLETED"): tables, messages and f-strings show it to
    users, and Python 3.11 would print a str-mixin enum as "TrialState.COMPLETED"."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ExperimentState(_ValueEnum):
    ACTIVE = "ACTIVE"
    PAUSED = "PAUSED"
    STOPPING_CANCELED = "STOPPING_CANCELED"
    STOPPING_KILLED = "STOPPING_KILLED"
    STOPPING_COMPLETED = "STOPPING_COMPLETED"
    STOPPING_ERROR = "STOPPING_ERROR"
    CANCELED = "CANCELED"
    COMPLETED = "COMPLETED"
    ERROR = "ERROR"
    DELETING = "DELETING"

    @property
    def is_terminal(self) -> bool:
        return self in (ExperimentState.CANCELED, ExperimentState.COMPLETED, ExperimentState.ERROR)

    @property
    def is_stopping(self) -> bool:
        return self.value.startswith("STOPPING_")


class TrialState(_ValueEnum):
    ACTIVE = "ACTIVE"
    PAUSED = "PAUSED"
    STOPPING_CANCELED = "STOPPING_CANCELED"
    STOPPING_KILLED = "STOPPING_KILLED"
    STOPPING_COMPLETED = "STOPPING_COMPLETED"
    STOPPING_ERROR = "STOPPING_ERROR"
    CANCELED = "CANCELED"
    COMPLETED = "COMPLETED"
    ERROR = "ERROR"

    @property
    def is_terminal(self) -> bool:
        return self in (TrialState.CANCELED, TrialState.COMPLETED, TrialState.ERROR)


class RunState(_ValueEnum):
    """A trial run (one attempt = one local process or one Slurm job)."""

    PENDING = "PENDING"  # recorded, not yet handed to the executor
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    EXITED = "EXITED"  # exit code known, decision taken
    LOST = "LOST"  # the executor no longer knows it and no exit record exists

    @property
    def is_terminal(self) -> bool:
        return self in (RunState.EXITED, RunState.LOST)
