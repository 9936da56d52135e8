"""The environment the daemon starts with, and so the one every job it submits inherits.

sbatch exports the submitting process's whole environment to the job (``--export=ALL``), and the
daemon submits with the environment it was started with. What a user wants
there stays: PATH, LD_LIBRARY_PATH, loaded modules, their own variables, DETSLURM_*. What must not
reach a job is dropped here, once, when the daemon starts:

- ``SBATCH_*``, ``SALLOC_*``, ``SRUN_*``: input variables that silently change sbatch's options
  (account, partition, time, exports) behind the site config and the experiment config;
- ``SLURM_*`` and ``SLURMD_*`` except ``SLURM_CONF``: the job, step and node facts of an allocation
  ``det`` ran in (SLURM_JOB_ID, SLURM_NTASKS, SLURM_CPUS_PER_TASK, ...), which srun inside the
  job would take for its own, and output settings such as SLURM_TIME_FORMAT;
- inside an allocation, ``PMI_*``/``PMIX_*`` (a step's MPI wiring) and ``TMPDIR`` when it names
  that allocation's own scratch dir, which is gone when the allocation ends.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("detslurm.jobenv")

_ALWAYS = ("SBATCH_", "SALLOC_", "SRUN_", "SLURM_", "SLURMD_")
_IN_ALLOCATION = ("PMI_", "PMIX_")
# SLURM_CONF names which cluster sbatch talks to: dropping it would submit to the default one.
KEEP = frozenset({"SLURM_CONF"})
# Per allocation, not per call: `det` may start the daemon several times in one process
# (tests, a waiting loop), and one warning per allocation is enough.
_warned: set[str] = set()


@dataclass(frozen=True)
class DaemonEnv:
    """The scrubbed environment, what was dropped (names only), and the allocation det runs in."""

    env: dict[str, str]
    dropped: tuple[str, ...]
    allocation: Optional[str]
    # slurmd sets SLURMD_NODENAME in batch scripts and steps, salloc does not: the daemon would
    # run on a compute node, inside the job's processes.
    on_compute_node: bool = False


def _job_scratch(tmpdir: str, job_id: str, env: Mapping[str, str]) -> bool:
    """Whether TMPDIR is the allocation's own dir: $SLURM_TMPDIR, or a path naming the job id
    as a whole number (``/tmp/slurm-1234``, ``/local/1234/tmp``; never ``/tmp/12345`` for 1234)."""
    if not tmpdir:
        return False
    if tmpdir.rstrip("/") == env.get("SLURM_TMPDIR", "").rstrip("/") and env.get("SLURM_TMPDIR"):
        return True
    return bool(job_id) and re.search(rf"(?<![0-9]){re.escape(job_id)}(?![0-9])", tmpdir) is not None


def daemon_env(environ: Mapping[str, str]) -> DaemonEnv:
    """Pure: ``environ`` without what must not reach the daemon's jobs (see the module doc)."""
    # PMI_*/PMIX_* and TMPDIR are ordinary outside Slurm (a user's own MPI setup): they are
    # dropped only when det itself runs inside an allocation.
    allocation = environ.get("SLURM_JOB_ID") or None
    prefixes = _ALWAYS + (_IN_ALLOCATION if allocation else ())
    dropped = sorted(k for k in environ if k.startswith(prefixes) and k not in KEEP)
    if allocation and _job_scratch(environ.get("TMPDIR", ""), allocation, environ):
        # A TMPDIR that names the allocation's scratch dir is deleted when the allocation ends;
        # jobs given it would fail to create temp files long after.
        dropped.append("TMPDIR")
    env = {k: v for k, v in environ.items() if k not in set(dropped)}
    return DaemonEnv(env, tuple(dropped), allocation, bool(allocation and environ.get("SLURMD_NODENAME")))


def warn_once(scrubbed: DaemonEnv) -> Optional[str]:
    """Log (once per process and allocation) that det runs inside a Slurm allocation; the message."""
    if scrubbed.allocation is None or scrubbed.allocation in _warned:
        return None
    _warned.add(scrubbed.allocation)
    # Measured on the test cluster (proctrack/linuxproc): a daemon started from salloc's shell,
    # from an srun step or from a batch script outlives the allocation (its own session). With
    # proctrack/cgroup, what slurmd started stays in the job's cgroup and dies with the job.
    where = (
        "on a compute node: where the site tracks jobs with cgroups it is killed when the allocation ends"
        if scrubbed.on_compute_node
        else "detached from the allocation (its own session): it outlives it"
    )
    msg = (
        f"detslurm: det runs inside Slurm allocation {scrubbed.allocation}; the daemon it starts runs {where}, "
        "and submits jobs without this allocation's SLURM_*/SBATCH_* variables. "
        "Prefer starting it from a login shell (det daemon start)."
    )
    log.warning("%s", msg)
    return msg
