"""``core_context.profiler``: Determined's system-metrics profiler, which detslurm does not run.

Determined samples CPU, GPU, memory, disk and network use on a thread and sends them to its
master for the web UI's profiler tab. detslurm has neither the tab nor the table, and Slurm
already accounts for a job's use (``sstat``/``sacct``, or the site's monitoring). So ``on()``
says once, in the trial's log, that nothing is collected, rather than failing a script that
was written for Determined; ``off()`` is always safe.
"""

from __future__ import annotations

import logging

log = logging.getLogger("detslurm.core")


class ProfilerContext:
    """The profiler a ``core.Context`` carries (built by ``core.init()``)."""

    def __init__(self) -> None:
        self._warned = False
        self.is_on = False

    def on(self, sampling_interval: int = 1, samples_per_report: int = 10) -> None:
        if sampling_interval < 1 or samples_per_report < 1:
            raise ValueError(
                "profiler.on(): sampling_interval and samples_per_report must be >= 1 "
                f"(got {sampling_interval}, {samples_per_report})"
            )
        self.is_on = True
        if not self._warned:
            self._warned = True
            log.warning(
                "core_context.profiler.on(): detslurm collects no system metrics; use Slurm's "
                "`sstat -j JOBID` / `sacct -j JOBID` (or the site's monitoring) for the job's use"
            )

    def off(self) -> None:
        self.is_on = False


class DummyProfilerContext(ProfilerContext):
    """Off-cluster twin: ``on()`` and ``off()`` only record the switch."""

    def __init__(self) -> None:
        super().__init__()
        self._warned = True  # off-cluster there is no job to profile: nothing to say
