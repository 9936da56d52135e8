"""Pilot workers' jobs (``slurm.pilots``, docs/user/allocation.md): one sbatch array whose tasks
hold their nodes doing nothing but wait, while the daemon runs trial runs in them as job steps
(``srun --jobid``, controller/step_executor.py). Pure: the plan of the array and its script.

The waiting script runs nothing it is given. It reads one thing: the time of the experiment's
lease file, in the experiment's private dir (mode 0700: only its owner writes there), which the
daemon renews while it drives the experiment. Once the lease is older than ``idle_timeout`` and
no step runs in the worker, the script exits and the job ends: a daemon that is gone leaves no
allocation held idle. Steps in the worker can be started only by its owner (Slurm checks that).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Optional

from detslurm.errors import ConfigError
from detslurm.expconf import ExperimentConfig
from detslurm.slurm.render import ResourcePlan, SbatchRequest, priority_args
from detslurm.slurm.site import SiteConfig

# How often the waiting script looks at its lease: an idle worker outlives a gone daemon by at
# most idle_timeout plus this.
CHECK_EVERY_S = 5
LEASE = "lease"  # under ExpPaths.root / PILOTS_DIR
PILOTS_DIR = "pilots"

_COMMENT_RE = re.compile(r"^detslurm:pilots,exp=(\d+),tag=([0-9a-f]+)$")


def worker_comment(exp_id: int, tag: str) -> str:
    """The workers' --comment: their experiment and its dir's tag (slurm/parse.experiment_tag),
    so two stores of one user never take each other's workers. No trial's comment matches it."""
    return f"detslurm:pilots,exp={exp_id},tag={tag}"


def worker_of(comment: str) -> Optional[tuple[int, str]]:
    """(experiment, tag) of one of our workers' comments, else None."""
    m = _COMMENT_RE.match(comment.strip())
    return (int(m.group(1)), m.group(2)) if m else None


def pilots_dir(exp_dir: Path) -> Path:
    return exp_dir / PILOTS_DIR


def lease_path(exp_dir: Path) -> Path:
    return pilots_dir(exp_dir) / LEASE


def worker_config(config: ExperimentConfig) -> ExperimentConfig:
    """``config`` with a worker's slots as its trial's: the resource plan of one worker job."""
    pilots = config.slurm.pilots
    assert pilots is not None, "only a config with slurm.pilots has workers"
    if pilots.slots is None:
        return config
    resources = config.resources.model_copy(update={"slots_per_trial": pilots.slots})
    return dataclasses.replace(config, top=config.top.model_copy(update={"resources": resources}))


def trials_per_worker(config: ExperimentConfig) -> int:
    """How many runs of ``config`` one worker holds at once (by slots; at least one)."""
    pilots = config.slurm.pilots
    assert pilots is not None
    trial = config.resources.slots_per_trial
    worker = trial if pilots.slots is None else pilots.slots
    return max(1, worker // trial) if trial else 1


def shape_errors(config: ExperimentConfig, site: SiteConfig) -> list[str]:
    """Why ``config``'s workers could never run its trials ([] when they can)."""
    pilots = config.slurm.pilots
    assert pilots is not None
    out: list[str] = []
    trial = config.resources.slots_per_trial
    if pilots.slots is not None and pilots.slots < trial:
        out.append(
            f"<config>.slurm.pilots.slots: a worker of {pilots.slots} slots cannot run a trial of "
            f"resources.slots_per_trial {trial}"
        )
    if pilots.time_limit * 60 <= site.signal_lead_s:
        out.append(
            f"<config>.slurm.pilots.time_limit: {pilots.time_limit} min leaves no time to run: trials stop "
            f"{site.signal_lead_s} s before a worker's end (the site's signal_lead_s)"
        )
    return out


def plan_workers(
    *,
    config: ExperimentConfig,
    res: ResourcePlan,
    exp_id: int,
    exp_dir: Path,
    tag: str,
    count: int,
    may_raise_priority: bool = False,
) -> SbatchRequest:
    """One sbatch of ``count`` workers (an array) for the trials of ``config`` (experiment
    ``exp_id``), shaped by ``res``, the resource plan of its :func:`worker_config`."""
    pilots = config.slurm.pilots
    assert pilots is not None and count >= 1
    where = pilots_dir(exp_dir)
    args = [
        f"--job-name=det-e{exp_id}-pilot",
        f"--comment={worker_comment(exp_id, tag)}",
        *res.args,
        *_cpus_for_packing(config, res),
        # After the pool's own limit: a worker's time limit is the config's.
        f"--time={pilots.time_limit}",
        f"--array=0-{count - 1}",
        # sbatch expands %A (the array) and %a (the task) in file names: a literal % is doubled.
        f"--output={str(where).replace('%', '%%')}/worker-%A_%a.log",
        f"--chdir={where}",
        *priority_args(config, may_raise_priority),
        *config.slurm.sbatch_args,
    ]
    for a in args:
        if any(c in a for c in "\n\r\0"):
            raise ConfigError([f"sbatch argument {a!r} contains a control character"])
    script = _SCRIPT.format(
        exp_id=exp_id, lease=shlex.quote(str(lease_path(exp_dir))), idle=pilots.idle_timeout, every=CHECK_EVERY_S
    )
    return SbatchRequest(name=f"det-e{exp_id}-pilot", args=args, script=script)


def _cpus_for_packing(config: ExperimentConfig, res: ResourcePlan) -> list[str]:
    """A GPU worker that runs several trials per node needs a CPU for each: a GPU job gets one
    CPU per task by default, and each step takes CPUs in proportion to its GPUs."""
    trial = config.resources.slots_per_trial
    per_node = res.per_node // trial if res.gpu and trial else 0
    return [f"--cpus-per-task={per_node}"] if per_node > 1 else []


_SCRIPT = """#!/bin/bash
# detslurm pilot worker of experiment {exp_id}: holds its nodes while the daemon runs trial runs
# in it as job steps (srun --jobid). It runs nothing itself and reads only its lease's time.
set -u
lease={lease}
while :; do
  sleep {every}
  seen=$(stat -c %Y "$lease" 2>/dev/null || echo 0)
  [ $(( $(date +%s) - seen )) -le {idle} ] && continue
  # The daemon has not renewed the lease: end, unless a trial still runs here.
  steps=$(squeue -h -s -j "$SLURM_JOB_ID" -o %i) || continue
  printf '%s\\n' "$steps" | grep -qE '[.][0-9]+$' || exit 0
done
"""
