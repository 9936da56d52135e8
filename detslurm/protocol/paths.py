"""Where an experiment's files live on the shared filesystem: the one place that spells them.

Modelled on submitit's ``JobPaths``: the controller (login node) and the trial (compute node)
build the same objects, so a file name changed here changes on both sides at once. Nothing
here does I/O except :meth:`RunPaths.event_files` (a directory listing).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from detslurm import settings

# File names, one constant each. The batch script template receives EXIT_RECORD and SIGNALS
# from render.py, so the shell side cannot drift from these either.
CONTEXT = "context.tar.gz"
CONFIG = "config.yaml"
BEST_VALIDATION = "best_validation.json"
SEARCHER_OPS = "searcher_ops.json"
TRIAL_METADATA = "metadata.json"
EVENTS_DIR = "events"
CONTROL = "control.json"
EXIT_RECORD = "exit.json"
# Written right after sbatch returns, before the store commit: a controller that dies in between
# reads the job id back from here (contract 4) instead of searching squeue.
JOB_ID_MARKER = "job_id"
OUTPUT_LOG = "output.log"
# The batch shell appends each signal it receives here (see the template): a diagnostic trail
# of how a run was told to stop; the controller does not read it.
SIGNALS = "signals"
# A multi-node run's srun is not a child of the batch shell (the template says why): it reports
# its pid and, when its step ends, its exit code through these two files in the run dir.
STEP_PID = "step.pid"
STEP_RC = "step.rc"
LOCAL_WORKDIR = "workdir"

# Only files named like this are ingested: a trial dropping other files into events/ (or a
# rank-N.jsonl.swp) adds nothing to the store.
_EVENT_FILE = re.compile(r"^rank-(\d{1,6})\.jsonl$")


class NotARunDir(ValueError):
    """A path that is not ``<exp>/trials/<t>/runs/<r>``."""


@dataclass(frozen=True)
class ExpPaths:
    """An experiment's directory: what the controller writes once, and per-trial files."""

    root: Path

    @property
    def context(self) -> Path:
        return self.root / CONTEXT

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def best_validation(self) -> Path:
        return self.root / BEST_VALIDATION

    @property
    # Slurm's --output for an array can vary only by task index (%a), so each array gets a dir of
    # numbered symlinks to its runs' dirs.
    def arrays(self) -> Path:
        return self.root / "arrays"

    @property
    # The in-job library container trials import detslurm from (slurm/container_lib.py).
    def container_lib(self) -> Path:
        return self.root / "container-lib"

    def array_links(self, trial_id: int, run_id: int) -> Path:
        """The dir of symlinks (task index -> run dir) that one job array runs in."""
        return self.arrays / f"t{trial_id}-r{run_id}"

    # Named by store ids only, never by user strings: nothing a user writes can shape a path.
    def trial_dir(self, trial_id: int) -> Path:
        return self.root / "trials" / str(trial_id)

    def trial_tensorboard(self, trial_id: int) -> Path:
        """The trial's TensorBoard dir: the controller's metric event files and whatever the
        trial uploads (``upload_tensorboard_files``); `det tensorboard start` reads it."""
        return self.trial_dir(trial_id) / "tensorboard"

    def ops_file(self, trial_id: int) -> Path:
        return self.trial_dir(trial_id) / SEARCHER_OPS

    def trial_metadata(self, trial_id: int) -> Path:
        """``set_metadata()``'s file: per trial, so it survives the trial's restarts."""
        return self.trial_dir(trial_id) / TRIAL_METADATA

    # A new dir per run (restart): a restarted trial never reads the events or exit record of the
    # run before it, and each run's files are ingested with their own offsets.
    def run_dir(self, trial_id: int, run_id: int) -> Path:
        return self.trial_dir(trial_id) / "runs" / str(run_id)

    def run(self, trial_id: int, run_id: int) -> RunPaths:
        return RunPaths(self.root, trial_id, run_id)


@dataclass(frozen=True)
class RunPaths:
    """One trial run's files. Built from (experiment root, trial id, run id), never by walking
    up from a path; :meth:`from_run_dir` is the one inverse, for paths read back from the store."""

    exp_root: Path
    trial_id: int
    run_id: int

    @classmethod
    def from_run_dir(cls, run_dir: Path) -> RunPaths:
        """``<exp>/trials/<t>/runs/<r>`` -> its RunPaths; :class:`NotARunDir` otherwise."""
        # Parsing (not .parent.parent...) so a path of another shape fails loudly here instead
        # of silently naming the wrong experiment dir.
        parts = Path(run_dir).parts
        if len(parts) < 5 or parts[-2] != "runs" or parts[-4] != "trials":
            raise NotARunDir(f"{run_dir} is not an experiment's <exp>/trials/<t>/runs/<r> dir")
        try:
            trial_id, run_id = int(parts[-3]), int(parts[-1])
        except ValueError:
            raise NotARunDir(f"{run_dir}: trial and run must be numbers") from None
        return cls(Path(*parts[:-4]), trial_id, run_id)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RunPaths:
        """In a job: from the trial env contract (see :func:`detslurm.protocol.env.trial_env`)."""
        # The ids are the source of truth; DET_RUN_DIR is kept for user scripts and as a fallback.
        root = settings.EXP_DIR.get(env)
        trial, run = env.get("DET_TRIAL_ID", ""), env.get("DET_TRIAL_RUN_ID", "")
        if root is not None and trial.isdigit() and run.isdigit():
            return cls(root, int(trial), int(run))
        if env.get("DET_RUN_DIR"):
            return cls.from_run_dir(Path(env["DET_RUN_DIR"]))
        raise NotARunDir(f"not in a trial run: {settings.EXP_DIR.name}/DET_TRIAL_ID/DET_TRIAL_RUN_ID are not set")

    @property
    def exp(self) -> ExpPaths:
        return ExpPaths(self.exp_root)

    @property
    def trial_dir(self) -> Path:
        return self.exp.trial_dir(self.trial_id)

    @property
    def dir(self) -> Path:
        return self.exp.run_dir(self.trial_id, self.run_id)

    @property
    def events_dir(self) -> Path:
        return self.dir / EVENTS_DIR

    def event_file(self, rank: int) -> Path:
        """Each rank appends to its own file: no two writers ever share one."""
        # int(): a rank taken from the environment cannot put a separator or ".." into the name.
        return self.events_dir / f"rank-{int(rank)}.jsonl"

    def event_files(self) -> list[Path]:
        """The event files present now, by rank (anything else in the dir is not ours)."""
        try:
            # A symlink in the events dir's place (to another run's, say) is not this run's
            # events: read, it would count that run's reports twice.
            if stat.S_ISLNK(os.lstat(self.events_dir).st_mode):
                return []
            names = os.listdir(self.events_dir)
        except OSError:  # none yet, or one the trial made unreadable: nothing to read now
            return []
        # Numeric order: rank-10 after rank-9 (a plain sort would not).
        ranks = sorted(int(m.group(1)) for n in names if (m := _EVENT_FILE.match(n)))
        return [self.event_file(r) for r in ranks]

    @property
    def control(self) -> Path:
        return self.dir / CONTROL

    @property
    def exit_record(self) -> Path:
        return self.dir / EXIT_RECORD

    def node_exit_record(self, node: int | str) -> Path:
        """In a Slurm job each node's launcher records its own exit; the batch shell writes
        :attr:`exit_record` for the run."""
        return self.dir / f"exit-node{node}.json"

    def failure_mark(self, step: str, node: int | str) -> Path:
        """Left by a node's launcher when one of its ranks failed, so that the launchers of the
        step's other nodes stop their ranks too (launchers/_agent.py). ``step``: JOBID.STEPID."""
        return self.dir / f"rank-failed-{step}-node{node}"

    @property
    def job_id_marker(self) -> Path:
        return self.dir / JOB_ID_MARKER

    @property
    def output_log(self) -> Path:
        return self.dir / OUTPUT_LOG

    @property
    def signals(self) -> Path:
        return self.dir / SIGNALS

    def rendezvous(self, job_id: str, step_id: str) -> Path:
        """Where a multi-node launcher's chief publishes its rendezvous ports."""
        # Keyed by job and step, so a file left by an earlier step is never mistaken for this one's.
        return self.dir / f"rendezvous-{job_id}-{step_id}.json"

    def horovod_rendezvous(self, job_id: str) -> Path:
        """Where the horovod launcher's chief publishes its rendezvous server's ports."""
        return self.dir / f"horovod-{job_id}.json"

    @property
    def tensorboard(self) -> Path:
        return self.dir / "tensorboard"

    @property
    def local_workdir(self) -> Path:
        """The working dir of a run that is not a Slurm job (``--local``)."""
        return self.dir / LOCAL_WORKDIR


def exit_record_of(run_dir: Path) -> Path:
    """The run's exit record, for callers that only hold a run dir (executors' job tables)."""
    return Path(run_dir) / EXIT_RECORD


# The site config's node_tmpdir, expanded by the batch shell, reaches each node's launcher in
# this variable; the launcher makes its private working dir below it (detslurm/exec/workdir.py).
NODE_TMPDIR_ENV = settings.NODE_TMPDIR.name
# Set by the container command line (slurm/containers.py) to the runtime's name: the launcher
# runs inside an image, with detslurm bind-mounted from the host.
IN_CONTAINER_ENV = settings.IN_CONTAINER.name
