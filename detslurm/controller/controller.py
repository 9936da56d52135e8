"""The controller: one reconcile step ("tick") per experiment, executor-agnostic.

A tick: one batched status query, event ingest (exactly once) and exit decisions
(reconcile.py), experiment transitions (transitions.py), control/ops files (files.py),
submissions and what came of them (here). All truth is in the store, the experiment dirs and
the executor, so a controller killed at any point resumes where it was."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from detslurm.controller.apply import Reader, note
from detslurm.controller.changes import MAX_LISTED_TRIALS, Changes, ExperimentSnapshot, Stamp, TickMemory
from detslurm.controller.config import stored_config
from detslurm.controller.executor import (
    Demand,
    Executor,
    ExitCause,
    ExpRef,
    HoldingEnded,
    JobState,
    JobStatus,
    RunSpec,
    SchedulerUnavailable,
    SubmitLater,
    SubmitUnknown,
)
from detslurm.controller.files import prepare_runs, sync_files, write_marker
from detslurm.controller.reconcile import reconcile_runs, recover
from detslurm.controller.submit import ACTIVE_RUN, Among, needs_run, plan_runs, runless_trials
from detslurm.controller.transitions import kill_stopping, transitions
from detslurm.errors import DetSlurmError, StateError
from detslurm.identity import os_user
from detslurm.protocol import RunPaths, read_lines
from detslurm.store import Store
from detslurm.store.models import Experiment, ExperimentState, RunState, Trial, TrialRun, utcnow

__all__ = ["Controller", "current_user"]

log = logging.getLogger("detslurm.controller")
_EXPECTED = (DetSlurmError, SchedulerUnavailable)  # a failed tick that needs no traceback

# Runs as (primary key, job id or None, run dir).
ActiveRuns = list[tuple[int, str | None, str]]


def _get(s: Session, exp_id: int) -> Experiment:
    exp = s.get(Experiment, exp_id)
    assert exp is not None, f"experiment {exp_id} vanished during a tick"
    return exp


class Controller:
    def __init__(
        self,
        store: Store,
        executor: Executor,
        owner: str | None = None,
        *,
        reader: Reader = read_lines,
        memory: TickMemory | None = None,
    ) -> None:
        self.store = store
        self.executor = executor
        # Only this user's experiments are ever ticked: a shared database holds other users'
        # experiments too, whose jobs this user's squeue cannot see and must never touch.
        self.owner = owner or current_user()
        self.reader = reader
        # What the last ticks saw (a cache: a new controller starts empty and ticks in full).
        self.memory = memory or TickMemory()
        self._deferred: set[int] = set()  # experiments with runs taken back this step (_unsubmit)
        # Experiments with trials held back for the executor's capacity: room can free up with
        # no change of ours (the user's other jobs end), so their submission is tried every tick.
        self._held: set[int] = set()
        self._outage_noted: set[int] = set()  # experiments told of the outage delaying them
        self._pilot_problems: dict[int, str] = {}  # the last problem of each one's pilot workers
        self._full = True

    # -- the tick -------------------------------------------------------------------------
    def active_experiment_ids(self) -> list[int]:
        with self.store.tx() as s:
            terminal = [st for st in ExperimentState if st.is_terminal]
            q = (
                select(Experiment.id)
                .where(Experiment.executor == self.executor.kind)
                .where(Experiment.owner == self.owner)
                .where(Experiment.state.not_in(terminal))
            )
            return list(s.scalars(q))

    def tick(self, exp_ids: list[int] | None = None) -> None:
        """One reconcile step for many experiments with ONE batched status query.

        One experiment failing its step (a bug, a bad stored config) is logged and never stops
        the others; a scheduler that does not answer only delays what needs it."""
        ids = exp_ids if exp_ids is not None else self.active_experiment_ids()
        self._full = self.memory.full_due()
        runs = {exp_id: self._active_runs(exp_id) for exp_id in ids}
        # Marks of runs that are no longer active (ended, or of ended experiments) go.
        active = {pk for rs in runs.values() for pk, _, _ in rs}
        self.memory.forget([pk for pk in self.memory.runs if pk not in active])
        jobs = {job: _as_path(d) for rs in runs.values() for _, job, d in rs if job}
        statuses: dict[str, JobStatus] | None = None
        try:
            statuses = self.executor.poll(jobs) if jobs else {}
        except SchedulerUnavailable as e:
            log.warning("scheduler unreachable; ingesting and writing control files only: %s", e)
        done: list[int] = []
        for exp_id in ids:
            try:
                self.tick_experiment(exp_id, runs[exp_id], statuses)
                done.append(exp_id)
            except Exception as e:  # expected failures in one line (a read prints it), bugs' tracebacks
                log.error("experiment %d: tick failed: %s", exp_id, e, exc_info=not isinstance(e, _EXPECTED))
        # Only where the runs' ends were recorded: elsewhere the next tick decides them first.
        self._cancel_replaced([job for exp_id in done for _, job, _ in runs[exp_id] if job], statuses or {})
        if statuses is not None:
            self._settle(ids)

    def _settle(self, exp_ids: list[int]) -> None:
        """Tell the executor what the experiments' runs need kept for them (pilot workers,
        controller/pilots.py): their runs that run or wait for a place, none once paused or
        ended. Its problems go to the experiment's first trial, once per distinct message."""
        demands: list[Demand] = []
        with self.store.read() as s:
            for exp_id in exp_ids:
                exp = _get(s, exp_id)
                try:
                    config = stored_config(exp)
                except DetSlurmError:
                    continue  # its own step has said so already
                if config.slurm.pilots is None:
                    continue
                active = select(func.count(TrialRun.id)).join(Trial).where(Trial.experiment_id == exp_id)
                runs = s.scalar(active.where(TrialRun.state.in_(ACTIVE_RUN))) or 0
                if exp.state == ExperimentState.ACTIVE:
                    runs += sum(needs_run(t, set()) for t in s.scalars(runless_trials(exp_id)))
                demands.append(Demand(ExpRef(exp_id, Path(exp.exp_dir)), config, runs))
        for exp_id, problem in self.executor.settle(demands):
            if isinstance(problem, HoldingEnded):
                self._holding_ended(exp_id, problem)
                continue
            if self._pilot_problems.get(exp_id) == problem:
                continue
            self._pilot_problems[exp_id] = problem
            with self.store.tx() as s:
                first = s.scalar(select(Trial.id).where(Trial.experiment_id == exp_id).order_by(Trial.id).limit(1))
                if first is not None:
                    note(s, first, problem, "WARNING")
            log.warning("experiment %d: %s", exp_id, problem)

    def tick_experiment(
        self, exp_id: int, runs: ActiveRuns | None = None, statuses: dict[str, JobStatus] | None = None
    ) -> None:
        """One step for one experiment. ``statuses`` None after ``runs`` were given means the
        scheduler could not be asked: events are still ingested and control files written
        (pause, cancel and early stop need no Slurm), but no run is decided or submitted."""
        polled_here = runs is None  # else tick() polled, and cancels for all experiments at once
        if runs is None:
            self._check_owner(exp_id)
            runs = self._active_runs(exp_id)
            jobs = {job: Path(d) for _, job, d in runs if job}
            try:
                statuses = self.executor.poll(jobs) if jobs else {}
            except SchedulerUnavailable as e:
                log.warning("scheduler unreachable: %s", e)
        reachable = statuses is not None
        if not reachable:
            self.memory.forget(pk for pk, _, _ in runs)
            self.memory.forget_experiment(exp_id)
        seen = statuses or {}
        changed: list[tuple[int, JobStatus | None]] = []
        marks: dict[int, tuple[JobStatus | None, Stamp]] = {}
        for pk, job, run_dir in runs:
            status = (seen.get(job) if job else recover(self.store, self.executor, pk)) if reachable else None
            # Stamped before the read: whatever is appended after it shows at the next tick.
            stamp = self.memory.stamp(pk, run_dir)
            if job and reachable and self.memory.unchanged(pk, status, stamp):
                continue  # same answer from Slurm, same files: nothing to ingest or decide
            changed.append((pk, status))
            if job and reachable:
                marks[pk] = (status, stamp)
        unfinished = reconcile_runs(self.store, self.memory, self.reader, changed)
        for pk, (status, stamp) in marks.items():
            if pk not in unfinished:
                self.memory.remember(pk, status, stamp)
        if polled_here:
            self._cancel_replaced([job for _, job, _ in runs if job], seen)
        self._experiment_step(exp_id, reachable)

    def _experiment_step(self, exp_id: int, reachable: bool) -> None:
        """Kills, transitions, files and submissions, for the trials whose rows (or runs)
        changed since the last step began: every trial when the experiment's own row changed
        (a pause, an edit) or nothing is remembered, none when nothing changed."""
        with self.store.read() as s:
            now = ExperimentSnapshot.take(s, exp_id)
        last = self.memory.snapshots.pop(exp_id, None)
        changes = now.changes_since(last if reachable and not self._full else None)
        if reachable:
            kill_stopping(self.store, self.executor, exp_id)  # scancel again until the job has gone
        if changes.any:
            transitions(self.store, self.memory, exp_id, changes.only)
            with self.store.read() as s:
                sync_files(s, _get(s, exp_id), changes.only, self.memory)
        if reachable:
            if changes.any or exp_id in self._held:
                self._submit(exp_id, _among(changes, now))
            # Kept only once the whole step is done: a step that failed leaves no snapshot, and
            # the next one walks every trial. Its own writes show as changes at the next tick.
            # Not kept when runs were taken back to submit later (a limit, an outage): the rows
            # are then as they were, and nothing may change before room frees up, so the next
            # tick must walk the trials and submit again.
            if exp_id not in self._deferred:
                self.memory.snapshots[exp_id] = now
        self._deferred.discard(exp_id)

    def _cancel_replaced(self, jobs: list[str], statuses: Mapping[str, JobStatus]) -> None:
        """Cancel, in one call, the jobs whose runs have ended while the scheduler still holds
        them (Slurm requeued them), now that the runs' ends are recorded: the trials go on as
        new runs. A failed cancel is only logged: a start of such a job runs nothing (see
        templates/trial.sbatch.j2), and its run is no longer watched."""
        doomed = [job for job in jobs if (st := statuses.get(job)) is not None and st.cancel_job]
        if not doomed:
            return
        try:
            self.executor.kill_many(doomed)
        except Exception as e:  # the scheduler's error, whatever the executor
            log.warning("could not cancel requeued job(s) %s (their next start runs nothing): %s", doomed, e)

    def _check_owner(self, exp_id: int) -> None:
        """Driving another user's experiment would submit their code as this user (and their
        jobs look lost to our squeue): refused even for root (docs/design/security.md)."""
        with self.store.read() as s:
            owner = s.scalar(select(Experiment.owner).where(Experiment.id == exp_id))
        if owner is not None and owner != self.owner:
            raise StateError(f"experiment {exp_id} belongs to {owner}; detslurm drives only your own experiments")

    def _active_runs(self, exp_id: int) -> ActiveRuns:
        with self.store.tx() as s:
            q = (
                select(TrialRun.id, TrialRun.job_id, TrialRun.run_dir)
                .join(Trial)
                .where(Trial.experiment_id == exp_id)
                .where(TrialRun.state.in_(ACTIVE_RUN))
            )
            # Core rows: no ORM row processing for what is 10,000 plain tuples at scale.
            return [(pk, job, d) for pk, job, d in s.connection().execute(q)]

    # -- submissions ----------------------------------------------------------------------
    def plan_submission(
        self, s: Session, exp: Experiment, among: Among | None = None
    ) -> list[tuple[TrialRun, RunSpec]]:
        """New runs (PENDING in ``s``) and their plans: what ``_submit`` hands the executor,
        and what ``det e create --dry-run`` shows before rolling the session back."""
        capacity = self.executor.capacity(stored_config(exp), ExpRef(exp.id, Path(exp.exp_dir)))
        return plan_runs(s, exp, capacity, self.executor.kind, self.executor.resources_type(), among)

    def _submit(self, exp_id: int, among: Among | None) -> None:
        self._held.discard(exp_id)
        with self.store.read() as s:
            exp = _get(s, exp_id)
            config, where = stored_config(exp), ExpRef(exp_id, Path(exp.exp_dir))
        try:
            capacity = self.executor.capacity(config, where)
        except HoldingEnded as e:
            self._holding_ended(exp_id, e)
            return
        if capacity is not None:
            among = None  # trials held back for capacity need a run without any change of theirs
        first = self._first_needing_run(exp_id, among)
        if first is None:
            return  # every live trial has its run: planning would walk 10,000 trials for nothing
        with self.store.tx() as s:
            exp = _get(s, exp_id)
            if exp.state != ExperimentState.ACTIVE:
                return
            specs = [(run.id, spec) for run, spec in self.plan_submission(s, exp, among)]
        if capacity is not None and len(specs) >= capacity:
            self._held.add(exp_id)  # planning stopped at the capacity: more may wait
        self._note_outage(exp_id, first, capacity)
        if not specs:
            return
        ready, failed = prepare_runs(specs)
        # Runs that share resources go as job arrays: one sbatch for many trials.
        results = self.executor.submit_many([sp for _, sp in ready]) if ready else []
        self._record([(pk, sp, r) for (pk, sp), r in zip(ready, results, strict=True)] + failed)

    def _first_needing_run(self, exp_id: int, among: Among | None) -> int | None:
        """The first trial that may need a new run (``needs_run`` without its ops test), if
        any: one indexed query instead of loading every trial and run."""
        with self.store.read() as s:
            return s.scalar(runless_trials(exp_id, among).with_only_columns(Trial.id).limit(1))

    def _note_outage(self, exp_id: int, trial_id: int, capacity: int | None) -> None:
        """Trials held back because Slurm did not answer (capacity 0 for an unread queue) say
        why in their events: once per outage and experiment, on the first waiting trial, rather
        than an sbatch per tick into a scheduler that is down."""
        reason = self.executor.unreachable if capacity == 0 else None
        if reason is None:
            self._outage_noted.discard(exp_id)
        elif exp_id not in self._outage_noted:
            self._outage_noted.add(exp_id)
            with self.store.tx() as s:
                note(s, trial_id, f"Slurm is unreachable; will submit again: {reason}", "WARNING")

    def _record(self, results: list[tuple[int, RunSpec, str | Exception]]) -> None:
        """Note submissions' job ids, each first in its run dir (the store commit may not
        happen), then all in one transaction."""
        done: dict[int, str] = {}
        for run_pk, spec, result in results:
            if isinstance(result, HoldingEnded):
                self._unsubmit(run_pk, result)
                self._holding_ended(spec.identity[0], result)
            elif isinstance(result, SchedulerUnavailable):
                self._unsubmit(run_pk, result)
            elif isinstance(result, SubmitUnknown):
                self._submit_unknown(run_pk, result)
            elif isinstance(result, Exception):
                self._submit_failed(run_pk, result)
            else:
                write_marker(RunPaths.from_run_dir(spec.run_dir).job_id_marker, result)
                done[run_pk] = result
        with self.store.tx() as s:
            for run in s.scalars(select(TrialRun).where(TrialRun.id.in_(list(done)))):
                run.job_id = done[run.id]
                run.state = RunState.QUEUED

    def _unsubmit(self, run_pk: int, error: Exception) -> None:
        """Slurm did not answer the submission: forget the run, as if this tick never made it.
        The next tick submits again; an outage of slurmctld spends no restart."""
        with self.store.tx() as s:
            run = s.get(TrialRun, run_pk)
            assert run is not None
            run.trial.run_count -= 1
            self._deferred.add(run.trial.experiment_id)
            if isinstance(error, SubmitLater):
                if error.warn:  # a submit limit: said once per throttled stretch, not per trial
                    note(s, run.trial_id, str(error), "WARNING")
            elif not isinstance(error, HoldingEnded):  # that one is said once, by _holding_ended
                note(s, run.trial_id, f"Slurm is unreachable; will submit again: {error}", "WARNING")
            s.delete(run)
        if not isinstance(error, HoldingEnded):
            log.warning("submission deferred (Slurm unreachable): %s", error)

    def _holding_ended(self, exp_id: int, error: HoldingEnded) -> None:
        """The job its trials run in has ended (or is about to): the experiment is paused, as
        after `det e pause`; its running trials checkpoint and stop, and `det e activate`
        continues it (docs/user/allocation.md)."""
        with self.store.tx() as s:
            exp = _get(s, exp_id)
            if exp.state != ExperimentState.ACTIVE:
                return
            exp.state = ExperimentState.PAUSED
            first = s.scalar(select(Trial.id).where(Trial.experiment_id == exp_id).order_by(Trial.id).limit(1))
            if first is not None:
                note(s, first, f"{error}; experiment paused: `det e activate {exp_id}` continues it", "WARNING")
        log.warning("experiment %d paused: %s", exp_id, error)

    def _submit_unknown(self, run_pk: int, error: Exception) -> None:
        """The submission's reply was lost: the job may exist. The run stays PENDING with no
        job id, so the next ticks look for it by identity (``reconcile.recover``) before resubmitting."""
        with self.store.tx() as s:
            run = s.get(TrialRun, run_pk)
            assert run is not None
            run.exit_reason = ExitCause.SUBMIT_UNKNOWN.value
            run.submit_time = utcnow()
            note(s, run.trial_id, f"submission not confirmed; looking for the job before retrying: {error}", "WARNING")
        log.warning("submission unconfirmed (reply lost): %s", error)

    def _submit_failed(self, run_pk: int, error: Exception) -> None:
        with self.store.tx() as s:
            run = s.get(TrialRun, run_pk)
            assert run is not None
            note(s, run.trial_id, f"could not start trial run {run.run_id}: {error}", "ERROR")
        failed = JobStatus(JobState.UNKNOWN, None, ExitCause.FAILED, "submit failed")
        reconcile_runs(self.store, self.memory, self.reader, [(run_pk, failed)])


@functools.lru_cache(maxsize=1 << 16)
def _as_path(run_dir: str) -> Path:
    # Run dirs never change: building 10,000 Paths on every tick would cost more than the tick.
    return Path(run_dir)


def _among(changes: Changes, now: ExperimentSnapshot) -> Among | None:
    """The trials a submission must look at; None: all of them."""
    only = changes.only
    if only is None or len(only) > MAX_LISTED_TRIALS:
        return None  # many changed (every trial's first run): one plain query is cheaper
    return Among(only, max(now.trials, default=0))


def current_user() -> str:
    """Who runs this process, from the OS: never from $USER/$LOGNAME, which anyone can set."""
    return os_user()
