"""Read-only views of the store: typed rows and plain dicts (for the CLI tables, --json and the
client). Every query the CLI needs lives here, so the CLI holds no SQL.

Every entry point takes the caller's :class:`~detslurm.identity.Scope`: in a store shared by
several users, another user's experiment, trial or checkpoint is "not found"
(docs/design/security.md). Helpers that take a trial id (metrics, runs, notes) come after ``get_trial``/``get_experiment``
has checked it. Call them inside ``Store.read()``: nothing here writes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from detslurm.errors import NotFoundError
from detslurm.identity import Scope
from detslurm.slurm.reasons import pending_words as pending_words
from detslurm.store.models import (
    Checkpoint,
    Experiment,
    ExperimentState,
    LogEntry,
    Metric,
    RunState,
    Trial,
    TrialRun,
)

# `det e list`'s row and filters live with the fast read path (store.quick), which needs no ORM.
from detslurm.store.quick import ExperimentRow as ExperimentRow
from detslurm.store.quick import experiment_filter_rows as experiment_filter_rows

if TYPE_CHECKING:
    from detslurm.slurm.parse import QueuedJob


def get_experiment(s: Session, exp_id: int, scope: Scope) -> Experiment:
    """The experiment, if ``scope`` sees it; another user's raises the same NotFoundError as a
    missing one (its existence is not leaked)."""
    exp = s.get(Experiment, exp_id)
    if exp is None or not scope.sees(exp.owner):
        raise NotFoundError("experiment", exp_id)
    return exp


def get_trial(s: Session, trial_id: int, scope: Scope) -> Trial:
    t = s.get(Trial, trial_id)
    # Same answer for missing and not-yours, so trial ids cannot be probed to learn who runs what.
    if t is None or not scope.sees(t.experiment.owner):
        raise NotFoundError("trial", trial_id)
    return t


def get_checkpoint(s: Session, uuid: str, scope: Scope) -> Checkpoint:
    ck = s.get(Checkpoint, uuid)
    # A checkpoint row carries no owner: the scope is checked through its trial's experiment.
    trial = s.get(Trial, ck.trial_id) if ck is not None else None
    if ck is None or trial is None or not scope.sees(trial.experiment.owner):
        raise NotFoundError("checkpoint", uuid)
    return ck


def trial_checkpoints(s: Session, trial_id: int, scope: Scope) -> list[Checkpoint]:
    """A trial's checkpoints, oldest first."""
    get_trial(s, trial_id, scope)
    q = select(Checkpoint).where(Checkpoint.trial_id == trial_id).order_by(Checkpoint.steps_completed)
    return list(s.scalars(q))


def batches(s: Session, trial_id: int) -> int:
    v = s.scalar(
        # Archived metrics were reported after the checkpoint a restarted run resumed from; that
        # work was redone, so it does not count towards the trial's batches.
        select(func.max(Metric.steps_completed)).where(Metric.trial_id == trial_id).where(Metric.archived.is_(False))
    )
    return int(v or 0)


def experiment_dict(exp: Experiment) -> dict[str, Any]:
    return {
        "id": exp.id,
        "name": exp.name,
        "owner": exp.owner,
        "state": exp.state,
        "progress": exp.progress,
        "description": exp.description,
        "start_time": exp.start_time,
        "end_time": exp.end_time,
        "resource_pool": exp.resource_pool,
        "archived": exp.archived,
        "labels": exp.config.get("labels", []),
        "executor": exp.executor,
        "exp_dir": exp.exp_dir,
        "error": exp.error_message,
        "parent_id": exp.parent_id,
        "context_sha256": exp.context_sha256,
    }


def trial_dict(s: Session, t: Trial) -> dict[str, Any]:
    return {
        "id": t.id,
        "experiment_id": t.experiment_id,
        "state": t.state,
        "hparams": t.hparams,
        "seed": t.seed,
        "restarts": t.restarts,
        "runs": t.run_count,
        "latest_checkpoint": t.latest_checkpoint,
        "steps_completed": t.steps_completed,
        "searcher_metric": t.searcher_metric,
        "progress": t.progress,
        "start_time": t.start_time,
        "end_time": t.end_time,
        # Computed from the metrics rather than stored: it must agree with what `det t describe
        # --metrics` lists, archived rows excluded.
        "batches": batches(s, t.id),
        "early_stopped": t.early_stopped,
        "exit_reason": t.exit_reason,
        # Why its job waits, in words with Slurm's code ("waiting for free nodes (Resources)").
        # Only while a run is queued: the note outlives the wait (a paused trial keeps it).
        "pending_reason": pending_words(t.runner_state) if _queued(t) else None,
    }


def _queued(t: Trial) -> bool:
    return not t.state.is_terminal and any(r.state == RunState.QUEUED for r in t.runs)


def trial_reason(d: dict[str, Any]) -> str:
    """What a table shows beside a trial: why it waits, else why it ended (or nothing)."""
    return str(d.get("pending_reason") or d.get("exit_reason") or "")


def validation_metric(s: Session, ck: Checkpoint, metric: str) -> float | None:
    q = (
        select(Metric.metrics)
        .where(Metric.trial_id == ck.trial_id)
        .where(Metric.group == "validation")
        # A checkpoint's metric is the validation reported at the same step count, as Determined
        # pairs them; a checkpoint saved between validations has none.
        .where(Metric.steps_completed == ck.steps_completed)
        .where(Metric.archived.is_(False))
    )
    for m in s.scalars(q):
        # Metrics are the trial's own JSON (untrusted): a string or null under the metric's name
        # is skipped, not a crash of `det c list`.
        value = m.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def run_dict(r: TrialRun) -> dict[str, Any]:
    return {
        "run_id": r.run_id,
        "state": r.state,
        "job_id": r.job_id,
        "exit_code": r.exit_code,
        "exit_reason": r.exit_reason,
        "preempt_acked": r.preempt_acked,
        # Seconds from Slurm's signal to the acknowledged checkpoint (None: not stopped by a signal).
        "preempt_stop_s": r.preempt_stop_s,
        "log": r.log_path,
        "start_time": r.start_time,
        "end_time": r.end_time,
    }


def checkpoint_dict(s: Session, ck: Checkpoint) -> dict[str, Any]:
    trial = s.get(Trial, ck.trial_id)
    assert trial is not None
    from detslurm.expconf import from_stored  # pydantic: only for commands that show checkpoints

    metric = from_stored(trial.experiment.config).searcher.metric or ""
    return {
        "uuid": ck.uuid,
        "trial_id": ck.trial_id,
        "experiment_id": trial.experiment_id,
        "run_id": ck.run_id,
        "steps_completed": ck.steps_completed,
        "state": ck.state,
        "metadata": ck.metadata_,
        "resources": ck.resources,
        "size": ck.size,
        "report_time": ck.report_time,
        "storage_path": ck.storage_path,
        "validation_metric": validation_metric(s, ck, metric),
    }


def checkpoints(s: Session, exp_id: int, scope: Scope) -> list[Checkpoint]:
    get_experiment(s, exp_id, scope)
    q = (
        select(Checkpoint)
        .join(Trial)
        .where(Trial.experiment_id == exp_id)
        .order_by(Checkpoint.trial_id, Checkpoint.steps_completed)
    )
    return list(s.scalars(q))


def metrics(s: Session, trial_id: int, group: str | None = None) -> list[Metric]:
    q = select(Metric).where(Metric.trial_id == trial_id).where(Metric.archived.is_(False))
    if group:
        q = q.where(Metric.group == group)
    # Id breaks ties: several reports at one step keep the order they arrived in.
    return list(s.scalars(q.order_by(Metric.steps_completed, Metric.id)))


class Workload(NamedTuple):
    """One metric report as `det e describe` shows it."""

    steps_completed: int
    group: str
    report_time: datetime
    metrics: dict[str, Any]


def recent_metrics(s: Session, trial_id: int, limit: int) -> tuple[list[Workload], bool]:
    """The trial's last ``limit`` metric reports in :func:`metrics` order, and whether it has
    earlier ones: `det e describe` shows a bounded table whatever the trial reported (the index
    on trial and step reads them from the end; counting them all would visit every row).
    Columns, not ORM objects: a third of the time for 10k rows."""
    m = Metric
    q = (
        select(m.steps_completed, m.group, m.report_time, m.metrics)
        .where(m.trial_id == trial_id, m.archived.is_(False))
        .order_by(m.steps_completed.desc(), m.id.desc())
        .limit(max(limit, 0) + 1)
    )
    rows = [Workload._make(row) for row in s.execute(q)]
    return rows[:limit][::-1], len(rows) > limit


def metric_curve(s: Session, trial_id: int, group: str, name: str, max_points: int) -> list[tuple[int, float]]:
    """One metric's curve of a trial, (steps_completed, value) by step, downsampled to at most
    about ``max_points`` points (every k-th report, and always the last): the dashboard's
    query. Only the kept rows' JSON leaves the database, so a trial with a million reports
    answers as fast as one with a thousand (the index on trial, group and step does the rest).
    Reports without a numeric value under ``name`` are skipped (a trial's JSON is untrusted)."""
    m = Metric
    live = (m.trial_id == trial_id, m.group == group, m.archived.is_(False))
    total = int(s.scalar(select(func.count()).select_from(m).where(*live)) or 0)
    if total == 0 or max_points <= 0:
        return []
    stride = -(-total // max_points)  # ceil: at most max_points kept, plus the last
    numbered = (
        select(m.id, func.row_number().over(order_by=(m.steps_completed, m.id)).label("n")).where(*live).subquery()
    )
    keep = select(numbered.c.id).where(((numbered.c.n - 1) % stride == 0) | (numbered.c.n == total))
    rows = s.execute(select(m.steps_completed, m.metrics).where(m.id.in_(keep)).order_by(m.steps_completed, m.id))
    curve = []
    for steps, metrics in rows:
        value = metrics.get(name) if isinstance(metrics, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            curve.append((int(steps), float(value)))
    return curve


def runs(s: Session, trial_id: int) -> list[TrialRun]:
    return list(s.scalars(select(TrialRun).where(TrialRun.trial_id == trial_id).order_by(TrialRun.run_id)))


def notes(s: Session, trial_id: int) -> list[LogEntry]:
    return list(s.scalars(select(LogEntry).where(LogEntry.trial_id == trial_id).order_by(LogEntry.id)))


def experiment_rows(s: Session, scope: Scope, include_archived: bool = False) -> list[ExperimentRow]:
    """Only the listed columns: whole rows (configs, searcher states) of thousands of
    experiments would take seconds to load."""
    e = Experiment
    # scope.owner None is root's --all-users; otherwise the filter is in SQL, not applied after
    # loading, so other users' rows never leave the database.
    q = select(
        e.id, e.owner, e.name, e.parent_id, e.state, e.progress, e.start_time, e.end_time, e.resource_pool, e.archived
    )
    if scope.owner is not None:
        q = q.where(e.owner == scope.owner)
    if not include_archived:
        q = q.where(e.archived.is_(False))
    return [ExperimentRow._make(row) for row in s.execute(q.order_by(e.id))]


def experiment_dicts(s: Session, scope: Scope, include_archived: bool = False) -> list[dict[str, Any]]:
    """Every experiment of the scope as :func:`experiment_dict` (`det e list --json`)."""
    q = select(Experiment).order_by(Experiment.id)
    if scope.owner is not None:
        q = q.where(Experiment.owner == scope.owner)
    if not include_archived:
        q = q.where(Experiment.archived.is_(False))
    return [experiment_dict(e) for e in s.scalars(q)]


def has_unfinished(s: Session, executor: str, owner: str) -> bool:
    """Whether some experiment of this executor and owner has not ended yet (a read reconciles
    only its own user's experiments: other users' are their daemons' business)."""
    # A COUNT in SQL, not a loaded list: every read command asks this, and it must stay cheap
    # with thousands of finished experiments in the store.
    terminal = [st for st in ExperimentState if st.is_terminal]
    n = s.scalar(
        select(func.count())
        .select_from(Experiment)
        .where(Experiment.executor == executor)
        .where(Experiment.owner == owner)
        .where(Experiment.state.not_in(terminal))
    )
    return bool(n)


def experiment_state(s: Session, exp_id: int, scope: Scope) -> ExperimentState:
    return ExperimentState(get_experiment(s, exp_id, scope).state)


class FirstTrial(NamedTuple):
    """What `-f` needs: the first trial (None before the searcher made one) and whether to stop."""

    trial_id: int | None
    runner_state: str | None
    done: bool


def first_trial(s: Session, exp_id: int, scope: Scope) -> FirstTrial:
    exp = get_experiment(s, exp_id, scope)
    if not exp.trials:
        # An experiment can end before its searcher made any trial (e.g. killed at once):
        # followers must stop then too, not wait for a trial that never comes.
        return FirstTrial(None, None, exp.state.is_terminal)
    t = exp.trials[0]
    return FirstTrial(t.id, t.runner_state, t.state.is_terminal)


class DriveSnapshot(NamedTuple):
    """A locally driven experiment after one tick: its state, each trial's state, and whether
    any run is still queued or running (a PAUSED experiment is done only when none is)."""

    state: ExperimentState
    trial_states: dict[int, str]
    busy: bool


def drive_snapshot(s: Session, exp_id: int, scope: Scope) -> DriveSnapshot:
    exp = get_experiment(s, exp_id, scope)
    busy = any(not r.state.is_terminal for t in exp.trials for r in t.runs)
    return DriveSnapshot(exp.state, {t.id: t.state for t in exp.trials}, busy)


def active_job_ids(s: Session, exp_id: int, scope: Scope) -> list[str]:
    """Executor job ids of the experiment's runs that have not ended."""
    exp = get_experiment(s, exp_id, scope)
    # A run without a job id was never submitted (or its submission failed): nothing to kill.
    return [r.job_id for t in exp.trials for r in t.runs if not r.state.is_terminal and r.job_id]


def trial_job_names(s: Session, jobs: Sequence[QueuedJob], scope: Scope) -> dict[str, str]:
    """Job id -> "<experiment name> (<id>) trial <t>" for the jobs that are this store's trials
    in ``scope`` (another user's experiment names are not shown)."""
    from detslurm import queue

    wanted = {j.identity[0] for j in jobs if j.identity}
    if not wanted:
        return {}
    # One query for every job in the queue, not one per job: `det job list` may show thousands.
    q = select(Experiment.id, Experiment.name, Experiment.exp_dir).where(Experiment.id.in_(wanted))
    if scope.owner is not None:
        q = q.where(Experiment.owner == scope.owner)
    return queue.trial_job_names(jobs, {i: (name, d) for i, name, d in s.execute(q)})


def detached_job_names(s: Session, jobs: Sequence[QueuedJob], scope: Scope) -> dict[str, str]:
    """Job id -> "<experiment name> (<id>) trial <t> (detached)" for the queue's jobs that run
    the scope's detached experiments (the user's own sbatch scripts using core_v2)."""
    from detslurm import queue

    ids = [j.job_id for j in jobs]
    if not ids:
        return {}
    # Newest run last: a requeued job keeps its id, and its latest run names it.
    q = (
        select(TrialRun.job_id, Trial.id, Experiment.id, Experiment.name)
        .join(Trial, TrialRun.trial_id == Trial.id)
        .join(Experiment, Trial.experiment_id == Experiment.id)
        .where(TrialRun.executor == "detached")
        .where(TrialRun.job_id.in_(ids))
        .order_by(TrialRun.id)
    )
    if scope.owner is not None:
        q = q.where(Experiment.owner == scope.owner)
    return queue.detached_job_names([tuple(r) for r in s.execute(q)])  # type: ignore[misc]


def ranked_checkpoints(
    s: Session, cks: Sequence[Checkpoint], metric: str, smaller_is_better: bool, n: int | None = None
) -> list[Checkpoint]:
    """The COMPLETED checkpoints with a validation ``metric``, best first (at most ``n``): what
    `det e download --top-n` and `det t download --best` choose from. Deleted or partial ones
    cannot be restored, and one without a validation has nothing to rank it by."""
    scored = [(v, c) for c in cks if c.state == "COMPLETED" and (v := validation_metric(s, c, metric)) is not None]
    # Negating makes one ascending sort serve both directions; steps break ties (newer first).
    scored.sort(key=lambda vc: (vc[0] if smaller_is_better else -vc[0], -vc[1].steps_completed))
    best = [c for _, c in scored]
    return best if n is None else best[:n]
