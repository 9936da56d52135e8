"""The controller: one reconcile step ("tick") per experiment, executor-agnostic.

A tick: one batched status query, event ingest (exactly once), exit decisions, experiment
transitions, control/ops files, submissions. All truth is in the store, the experiment dirs
and the executor, so a controller killed at any point resumes where it was.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from detslurm.controller.apply import ingest_run, note
from detslurm.controller.decide import decide_exit, finish_trial, ops_done
from detslurm.controller.executor import Executor, JobState, JobStatus, RunSpec, SchedulerUnavailable
from detslurm.controller.gc import collect_garbage
from detslurm.protocol import BadRecord, BestValidation, ControlRecord, ExpPaths, RunPaths, SearcherOps, trial_env
from detslurm.searcher import SearcherError, SearchMethod, build
from detslurm.store import Store
from detslurm.store.models import Experiment, ExperimentState, Metric, RunState, Trial, TrialRun, TrialState

log = logging.getLogger("detslurm.controller")
ACTIVE_RUN = (RunState.PENDING.value, RunState.QUEUED.value, RunState.RUNNING.value)


def load_searcher(exp: Experiment) -> SearchMethod:
    s = build(exp.config)
    if exp.searcher_state:
        # A deep copy: mutating the ORM's loaded value in place would make the later
        # assignment compare equal to it, and SQLAlchemy would skip the UPDATE.
        s.load_state_dict(json.loads(json.dumps(exp.searcher_state)))
    return s


def _now() -> datetime:
    return datetime.now(timezone.utc)


class Controller:
    def __init__(self, store: Store, executor: Executor) -> None:
        self.store = store
        self.executor = executor

    # -- the tick -------------------------------------------------------------------------
    def active_experiment_ids(self) -> list[int]:
        with self.store.tx() as s:
            q = (
                select(Experiment.id)
                .where(Experiment.executor == self.executor.kind)
                .where(Experiment.state.not_in([st.value for st in ExperimentState if st.is_terminal]))
            )
            return list(s.scalars(q))

    def tick(self, exp_ids: list[int] | None = None) -> None:
        """One reconcile step for many experiments with ONE batched status query."""
        ids = exp_ids if exp_ids is not None else self.active_experiment_ids()
        runs = {exp_id: self._active_runs(exp_id) for exp_id in ids}
        jobs = {job: Path(d) for rs in runs.values() for _, job, d in rs if job}
        statuses = self.executor.poll(jobs) if jobs else {}
        for exp_id in ids:
            self.tick_experiment(exp_id, runs[exp_id], statuses)

    def tick_experiment(
        self,
        exp_id: int,
        runs: list[tuple[int, str | None, str]] | None = None,
        statuses: dict[str, JobStatus] | None = None,
    ) -> None:
        if runs is None or statuses is None:
            runs = self._active_runs(exp_id)
            jobs = {job: Path(d) for _, job, d in runs if job}
            statuses = self.executor.poll(jobs) if jobs else {}
        self._reconcile_runs(
            [(run_pk, statuses.get(job_id) if job_id else self._recover(run_pk)) for run_pk, job_id, _ in runs]
        )
        self._kill_stopping(exp_id)
        self._transitions(exp_id)
        self._sync_files(exp_id)
        self._submit(exp_id)

    def _active_runs(self, exp_id: int) -> list[tuple[int, str | None, str]]:
        with self.store.tx() as s:
            q = (
                select(TrialRun.id, TrialRun.job_id, TrialRun.run_dir)
                .join(Trial)
                .where(Trial.experiment_id == exp_id)
                .where(TrialRun.state.in_(ACTIVE_RUN))
            )
            return [(pk, job, d) for pk, job, d in s.execute(q)]

    def _recover(self, run_pk: int) -> JobStatus | None:
        """A run recorded without a job id: the controller died around the submit."""
        with self.store.tx() as s:
            run = s.get(TrialRun, run_pk)
            assert run is not None
            marker = RunPaths.from_run_dir(Path(run.run_dir)).job_id_marker
            job_id = marker.read_text().strip() if marker.exists() else None
            if not job_id:
                found = self.executor.recover(
                    (run.trial.experiment_id, run.trial_id, run.run_id), run.trial.experiment.exp_dir
                )
                job_id = str(found) if found is not None else None
            if job_id:
                run.job_id = job_id
                run.state = RunState.QUEUED.value
                return None  # the next tick's batched poll sees it
        return JobStatus(JobState.UNKNOWN, None, "never started")

    def _reconcile_run(self, exp_id: int, run_pk: int, status: JobStatus | None) -> None:
        self._reconcile_runs([(run_pk, status)])

    def _reconcile_runs(self, items: list[tuple[int, JobStatus | None]]) -> None:
        """Ingest and decide for runs of one experiment in one transaction, with the searcher
        loaded and saved once (a tick over 1000 trials would otherwise rebuild it 1000 times)."""
        if not items:
            return
        with self.store.tx() as s:
            first = s.get(TrialRun, items[0][0])
            assert first is not None
            exp = first.trial.experiment
            searcher = load_searcher(exp)
            for run_pk, status in items:
                run = s.get(TrialRun, run_pk)
                assert run is not None
                self._reconcile_one(s, exp, run.trial, run, status, searcher)
            exp.searcher_state = searcher.state_dict()
            exp.progress = searcher.progress()

    def _reconcile_one(
        self, s: Any, exp: Experiment, trial: Trial, run: TrialRun, status: JobStatus | None, searcher: SearchMethod
    ) -> None:
        try:
            ingest_run(s, exp, trial, run, searcher)
            if status is not None and status.state in (JobState.EXITED, JobState.UNKNOWN):
                decide_exit(s, exp, trial, run, status, searcher)
            elif status is not None and status.state == JobState.RUNNING and run.state != RunState.RUNNING.value:
                run.state = RunState.RUNNING.value
                run.start_time = _now()
                if (trial.runner_state or "").startswith("queued"):
                    trial.runner_state = None
            elif status is not None and status.state == JobState.QUEUED and not exp.test_mode:
                trial.runner_state = f"queued: {status.reason or 'waiting'}"[:64]
            if exp.test_mode and trial.runner_state != "test_done" and _tested_everything(s, trial):
                trial.runner_state = "test_done"
                trial.early_stopped = True  # test mode has seen enough: stop the trial
        except SearcherError as e:
            exp.state = ExperimentState.STOPPING_ERROR.value
            exp.error_message = f"encountered error: {e}"
            note(s, trial.id, f"searcher error: {e}", "ERROR")

    # -- experiment-level state -----------------------------------------------------------
    def _kill_stopping(self, exp_id: int) -> None:
        with self.store.tx() as s:
            q = (
                select(TrialRun.job_id)
                .join(Trial)
                .where(Trial.experiment_id == exp_id)
                .where(TrialRun.state.in_(ACTIVE_RUN))
                .where(Trial.state == TrialState.STOPPING_KILLED.value)
            )
            jobs = [j for j in s.scalars(q) if j]
        many = getattr(self.executor, "kill_many", None)
        if many is not None and jobs:
            many(jobs)  # one scancel for all of them
            return
        for job in jobs:
            self.executor.kill(job)

    def _transitions(self, exp_id: int) -> None:
        with self.store.tx() as s:
            exp = s.get(Experiment, exp_id)
            assert exp is not None
            searcher = load_searcher(exp)
            state = ExperimentState(exp.state)
            busy = {r.trial_id for t in exp.trials for r in t.runs if r.state in ACTIVE_RUN}
            for t in exp.trials:
                self._trial_transition(s, exp, state, t, t.id in busy, searcher)
            if all(TrialState(t.state).is_terminal for t in exp.trials) and not busy:
                final = {
                    ExperimentState.STOPPING_CANCELED: ExperimentState.CANCELED,
                    ExperimentState.STOPPING_KILLED: ExperimentState.CANCELED,
                    ExperimentState.STOPPING_COMPLETED: ExperimentState.COMPLETED,
                    ExperimentState.STOPPING_ERROR: ExperimentState.ERROR,
                }.get(state)
                if final is None and state == ExperimentState.ACTIVE and searcher.book.shut_down:
                    final = ExperimentState.COMPLETED
                if final is not None:
                    exp.state = final.value
                    exp.end_time = _now()
                    exp.progress = 1.0 if final == ExperimentState.COMPLETED else exp.progress
            exp.searcher_state = searcher.state_dict()
        with self.store.tx() as s:
            exp = s.get(Experiment, exp_id)
            assert exp is not None
            if ExperimentState(exp.state).is_terminal:
                collect_garbage(s, exp)

    def _trial_transition(
        self, s: object, exp: Experiment, state: ExperimentState, t: Trial, busy: bool, searcher: SearchMethod
    ) -> None:
        from sqlalchemy.orm import Session

        assert isinstance(s, Session)
        ts = TrialState(t.state)
        if ts.is_terminal:
            return
        if state in (
            ExperimentState.STOPPING_CANCELED,
            ExperimentState.STOPPING_KILLED,
            ExperimentState.STOPPING_ERROR,
            ExperimentState.STOPPING_COMPLETED,
        ):
            target = {
                ExperimentState.STOPPING_KILLED: TrialState.STOPPING_KILLED,
                ExperimentState.STOPPING_ERROR: TrialState.STOPPING_ERROR,
            }.get(state, TrialState.STOPPING_CANCELED)
            if busy:
                if ts not in (TrialState.STOPPING_KILLED,):
                    t.state = target.value
            else:
                final = TrialState.ERROR if target == TrialState.STOPPING_ERROR else TrialState.CANCELED
                finish_trial(s, exp, t, final, searcher, "USER_CANCELED")
        elif ts in (TrialState.STOPPING_KILLED, TrialState.STOPPING_CANCELED) and not busy:
            finish_trial(s, exp, t, TrialState.CANCELED, searcher, "USER_CANCELED", "trial killed")
        elif state == ExperimentState.PAUSED and ts == TrialState.ACTIVE and not busy:
            t.state = TrialState.PAUSED.value
        elif state == ExperimentState.ACTIVE and ts == TrialState.PAUSED:
            t.state = TrialState.ACTIVE.value
        elif not busy and (ops_done(t) or t.early_stopped):
            finish_trial(s, exp, t, TrialState.COMPLETED, searcher)

    # -- files the trials read ------------------------------------------------------------
    def _sync_files(self, exp_id: int) -> None:
        # Ops and best-validation files are not fsynced: the next tick rewrites them from the
        # store whenever they differ. (The control file is written once, so it is.)
        with self.store.tx() as s:
            exp = s.get(Experiment, exp_id)
            assert exp is not None
            layout = ExpPaths(Path(exp.exp_dir))
            state = ExperimentState(exp.state)
            best: float | None = None
            sib = exp.config["searcher"]["smaller_is_better"]
            for t in exp.trials:
                if t.searcher_metric is not None and (best is None or (t.searcher_metric < best) == sib):
                    best = t.searcher_metric
                if t.searcher_ops:
                    want = SearcherOps(
                        ops=tuple(t.searcher_ops),
                        completed=t.ops_completed,
                        closed=t.ops_closed,
                        idle_after=t.ops_completed if t.ops_idle else -1,
                    )
                    if _read_or_none(SearcherOps.read, layout.ops_file(t.id)) != want:
                        want.write(layout.ops_file(t.id))
                reason = self._stop_reason(exp, state, t)
                for r in t.runs:
                    control = RunPaths.from_run_dir(Path(r.run_dir)).control
                    if r.state in ACTIVE_RUN and reason and not control.exists():
                        ControlRecord(preempt=True, reason=reason).write(control)
            if best is not None and _read_or_none(BestValidation.read, layout.best_validation) != BestValidation(best):
                BestValidation(best).write(layout.best_validation)

    @staticmethod
    def _stop_reason(exp: Experiment, state: ExperimentState, t: Trial) -> str | None:
        if t.early_stopped:
            return "early_stop"
        if t.state in (TrialState.STOPPING_CANCELED.value, TrialState.STOPPING_ERROR.value):
            return "cancel"
        if state == ExperimentState.PAUSED:
            return "pause"
        return None

    # -- submissions ----------------------------------------------------------------------
    def _needs_run(self, t: Trial, busy: set[int]) -> bool:
        if t.state != TrialState.ACTIVE.value or t.id in busy or t.early_stopped:
            return False
        # With 0.37-style ops, a trial whose ops are all done waits for a promotion (or closing).
        return not (t.searcher_ops and t.ops_completed >= len(t.searcher_ops))

    def _submit(self, exp_id: int) -> None:
        cap = self.executor.capacity()
        specs: list[tuple[int, RunSpec]] = []
        with self.store.tx() as s:
            exp = s.get(Experiment, exp_id)
            assert exp is not None
            if exp.state != ExperimentState.ACTIVE.value:
                return
            busy = {t.id for t in exp.trials for r in t.runs if r.state in ACTIVE_RUN}
            new: list[tuple[Trial, TrialRun]] = []
            for t in exp.trials:
                if cap is not None and len(new) >= cap:
                    break
                if self._needs_run(t, busy):
                    new.append((t, self._new_run(s, exp, t)))
            s.flush()  # once for all new runs: their ids
            specs = [(run.id, self._spec(exp, t, run)) for t, run in new]
        many = getattr(self.executor, "submit_many", None)
        if many is not None and len(specs) > 1:
            # Runs that share resources go as job arrays: one sbatch for many trials.
            for spec in (sp for _, sp in specs):
                spec.run_dir.mkdir(parents=True, exist_ok=True)
            results: list[str | Exception] = many([sp for _, sp in specs])
            self._record([(pk, sp, r) for (pk, sp), r in zip(specs, results, strict=True)])
            return
        for run_pk, spec in specs:
            self._start(run_pk, spec)

    def _new_run(self, s: object, exp: Experiment, t: Trial) -> TrialRun:
        from sqlalchemy.orm import Session

        assert isinstance(s, Session)
        t.run_count += 1
        paths = ExpPaths(Path(exp.exp_dir)).run(t.id, t.run_count)
        run_dir = paths.dir
        run = TrialRun(
            trial_id=t.id,
            run_id=t.run_count,
            state=RunState.PENDING.value,
            executor=self.executor.kind,
            run_dir=str(run_dir),
            log_path=str(paths.output_log),
            preempt_acked=False,
            restart_count_seen=0,
        )
        s.add(run)
        t.runs.append(run)
        if t.run_count > 1:
            # Rows past the checkpoint we resume from would be reported again: archive them so
            # no step is counted twice.
            resume_at = t.steps_completed if t.latest_checkpoint else 0
            s.execute(
                update(Metric)
                .where(Metric.trial_id == t.id)
                .where(Metric.steps_completed > resume_at)
                .values(archived=True)
            )
        return run

    def _spec(self, exp: Experiment, t: Trial, run: TrialRun) -> RunSpec:
        layout = ExpPaths(Path(exp.exp_dir))
        base = storage_base(exp.config)
        # Only what the trial needs from us; the executor adds the submitting environment.
        env = config_env(exp.config)
        latest = t.latest_checkpoint or t.warm_start_checkpoint
        steps = t.steps_completed if t.latest_checkpoint else 0
        env.update(
            trial_env(
                experiment_id=exp.id,
                trial_id=t.id,
                run_id=run.run_id,
                seed=t.seed,
                hparams=t.hparams,
                config=exp.config,
                latest_checkpoint=latest,
                steps_completed=steps,
                run_dir=Path(run.run_dir),
                trial_dir=layout.trial_dir(t.id),
                exp_dir=layout.root,
                checkpoint_base=base,
                resources_type=f"{self.executor.kind}-process" if self.executor.kind == "local" else "slurm-job",
                slot_ids=list(range(max(1, int(exp.config["resources"]["slots_per_trial"])))),
                container_addrs=["127.0.0.1"],
                user=exp.owner,
            )
        )
        if exp.test_mode:
            env["DET_TEST_MODE"] = "1"
        return RunSpec(
            name=f"det-e{exp.id}-t{t.id}-r{run.run_id}",
            argv=[sys.executable, "-m", "detslurm.exec.launch"],
            env=env,
            run_dir=Path(run.run_dir),
            log_path=Path(run.log_path),
            slots=int(exp.config["resources"]["slots_per_trial"]),
            identity=(exp.id, t.id, run.run_id),
            config=exp.config,
        )

    def _start(self, run_pk: int, spec: RunSpec) -> None:
        try:
            spec.run_dir.mkdir(parents=True, exist_ok=True)
            result: str | Exception = self.executor.submit(spec)
        except Exception as e:
            result = e
        self._record([(run_pk, spec, result)])

    def _record(self, results: list[tuple[int, RunSpec, str | Exception]]) -> None:
        """Note submissions' job ids, each first in its run dir (the store commit may not
        happen), then all in one transaction."""
        done: dict[int, str] = {}
        for run_pk, spec, result in results:
            if isinstance(result, SchedulerUnavailable):
                self._unsubmit(run_pk, result)
                continue
            try:
                if isinstance(result, Exception):
                    raise result
                RunPaths.from_run_dir(spec.run_dir).job_id_marker.write_text(result)
                done[run_pk] = result
            except Exception as e:
                self._submit_failed(run_pk, e)
        with self.store.tx() as s:
            for run in s.scalars(select(TrialRun).where(TrialRun.id.in_(list(done)))):
                run.job_id = done[run.id]
                run.state = RunState.QUEUED.value

    def _unsubmit(self, run_pk: int, error: object) -> None:
        """Slurm did not answer the submission: forget the run, as if this tick never made it.
        The next tick submits again; an outage of slurmctld spends no restart."""
        with self.store.tx() as s:
            run = s.get(TrialRun, run_pk)
            assert run is not None
            run.trial.run_count -= 1
            note(s, run.trial_id, f"Slurm is unreachable; will submit again: {error}", "WARNING")
            s.delete(run)
        log.warning("submission deferred (Slurm unreachable): %s", error)

    def _submit_failed(self, run_pk: int, error: Exception) -> None:
        with self.store.tx() as s:
            run = s.get(TrialRun, run_pk)
            assert run is not None
            run.exit_reason = "submit failed"
            note(s, run.trial_id, f"could not start trial run {run.run_id}: {error}", "ERROR")
        self._reconcile_run(0, run_pk, JobStatus(JobState.UNKNOWN, None, "submit failed"))

    # -- driving an experiment in the foreground -------------------------------------------
    def run_until_done(
        self, exp_id: int, poll_s: float = 0.5, on_tick: Callable[[], None] | None = None
    ) -> ExperimentState:
        while True:
            self.tick_experiment(exp_id)
            if on_tick is not None:
                on_tick()
            with self.store.tx() as s:
                exp = s.get(Experiment, exp_id)
                assert exp is not None
                state = ExperimentState(exp.state)
            if state.is_terminal:
                return state
            time.sleep(poll_s)


def storage_base(config: dict[str, Any]) -> str:
    storage = config["checkpoint_storage"]
    if storage["type"] == "directory":
        return str(storage["container_path"])
    return os.path.join(storage["host_path"], storage.get("storage_path") or "")


def config_env(config: dict[str, Any]) -> dict[str, str]:
    """The expconf's environment_variables (a list, or per-device lists: cpu on our nodes)."""
    items = config["environment"]["environment_variables"]
    if isinstance(items, dict):
        items = items.get("cpu", [])
    return dict(item.partition("=")[::2] for item in items)


def _tested_everything(s: object, trial: Trial) -> bool:
    """Test mode: one training report, one validation and one checkpoint were seen."""
    from sqlalchemy import func
    from sqlalchemy.orm import Session

    from detslurm.store.models import Checkpoint

    assert isinstance(s, Session)
    groups = set(s.scalars(select(Metric.group).where(Metric.trial_id == trial.id).distinct()))
    cks = s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.trial_id == trial.id))
    return {"training", "validation"} <= groups and bool(cks)


def _read_or_none(read: Callable[[Path], Any], path: Path) -> Any:
    """A record the trial side could have clobbered: unreadable counts as absent (rewritten)."""
    try:
        return read(path)
    except BadRecord:
        return None


def current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())
