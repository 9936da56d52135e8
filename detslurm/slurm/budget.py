"""The time a site gives a trial to stop, and the check that its measured stop times fit.

When Slurm ends a job itself it signals first and kills later (slurm.conf(5), preempt.html):

- preemption (PreemptMode=CANCEL/REQUEUE): SIGTERM at once, the job's end moved to now +
  the partition's GraceTime, then SIGTERM again and SIGKILL KillWait seconds later;
- the time limit: the site's warning signal ``signal_lead_s`` before it (``--signal=B:...``),
  then SIGTERM and SIGKILL KillWait seconds later;
- ``scancel``/``scontrol requeue``: SIGTERM, SIGKILL after KillWait.

A trial's stop time (signal -> acknowledged checkpoint, measured from its PreemptAck event by
controller/apply.py) must fit the tightest of the windows Slurm itself imposes: preemption and
the time limit. A stop that took longer was cut short somewhere, or will be on the next
preemption, and everything since the trial's previous checkpoint is lost then.
Pure functions: the caller probes Slurm (`SlurmClient.capabilities()` and `.partitions()`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from detslurm.slurm.parse import Capabilities
from detslurm.slurm.partitions import PartitionInfo
from detslurm.slurm.site import SiteConfig


@dataclass(frozen=True)
class Budget:
    """Seconds a trial has between Slurm's first signal and SIGKILL, per way of ending."""

    partition: str
    kill_wait_s: int
    grace_time_s: int
    lead_s: int  # the site's warning signal before the time limit

    @property
    def preemption_s(self) -> int:
        return self.grace_time_s + self.kill_wait_s

    @property
    def time_limit_s(self) -> int:
        return self.lead_s + self.kill_wait_s

    @property
    def seconds(self) -> int:
        """The tightest window Slurm imposes by itself (preemption or the time limit)."""
        return min(self.preemption_s, self.time_limit_s)

    def explain(self) -> str:
        return (
            f"partition {self.partition}: preemption allows {self.preemption_s} s "
            f"(GraceTime {self.grace_time_s} + KillWait {self.kill_wait_s}), the time limit "
            f"{self.time_limit_s} s (warning lead {self.lead_s} + KillWait {self.kill_wait_s})"
        )


def preemption_budget(caps: Capabilities, partition: Optional[PartitionInfo], site: SiteConfig) -> Budget:
    """The budget for trials on ``partition`` (None: unknown partition, no GraceTime)."""
    return Budget(
        partition=partition.name if partition is not None else "?",
        kill_wait_s=caps.kill_wait_s,
        grace_time_s=partition.grace_time_s if partition is not None else 0,
        lead_s=site.signal_lead_s,
    )


@dataclass(frozen=True)
class SlowStop:
    """A run whose stop took longer than the site allows."""

    trial_id: int
    run_id: int
    measured_s: float
    budget: Budget

    def message(self) -> str:
        return (
            f"warning: trial {self.trial_id} run {self.run_id} took {self.measured_s:.1f} s from Slurm's "
            f"signal to its acknowledged checkpoint, more than the {self.budget.seconds} s the site allows "
            f"({self.budget.explain()}); checkpoint less state or more often, or ask for a longer GraceTime"
        )


def slow_stops(stops: Iterable[tuple[int, int, Optional[float]]], budget: Budget) -> list[SlowStop]:
    """The (trial id, run id, measured seconds) entries over ``budget``; None means not measured."""
    return [
        SlowStop(trial_id, run_id, measured, budget)
        for trial_id, run_id, measured in stops
        if measured is not None and measured > budget.seconds
    ]
