"""Detached runs on the login side: discover, record and ingest the user's own scripts.

A detached run (``core_v2`` in a user's own sbatch script, see ``detslurm.core.v2``) registers
itself in ``<experiments_dir>/detached/``. Each step here does one directory scan for new runs,
creates their experiment/trial/run rows on first sight (``executor = "detached"``: the
controller's tick selects only its own executor's experiments, so it never submits, restarts or
searcher-drives these), ingests their events with the managed trials' ingest, and ends runs:

* a close record says how the script ended (COMPLETED, ERROR, STOPPED after a preemption);
* a run without one whose Slurm job is neither in squeue nor running again was killed (scancel,
  SIGKILL, a node failure): ERROR. One batched squeue serves every active run, as in a tick;
* a run superseded by a newer run of its trial (``sbatch --requeue``, a rerun) has ended.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import select
from sqlalchemy.orm import Session

from detslurm.controller.apply import ingest_run, note
from detslurm.controller.executor import JobState, JobStatus, SchedulerUnavailable
from detslurm.expconf import validate
from detslurm.protocol import BadRecord, RunPaths
from detslurm.protocol.detached import DetachedError, DetachedRun, RunClosed, check_private_dir, scan
from detslurm.searcher import SearchMethod
from detslurm.store import Store
from detslurm.store.models import Experiment, ExperimentState, RunState, Trial, TrialRun, TrialState

log = logging.getLogger("detslurm.detached")
EXECUTOR = "detached"
# What a detached experiment runs is the user's own script; the config needs an entrypoint.
ENTRYPOINT = "(detached: the user's own script)"
_ACTIVE = (RunState.QUEUED, RunState.RUNNING)
# Job id -> run dir, for one batched poll (the Slurm executor's poll: one squeue for all).
Poll = Callable[[Mapping[str, Path]], Mapping[str, JobStatus]]
JobLog = Callable[[str], str | None]


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class StepResult:
    """What one step did: runs newly recorded, runs ended, and whether any is still active."""

    recorded: int
    ended: int
    active: bool


def detached_config(rec: DetachedRun) -> dict[str, Any]:
    """The experiment config stored for a detached experiment (validated like any other, so
    every view reading ``stored_config`` works): constant hparams, a single searcher."""
    raw: dict[str, Any] = {
        "name": rec.name,
        "description": rec.description,
        "labels": list(rec.labels),
        "data": rec.data,
        "entrypoint": ENTRYPOINT,
        "hyperparameters": {k: {"type": "const", "val": v} for k, v in rec.hparams.items()},
        "searcher": {
            "name": "single",
            "metric": rec.searcher_metric or "unmanaged",
            "smaller_is_better": rec.smaller_is_better,
            "max_length": {"batches": 1},
        },
        "checkpoint_storage": {"type": "shared_fs", "host_path": rec.checkpoint_base},
        "max_restarts": 0,
    }
    return validate(raw, None).as_dict()


class DetachedIngest:
    """One user's detached runs below ``root``: recorded and ingested into ``store``."""

    def __init__(self, store: Store, root: Path, owner: str, poll: Poll | None, job_log: JobLog | None = None) -> None:
        self.store = store
        self.root = root
        self.owner = owner
        self.poll = poll
        self.job_log = job_log
        self._refused: set[Path] = set()  # run dirs whose registration we could not use (noted once)

    def step(self) -> StepResult:
        """Discover, ingest and end: one directory scan and at most one squeue."""
        recorded = self._discover()
        runs = self._active_runs()
        # Polled before any close record is read: a job that closed and left in between is then
        # seen closed, never taken for a killed one.
        statuses = self._statuses(runs)
        ended = 0
        # One transaction for all runs, as a tick's reconcile: rows and offsets commit together.
        with self.store.tx() as s:
            for pk in runs:
                ended += self._reconcile(s, pk, statuses)
            self._exp_states(s, runs)
        return StepResult(recorded, ended, len(runs) > ended)

    # -- discovery --------------------------------------------------------------------------
    def _discover(self) -> int:
        if not self.root.is_dir():
            return 0
        try:
            check_private_dir(self.root)
        except DetachedError as e:
            # Somebody else could have planted runs there: ingest none of them.
            log.warning("not ingesting detached runs: %s", e)
            return 0
        # Run dirs are unique per run (exclusive mkdir), so "seen before" is a lookup by path.
        with self.store.read() as s:
            q = select(TrialRun.run_dir).where(TrialRun.executor == EXECUTOR)
            known = set(s.scalars(q))
        new = [p for p in scan(self.root) if str(p.dir) not in known and p.dir not in self._refused]
        count = 0
        for paths in new:
            try:
                rec = DetachedRun.read(paths)
            except BadRecord as e:
                log.warning("ignoring detached run %s: %s", paths.dir, e.reason)
                self._refused.add(paths.dir)
                continue
            if rec is None:
                continue
            # One transaction per new run: a bad one costs only itself, never the others.
            with self.store.tx() as s:
                self._record(s, paths, rec)
            count += 1
        return count

    def _record(self, s: Session, paths: RunPaths, rec: DetachedRun) -> None:
        exp = s.scalar(
            select(Experiment).where(Experiment.exp_dir == str(paths.exp_root)).where(Experiment.owner == self.owner)
        )
        # The experiment dir names the experiment (its name is keyed on the external id), and the
        # trial's key names the trial: a rerun of the same ids lands in the same rows.
        if exp is None:
            exp = self._new_experiment(s, paths, rec)
        request = f"{paths.trial_id}"
        trial = next((t for t in exp.trials if t.request_id == request), None)
        if trial is None:
            trial = Trial(
                experiment_id=exp.id,
                request_id=request,
                hparams=rec.hparams,
                seed=0,
                state=TrialState.ACTIVE,
                start_time=_aware_ts(rec.start),
            )
            s.add(trial)
            exp.trials.append(trial)
            s.flush()
            note(s, trial.id, f"detached trial {rec.external_trial_id!r} of {rec.external_experiment_id!r}")
        # A new run revives an ended trial and experiment: a requeue or a rerun continues them.
        trial.state, trial.end_time = TrialState.ACTIVE, None
        exp.state, exp.end_time = ExperimentState.ACTIVE, None
        trial.run_count = max(trial.run_count or 0, paths.run_id)
        # The job's own --output file (asked once, now, while the job is still known to Slurm).
        log_path = (self.job_log(rec.job_id) if self.job_log and rec.job_id else None) or ""
        s.add(
            TrialRun(
                trial_id=trial.id,
                run_id=paths.run_id,
                state=RunState.RUNNING,
                executor=EXECUTOR,
                job_id=rec.job_id or None,
                run_dir=str(paths.dir),
                log_path=log_path,
                start_time=_aware_ts(rec.start),
            )
        )
        note(s, trial.id, f"run {paths.run_id} started" + (f" (Slurm job {rec.job_id})" if rec.job_id else ""))

    def _new_experiment(self, s: Session, paths: RunPaths, rec: DetachedRun) -> Experiment:
        config = detached_config(rec)
        # No context and no yaml: the user's own script is what runs, and it is not ours to keep.
        exp = Experiment(
            name=rec.name,
            owner=self.owner,
            description=rec.description or f"detached: external id {rec.external_experiment_id}",
            config=config,
            original_config="",
            context_sha256="",
            exp_dir=str(paths.exp_root),
            executor=EXECUTOR,
            resource_pool="",
            state=ExperimentState.ACTIVE,
            progress=0.0,
            archived=False,
            test_mode=False,
            start_time=_aware_ts(rec.start),
        )
        s.add(exp)
        s.flush()
        return exp

    # -- active runs ------------------------------------------------------------------------
    def _active_runs(self) -> dict[int, tuple[str | None, str]]:
        with self.store.read() as s:
            q = (
                select(TrialRun.id, TrialRun.job_id, TrialRun.run_dir)
                .join(Trial)
                .join(Experiment)
                .where(Experiment.owner == self.owner)
                .where(TrialRun.executor == EXECUTOR)
                .where(TrialRun.state.in_(_ACTIVE))
            )
            return {pk: (job, d) for pk, job, d in s.execute(q)}

    def _statuses(self, runs: Mapping[int, tuple[str | None, str]]) -> dict[str, JobStatus] | None:
        jobs = {job: Path(d) for job, d in runs.values() if job}
        if not jobs or self.poll is None:
            return {} if not jobs else None
        try:
            return dict(self.poll(jobs))
        except SchedulerUnavailable as e:
            log.warning("scheduler unreachable; detached runs end only by their close records: %s", e)
            return None

    def _reconcile(self, s: Session, pk: int, statuses: Mapping[str, JobStatus] | None) -> int:
        """Ingest one run and end it if it has ended; 1 when it did."""
        run = s.get(TrialRun, pk)
        assert run is not None
        trial, paths = run.trial, RunPaths.from_run_dir(Path(run.run_dir))
        try:
            closed = RunClosed.read(paths)  # read before ingest: it is written after the last event
        except BadRecord as e:
            closed = RunClosed("ERROR", f"unreadable close record: {e.reason}")
        # The managed trials' ingest, exactly once by byte offset; a searcher that decides nothing,
        # since a detached experiment has no search to drive.
        ingest_run(s, trial.experiment, trial, run, SearchMethod(0))
        if closed is not None:
            return _end(s, run, closed.state, closed.message)
        # A requeued job that was killed before closing: its next run taking over ends it.
        if any(r.run_id > run.run_id for r in trial.runs):
            return _end(s, run, "SUPERSEDED", "a newer run of this trial started (requeued or run again)")
        gone = _gone(run, statuses)
        if gone:
            return _end(s, run, "ERROR", gone)
        status = (statuses or {}).get(run.job_id or "")
        if status is not None and status.state == JobState.QUEUED:
            run.state = RunState.QUEUED  # requeued: the job waits to run again
        return 0

    def _exp_states(self, s: Session, runs: Mapping[int, Any]) -> None:
        """Trials and experiments follow their latest runs (a requeue may revive an ended trial)."""
        exp_ids = set(s.scalars(select(Trial.experiment_id).join(TrialRun).where(TrialRun.id.in_(list(runs)))))
        for exp_id in exp_ids:
            exp = s.get(Experiment, exp_id)
            assert exp is not None
            states = [t.state for t in exp.trials]
            # Any live trial keeps the experiment ACTIVE; an error anywhere makes it ERROR.
            if any(st == TrialState.ACTIVE for st in states):
                continue
            final = (
                ExperimentState.ERROR
                if TrialState.ERROR in states
                else ExperimentState.CANCELED
                if TrialState.CANCELED in states
                else ExperimentState.COMPLETED
            )
            if exp.state != final:
                exp.state, exp.end_time = final, _now()
                exp.progress = 1.0 if final == ExperimentState.COMPLETED else exp.progress


_TRIAL_END = {"COMPLETED": TrialState.COMPLETED, "ERROR": TrialState.ERROR, "STOPPED": TrialState.CANCELED}


def _end(s: Session, run: TrialRun, how: str, message: str) -> int:
    run.state = RunState.EXITED
    run.end_time = _now()
    run.exit_code = 0 if how in ("COMPLETED", "STOPPED", "SUPERSEDED") else 1
    run.exit_reason = {"COMPLETED": "completed", "STOPPED": "preempted", "SUPERSEDED": "requeued"}.get(how, "failed")
    trial = run.trial
    latest = max(r.run_id for r in trial.runs)
    # Only the trial's newest run decides its state: an old run ending late must not end a trial
    # that a requeue has already resumed.
    if how != "SUPERSEDED" and run.run_id == latest:
        trial.state = _TRIAL_END[how]
        trial.end_time = _now()
        trial.exit_reason = message or None
        if how == "STOPPED":
            message = message or "stopped after a preemption request; requeue or rerun resumes it"
    level = "ERROR" if how == "ERROR" else "INFO"
    note(s, trial.id, f"run {run.run_id} ended: {how.lower()}" + (f": {message}" if message else ""), level)
    return 1


def _gone(run: TrialRun, statuses: Mapping[str, JobStatus] | None) -> str | None:
    """Why an unclosed run is known to be over, or None while it may still be running."""
    if run.job_id:
        if statuses is None:
            return None  # Slurm did not answer: never guess
        status = statuses.get(run.job_id)
        if status is None or status.state in (JobState.QUEUED, JobState.RUNNING):
            return None
        detail = f" ({status.detail})" if status.detail else ""
        return f"Slurm job {run.job_id} ended without core_v2.close(): killed or crashed{detail}"
    rec = _registration(run)
    if rec is None or rec.host != socket.gethostname() or not rec.pid:
        return None  # a plain process on another host: only its close record can end it
    if _alive(rec.pid, rec.start):
        return None
    return f"process {rec.pid} on {rec.host} ended without core_v2.close(): killed or crashed"


def _registration(run: TrialRun) -> DetachedRun | None:
    try:
        return DetachedRun.read(RunPaths.from_run_dir(Path(run.run_dir)))
    except BadRecord:
        return None


def _alive(pid: int, start: float) -> bool:
    try:
        proc = psutil.Process(pid)
        # A pid reused by a later process started after the run registered is not the run.
        return proc.uids().real == os.getuid() and proc.create_time() <= start + 1
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _aware_ts(t: float) -> datetime:
    try:
        return datetime.fromtimestamp(t, timezone.utc) if t > 0 else _now()
    except (ValueError, OverflowError, OSError):
        return _now()
