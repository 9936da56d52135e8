"""A step's runs: what happened to each run that changed since the last tick.

Each changed run's new events are ingested (apply.py) and the scheduler's answer about its job
is decided on (decide.py), all runs of one experiment in one transaction with the searcher
loaded and saved once. A run recorded without a job id is first looked for by its identity
(``recover``), so a submission is never made twice (contract 4 in docs/design/architecture.md).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from detslurm.controller.apply import Reader, ingest_run, note
from detslurm.controller.changes import TickMemory
from detslurm.controller.config import stored_config
from detslurm.controller.decide import decide_exit
from detslurm.controller.executor import Executor, ExitCause, JobState, JobStatus, SchedulerUnavailable
from detslurm.controller.files import read_marker
from detslurm.protocol import RunPaths
from detslurm.searcher import SearcherError, SearchMethod, build
from detslurm.store import Store
from detslurm.store.models import (
    Checkpoint,
    Experiment,
    ExperimentState,
    Metric,
    RunState,
    Trial,
    TrialRun,
    TrialState,
    utcnow,
)

# An sbatch whose reply was lost may still be in slurmctld's hands: before concluding that it
# never created the job, give a slow controller this long to show it in the queue.
SUBMIT_UNKNOWN_GRACE = timedelta(seconds=60)


def load_searcher(exp: Experiment) -> SearchMethod:
    s = build(stored_config(exp))
    if exp.searcher_state:
        # A deep copy: mutating the ORM's loaded value in place would make the later
        # assignment compare equal to it, and SQLAlchemy would skip the UPDATE.
        s.load_state_dict(json.loads(json.dumps(exp.searcher_state)))
    return s


def trial_work(s: Session, exp_id: int) -> float:
    """The experiment's trials' work so far, in trials (see SearchMethod.progress): one
    aggregate query, no trial loaded."""
    work = case((Trial.state == TrialState.COMPLETED, 1.0), else_=func.coalesce(Trial.progress, 0.0))
    total = s.scalar(select(func.coalesce(func.sum(work), 0.0)).where(Trial.experiment_id == exp_id))
    return float(total or 0.0)


def recover(store: Store, executor: Executor, run_pk: int) -> JobStatus | None:
    """A run recorded without a job id: the controller died around the submit, or the
    submission's reply was lost. Its job is looked for by identity before anything else;
    None means "no decision yet" (the next tick's batched poll sees an adopted job)."""
    with store.tx() as s:
        run = s.get(TrialRun, run_pk)
        assert run is not None
        job_id = read_marker(RunPaths.from_run_dir(Path(run.run_dir)).job_id_marker)
        if not job_id:
            identity = (run.trial.experiment_id, run.trial_id, run.run_id)
            try:
                job_id = executor.recover(identity, run.trial.experiment.exp_dir)
            except SchedulerUnavailable:
                return None  # cannot look now: never guess, look again next tick
        if job_id:
            run.job_id = job_id
            run.state = RunState.QUEUED
            run.exit_reason = None
            return None
        unknown = ExitCause.parse(run.exit_reason) == ExitCause.SUBMIT_UNKNOWN
        if unknown and utcnow() - _aware(run.submit_time) < SUBMIT_UNKNOWN_GRACE:
            return None
        run.exit_reason = None
    return JobStatus(JobState.UNKNOWN, None, ExitCause.NEVER_STARTED)


def reconcile_runs(
    store: Store, memory: TickMemory, reader: Reader, items: list[tuple[int, JobStatus | None]]
) -> set[int]:
    """Ingest and decide for runs of one experiment in one transaction, with the searcher
    loaded and saved once (a tick over 1000 trials would otherwise rebuild it 1000 times).
    Returns the runs with events left to read (see ``ingest_run``)."""
    unfinished: set[int] = set()
    if not items:
        return unfinished
    with store.tx() as s:
        # One query for the runs and one for their trials, not one per run.
        pks = [pk for pk, _ in items]
        loaded = {r.id: r for r in s.scalars(select(TrialRun).where(TrialRun.id.in_(pks)))}
        trial_ids = {r.trial_id for r in loaded.values()}
        trials = {t.id: t for t in s.scalars(select(Trial).where(Trial.id.in_(trial_ids)))}
        exp = trials[loaded[pks[0]].trial_id].experiment
        searcher = memory.take_searcher(exp, load_searcher)
        for run_pk, status in items:
            run = loaded[run_pk]
            _reconcile_one(s, exp, trials[run.trial_id], run, status, searcher, reader, unfinished)
        state = searcher.state_dict()
        if state != exp.searcher_state:  # an unchanged search is not rewritten
            exp.searcher_state = state
        exp.progress = searcher.progress(functools.partial(trial_work, s, exp.id))
    memory.keep_searcher(exp.id, searcher, state, exp.config)  # committed
    return unfinished


def _reconcile_one(
    s: Session,
    exp: Experiment,
    trial: Trial,
    run: TrialRun,
    status: JobStatus | None,
    searcher: SearchMethod,
    reader: Reader,
    unfinished: set[int],
) -> None:
    while True:
        try:
            ingest_run(s, exp, trial, run, searcher, reader, unfinished)
            break
        except SearcherError as e:
            # The search failed on one event (its offset is past it). The rest of the run's
            # events are read now, not at a later tick: the memory notes this run's files as
            # read once this step ends, and a run whose files and status no longer change is
            # never read again (it would sit in STOPPING_ERROR for good). The failed searcher
            # ignores what follows (SearchMethod.failed), so this ends.
            _search_failed(s, exp, trial, e)
    try:
        if status is not None:
            _observe(exp, trial, run, status, s, searcher)
    except SearcherError as e:
        _search_failed(s, exp, trial, e)
    if exp.test_mode and trial.runner_state != "test_done" and _tested_everything(s, trial):
        trial.runner_state = "test_done"
        trial.early_stopped = True  # test mode has seen enough: stop the trial


def _observe(
    exp: Experiment, trial: Trial, run: TrialRun, status: JobStatus, s: Session, searcher: SearchMethod
) -> None:
    if status.state in (JobState.EXITED, JobState.UNKNOWN):
        decide_exit(s, exp, trial, run, status, searcher)
    elif status.state == JobState.RUNNING and run.state != RunState.RUNNING:
        run.state = RunState.RUNNING
        run.start_time = utcnow()
        if (trial.runner_state or "").startswith("queued"):
            trial.runner_state = None
    elif status.state == JobState.QUEUED and not exp.test_mode:
        trial.runner_state = f"queued: {status.detail or 'waiting'}"[:64]


def _search_failed(s: Session, exp: Experiment, trial: Trial, error: SearcherError) -> None:
    """The search cannot go on: the experiment errors (its trials are stopped), and says why.
    One already stopping (a user's cancel or kill) ends as it was asked to."""
    if not (exp.state.is_terminal or exp.state.is_stopping):
        exp.state = ExperimentState.STOPPING_ERROR
        exp.error_message = f"the search failed on a report of trial {trial.id}: {error}"
    note(s, trial.id, f"searcher error: {error}", "ERROR")


def _tested_everything(s: Session, trial: Trial) -> bool:
    """Test mode: one training report, one validation and one checkpoint were seen."""
    groups = set(s.scalars(select(Metric.group).where(Metric.trial_id == trial.id).distinct()))
    cks = s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.trial_id == trial.id))
    return {"training", "validation"} <= groups and bool(cks)


def _aware(t: datetime) -> datetime:
    # SQLite hands back naive datetimes for timezone-aware columns.
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)
