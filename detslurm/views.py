"""Read-only views of the store as plain dicts (for the CLI tables, --json and the client)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from detslurm.errors import NotFoundError
from detslurm.store.models import Checkpoint, Experiment, LogEntry, Metric, Trial, TrialRun


def get_experiment(s: Session, exp_id: int) -> Experiment:
    exp = s.get(Experiment, exp_id)
    if exp is None:
        raise NotFoundError("experiment", exp_id)
    return exp


def get_trial(s: Session, trial_id: int) -> Trial:
    t = s.get(Trial, trial_id)
    if t is None:
        raise NotFoundError("trial", trial_id)
    return t


def batches(s: Session, trial_id: int) -> int:
    v = s.scalar(
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
        "batches": batches(s, t.id),
        "early_stopped": t.early_stopped,
        "exit_reason": t.exit_reason,
    }


def validation_metric(s: Session, ck: Checkpoint, metric: str) -> float | None:
    q = (
        select(Metric.metrics)
        .where(Metric.trial_id == ck.trial_id)
        .where(Metric.group == "validation")
        .where(Metric.steps_completed == ck.steps_completed)
        .where(Metric.archived.is_(False))
    )
    for m in s.scalars(q):
        if isinstance(m.get(metric), (int, float)):
            return float(m[metric])
    return None


def checkpoint_dict(s: Session, ck: Checkpoint) -> dict[str, Any]:
    trial = s.get(Trial, ck.trial_id)
    assert trial is not None
    metric = trial.experiment.config["searcher"]["metric"]
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


def checkpoints(s: Session, exp_id: int) -> list[Checkpoint]:
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
    return list(s.scalars(q.order_by(Metric.steps_completed, Metric.id)))


def runs(s: Session, trial_id: int) -> list[TrialRun]:
    return list(s.scalars(select(TrialRun).where(TrialRun.trial_id == trial_id).order_by(TrialRun.run_id)))


def notes(s: Session, trial_id: int) -> list[LogEntry]:
    return list(s.scalars(select(LogEntry).where(LogEntry.trial_id == trial_id).order_by(LogEntry.id)))
