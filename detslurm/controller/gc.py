"""Checkpoint garbage collection by the expconf GC policy, once an experiment has ended.

Kept: each trial's newest ``save_trial_latest`` checkpoints, its best ``save_trial_best`` by the
searcher metric, and the experiment's best ``save_experiment_best``. The rest are deleted from
storage and marked DELETED (the rows stay, so history still shows them).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from detslurm.store.models import Checkpoint, Experiment, Metric, Trial


def _validation_metric(session: Session, ck: Checkpoint, metric: str) -> float | None:
    q = (
        select(Metric.metrics)
        .where(Metric.trial_id == ck.trial_id)
        .where(Metric.group == "validation")
        .where(Metric.steps_completed == ck.steps_completed)
        .where(Metric.archived.is_(False))
    )
    for row in session.scalars(q):
        v = row.get(metric)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def keep_set(session: Session, exp: Experiment) -> set[str]:
    cfg = exp.config
    policy = cfg["checkpoint_storage"]
    metric = cfg["searcher"]["metric"]
    sign = 1.0 if cfg["searcher"]["smaller_is_better"] else -1.0
    keep: set[str] = set()
    scored_all: list[tuple[float, str]] = []
    for t in session.scalars(select(Trial).where(Trial.experiment_id == exp.id)):
        cks = list(
            session.scalars(
                select(Checkpoint)
                .where(Checkpoint.trial_id == t.id)
                .where(Checkpoint.state == "COMPLETED")
                .order_by(Checkpoint.report_time)
            )
        )
        latest = policy.get("save_trial_latest", 1)
        if latest:
            keep.update(c.uuid for c in cks[-latest:])
        scored = [(sign * v, c.uuid) for c in cks if (v := _validation_metric(session, c, metric)) is not None]
        scored.sort()
        keep.update(u for _, u in scored[: policy.get("save_trial_best", 1)])
        scored_all += scored
    scored_all.sort()
    keep.update(u for _, u in scored_all[: policy.get("save_experiment_best", 0)])
    return keep


def collect_garbage(session: Session, exp: Experiment) -> list[str]:
    keep = keep_set(session, exp)
    deleted = []
    q = select(Checkpoint).join(Trial).where(Trial.experiment_id == exp.id).where(Checkpoint.state == "COMPLETED")
    for ck in session.scalars(q):
        if ck.uuid in keep:
            continue
        if ck.storage_path:
            shutil.rmtree(Path(ck.storage_path), ignore_errors=True)
        ck.state = "DELETED"
        deleted.append(ck.uuid)
    return deleted
