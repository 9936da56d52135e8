"""The Core API for a detached run: the user's own script, started by their own sbatch/srun.

Everything goes through the shared filesystem, as for managed trials (no connection to the
login node): the chief allocates a run dir (``detslurm.protocol.detached``), registers it,
appends the usual events there and closes it with a record saying how the script ended. The
daemon, or any read command, finds and ingests it. Other ranks only take part in collectives.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from detslurm.core._checkpoint import CheckpointContext
from detslurm.core._context import Context
from detslurm.core._dirs import user_dirs
from detslurm.core._distributed import DistributedContext, DummyDistributedContext
from detslurm.core._events import EventWriter, NullWriter
from detslurm.core._preempt import PreemptContext, PreemptMode
from detslurm.core._searcher import SearcherContextMissing
from detslurm.core._train import TrainContext, Writer
from detslurm.protocol.detached import (
    DetachedLayout,
    DetachedRun,
    LatestCheckpoint,
    RunClosed,
    allocate_run,
    detached_root,
)
from detslurm.protocol.env import RendezvousInfo, ResourcesInfo, RunInfo, TrialInfo
from detslurm.protocol.events import CheckpointSaved, Event, PreemptAck
from detslurm.protocol.paths import RunPaths
from detslurm.protocol.secret import ensure_run_secret, read_run_secret

log = logging.getLogger("detslurm.core")
# A background writer that cannot finish (a hung filesystem) may delay exit this long, never more:
# a failed script must end promptly so its job ends and the daemon can mark it.
CLOSE_WAIT_S = 10.0


@dataclass(frozen=True)
class RunIdentity:
    """External ids of a detached run (Determined's ``external_*_id``) and the Slurm job."""

    experiment: str
    trial: str
    job_id: str


def default_identity(env: Mapping[str, str], experiment: str | None, trial: str | None) -> RunIdentity:
    """Ids as given, else from Slurm: a job array is one experiment with a trial per task; a
    plain job is an experiment of one trial. ``sbatch --requeue`` keeps the job id, so a requeued
    job continues its trial. Outside Slurm an unnamed run is a new experiment every time."""
    # The cluster's name is part of the id: job ids restart from 1 on another cluster (or after
    # a reinstall), and two clusters may share a home directory.
    cluster = env.get("SLURM_CLUSTER_NAME", "slurm")
    array, task, job = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID"), env.get("SLURM_JOB_ID")
    if array and task:
        job_id = f"{array}_{task}"
        slurm_exp, slurm_trial = f"{cluster}-{array}", job_id
    elif job:
        job_id = job
        slurm_exp, slurm_trial = f"{cluster}-{job}", job
    else:
        job_id, slurm_exp, slurm_trial = "", f"local-{uuid.uuid4().hex[:12]}", "1"
    exp = experiment or slurm_exp
    # A named experiment without a named trial: one trial per Slurm job (or per process outside
    # Slurm), so rerunning the script adds a trial and a requeue continues its own.
    default_trial = slurm_trial if (job or experiment is None) else f"run-{uuid.uuid4().hex[:12]}"
    return RunIdentity(exp, trial or default_trial, job_id)


def env_rank(env: Mapping[str, str]) -> int:
    """This process's rank when no DistributedContext says: torchrun's RANK first (under srun +
    torchrun SLURM_PROCID numbers the nodes, not the workers), then srun's task id."""
    for name in ("RANK", "SLURM_PROCID"):
        raw = env.get(name, "")
        if raw.isdigit():
            return int(raw)
    return 0


def storage_base(storage: str | dict[str, Any] | None, default: Path) -> Path:
    """Where checkpoints go: a path (``file://`` allowed) or a shared_fs/directory dict."""
    if storage is None:
        return default
    if isinstance(storage, str):
        return Path(storage.removeprefix("file://")).expanduser()
    kind = storage.get("type")
    if kind == "shared_fs" and isinstance(storage.get("host_path"), str):
        sub = storage.get("storage_path")
        base = Path(storage["host_path"]).expanduser()
        return base / sub if isinstance(sub, str) and sub else base
    if kind == "directory" and isinstance(storage.get("container_path"), str):
        return Path(storage["container_path"]).expanduser()
    raise ValueError(
        f"checkpoint_storage {storage!r} is not built for detached runs: give a path, "
        "{type: shared_fs, host_path: ...} or {type: directory, container_path: ...}"
    )


@dataclass
class Outcome:
    """How the script is ending, as far as this process can tell (set by core_v2)."""

    error: str | None = None
    stopped: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class DetachedContext(Context):
    """A Context whose close also writes the run's close record, after every event is on disk."""

    def __init__(self, *, paths: RunPaths | None, outcome: Outcome, **kw: Any) -> None:
        super().__init__(**kw)
        self._paths = paths
        self.outcome = outcome
        self._closed = False

    def close(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
    ) -> None:
        if self._closed:
            return
        self._closed = True
        # An exception leaving a `with` block (init_context style) is an error like an uncaught one.
        if exc_val is not None and not _clean_exit(exc_val):
            self.outcome.error = self.outcome.error or f"{type(exc_val).__name__}: {exc_val}"[:2000]
        flushed = False
        try:
            self.preempt.close()
            if isinstance(self._writer, EventWriter):
                self._writer.flush(CLOSE_WAIT_S)  # bounded: a hung filesystem must not hang the exit
            else:
                self._writer.flush()
            flushed = True
        except Exception as e:  # a full or hung filesystem: still close what we can, quickly
            log.warning("detached run: could not flush events: %s", e)
        finally:
            close = getattr(self._writer, "close", None)
            if close is not None:
                close(CLOSE_WAIT_S)
            self.distributed.close()
        # The close record promises "every event is on disk": without a flush it is not written,
        # and the login side then ends the run by its job instead.
        if self._paths is not None and flushed:
            self._write_close()

    def _write_close(self) -> None:
        assert self._paths is not None
        o = self.outcome
        # STOPPED: the script acknowledged a stop request (requeue, preemption) and left cleanly.
        state = "ERROR" if o.error else ("STOPPED" if o.stopped or self.preempt._acked else "COMPLETED")
        try:
            RunClosed(state, o.error or "", time.time()).write(self._paths)
        except OSError as e:
            log.warning("detached run: could not write its close record: %s", e)


def _clean_exit(exc: BaseException) -> bool:
    return isinstance(exc, SystemExit) and exc.code in (0, None)


class _ChiefReports:
    """Checkpoint reports of the chief: the event (flushed, as for managed trials) and the trial's
    latest-checkpoint record that a requeue or rerun resumes from."""

    def __init__(self, writer: Writer, paths: RunPaths) -> None:
        self._writer = writer
        self._paths = paths

    def __call__(self, event: Event) -> None:
        self._writer.emit(event)
        self._writer.flush()
        if isinstance(event, CheckpointSaved):
            LatestCheckpoint(event.uuid, event.steps_completed, event.storage_path).write(self._paths)


@dataclass(frozen=True)
class DetachedSpec:
    """What core_v2.init asks for in detached mode (from its Config and arguments)."""

    identity: RunIdentity
    name: str
    description: str | None
    labels: tuple[str, ...]
    hparams: dict[str, Any]
    data: dict[str, Any]
    searcher_metric: str | None
    smaller_is_better: bool
    checkpoint_storage: str | dict[str, Any] | None


def _latest(paths: RunPaths) -> LatestCheckpoint | None:
    try:
        ck = LatestCheckpoint.read(paths)
    except Exception as e:  # a torn or hand-edited record: start fresh rather than crash
        log.warning("ignoring the latest checkpoint record of %s: %s", paths.trial_dir, e)
        return None
    # A checkpoint deleted since (GC, by hand) cannot be resumed from.
    return ck if ck is not None and Path(ck.storage_path).is_dir() else None


def _register(spec: DetachedSpec, layout: DetachedLayout, base: Path) -> tuple[RunPaths, LatestCheckpoint | None]:
    ident = spec.identity
    # The run dir exists (exclusively ours) before the record that makes it visible is written.
    exp_dir = layout.exp_dir(ident.experiment)
    paths = allocate_run(exp_dir, layout.trial_key(ident.experiment, ident.trial))
    DetachedRun(
        external_experiment_id=ident.experiment,
        external_trial_id=ident.trial,
        name=spec.name,
        checkpoint_base=str(base),
        description=spec.description,
        labels=spec.labels,
        hparams=spec.hparams,
        data=spec.data,
        searcher_metric=spec.searcher_metric,
        smaller_is_better=spec.smaller_is_better,
        job_id=ident.job_id,
        host=socket.gethostname(),
        pid=os.getpid(),
        start=time.time(),
    ).write(paths)
    return paths, _latest(paths)


def make_context(
    spec: DetachedSpec,
    distributed: DistributedContext | None,
    preempt_mode: PreemptMode,
    outcome: Outcome,
    env: Mapping[str, str] = os.environ,
) -> DetachedContext:
    """Register this run (chief) and build its Core API context (every rank)."""
    dist = distributed or DummyDistributedContext()
    # Without a DistributedContext the ranks cannot talk: each decides alone from its environment.
    rank = dist.rank if distributed is not None else env_rank(env)
    dirs = user_dirs(env)
    base = storage_base(spec.checkpoint_storage, dirs.checkpoints)
    layout = DetachedLayout.open(detached_root(dirs.experiments))
    paths: RunPaths | None = None
    latest: LatestCheckpoint | None = None
    if rank == 0:
        paths, latest = _register(spec, layout, base)
        log.info("detached run registered in %s", paths.dir)
    else:
        # Workers read what the chief resumes from; without a DistributedContext they only agree
        # on it through the record (the chief does not write a newer one before its first save).
        trial_dir = layout.trial_dir(spec.identity.experiment, spec.identity.trial)
        latest = _latest(RunPaths(trial_dir.parent.parent, int(trial_dir.name), 0))
    if distributed is not None and dist.size > 1:
        # Every rank takes the chief's run and resume point (a collective: all ranks call init).
        shared = dist.broadcast([paths.run_id if paths else 0, latest.__dict__ if latest else None])
        if paths is None:
            trial_dir = layout.trial_dir(spec.identity.experiment, spec.identity.trial)
            paths = RunPaths(trial_dir.parent.parent, int(trial_dir.name), int(shared[0]))
        latest = LatestCheckpoint(**shared[1]) if shared[1] else None
    return _assemble(spec, dist, rank, paths, latest, base, preempt_mode, outcome)


def _assemble(
    spec: DetachedSpec,
    dist: DistributedContext,
    rank: int,
    paths: RunPaths | None,
    latest: LatestCheckpoint | None,
    base: Path,
    preempt_mode: PreemptMode,
    outcome: Outcome,
) -> DetachedContext:
    chief = rank == 0 and paths is not None
    # Only the chief writes events: other ranks' reports go to a null writer (Determined's rule
    # that the chief reports), so one file per run holds everything.
    writer: Writer = EventWriter(paths.event_file(0)) if chief and paths is not None else NullWriter()
    report: Callable[[Event], None] = _ChiefReports(writer, paths) if chief and paths is not None else writer.emit
    info = _cluster_info(spec, paths, latest, base, rank)

    def ack() -> None:
        writer.emit(PreemptAck())
        writer.flush()

    return DetachedContext(
        paths=paths if chief else None,
        outcome=outcome,
        distributed=dist,
        writer=writer,
        info=info,
        searcher=SearcherContextMissing(),
        preempt=PreemptContext(
            dist, paths.control if paths is not None else None, ack, preempt_mode, lazy_signals=True
        ),
        train=TrainContext(writer, paths.run_id if paths else 0, paths if chief else None),
        checkpoint=CheckpointContext(dist, base, report, require_steps=False, mark_key=_mark_key(paths, chief)),
    )


def _mark_key(paths: RunPaths | None, chief: bool) -> bytes | None:
    """The chief's key for the marks on its checkpoints: a secret in its own run dir, where the
    login side reads it before deleting them (protocol/ckmark.py)."""
    if not chief or paths is None:
        return None
    return read_run_secret(ensure_run_secret(paths.dir))


def _cluster_info(
    spec: DetachedSpec, paths: RunPaths | None, latest: LatestCheckpoint | None, base: Path, rank: int
) -> RunInfo:
    # No store in the job: experiment_id is 0 (the store numbers detached experiments on ingest)
    # and the trial id is the trial's key in the detached layout.
    trial = TrialInfo(
        trial_id=paths.trial_id if paths else 0,
        experiment_id=0,
        trial_seed=0,
        hparams=dict(spec.hparams),
        config={"name": spec.name, "data": dict(spec.data), "hyperparameters": dict(spec.hparams)},
        steps_completed=latest.steps_completed if latest else 0,
        trial_run_id=paths.run_id if paths else 0,
        debug=False,
        inter_node_network_interface=None,
    )
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return RunInfo(
        master_url="",
        cluster_id="detslurm",
        agent_id=node,
        slot_ids=[0],
        task_id=spec.identity.job_id or spec.identity.experiment,
        allocation_id=f"{spec.identity.experiment}/{spec.identity.trial}",
        session_token="",
        task_type="TRIAL",
        latest_checkpoint=latest.uuid if latest else None,
        trial_info=trial,
        rendezvous_info=RendezvousInfo(container_addrs=[node], container_rank=rank, container_slot_counts=[1]),
        resources_info=ResourcesInfo(gpu_uuids=[]),
        run_dir=paths.dir if paths else Path("."),
        trial_dir=paths.trial_dir if paths else Path("."),
        exp_dir=paths.exp_root if paths else Path("."),
        checkpoint_base=base,
        resources_type="detached",
    )
