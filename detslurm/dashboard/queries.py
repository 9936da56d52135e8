"""What the dashboard's pages show, read from the store: typed rows, each query scoped like
:mod:`detslurm.views` (another user's experiment or trial is "not found").

Everything here reads; call it inside ``Store.read()``. Queries that could touch a million
metric rows (the curves) aggregate in SQL, so only the downsampled buckets leave the database.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import and_, extract, func, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from detslurm import views
from detslurm.dashboard.downsample import Series, bucket_width, points_per_series
from detslurm.expconf.view import SEARCHER_METRIC, SEARCHER_NAME, SMALLER_IS_BETTER, ConfigView
from detslurm.identity import Scope
from detslurm.store.models import Checkpoint, Experiment, Metric, MetricPoint, Trial

# Metric names come from trials (untrusted); one that could not be a plain JSON key in a
# path expression is simply not offered as a curve.
_BAD_NAME_CHARS = set('"\\\x00')
# How many metric rows (of the newest trials) are read to learn which metric names an experiment
# has: enough to see every name a trial reports, without reading a million JSON documents.
NAME_SAMPLE_ROWS = 2000
NAME_SAMPLE_TRIALS = 20


@dataclass
class ExperimentSummary:
    """One row of the experiments list."""

    id: int
    name: str
    owner: str
    state: str
    progress: float
    searcher: str
    metric: str
    smaller_is_better: bool
    best_metric: float | None
    trials: int
    resource_pool: str
    start_time: str | None
    end_time: str | None


@dataclass
class TrialRow:
    """One trial in an experiment's table (and one line of its hyperparameter view)."""

    id: int
    state: str
    hparams: dict[str, Any]
    searcher_metric: float | None
    batches: int
    restarts: int
    runs: int
    progress: float
    rung: int | None
    start_time: str | None
    end_time: str | None


@dataclass
class Rung:
    """One ASHA rung: the training length that enters it and the trials it ranks, best first."""

    bracket: int
    index: int
    units: int
    trials: list[int]
    metrics: list[float]
    promoted: list[int]


@dataclass
class CurveSet:
    """Every trial's curve of one metric, downsampled (x in batches, seconds and epochs)."""

    group: str
    metric: str
    bucket_batches: int
    # Batches -> epochs factor (global batch size / records per epoch); None when unknown.
    epochs_per_batch: float | None
    series: list[Series] = field(default_factory=list)


def iso(t: datetime | None) -> str | None:
    return None if t is None else _utc(t).isoformat()


def _utc(t: datetime) -> datetime:
    # SQLite hands back naive datetimes (stored as UTC); PostgreSQL aware ones.
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)


def experiments(s: Session, scope: Scope) -> list[ExperimentSummary]:
    """The experiments list: views' columns plus searcher, best metric and trial count, in
    two queries whatever the number of experiments (no per-experiment config load)."""
    e = Experiment
    searcher = e.config[SEARCHER_NAME].as_string()
    metric = e.config[SEARCHER_METRIC].as_string()
    smaller = e.config[SMALLER_IS_BETTER].as_boolean()
    q = select(e.id, searcher, metric, smaller).where(e.archived.is_(False))
    if scope.owner is not None:
        q = q.where(e.owner == scope.owner)
    # Searcher fields straight from the JSON column: loading and validating 10k configs through
    # pydantic (what stored_config does) would take seconds.
    extra = {i: (n or "", m or "", True if sb is None else bool(sb)) for i, n, m, sb in s.execute(q)}
    t = Trial
    stats_q = select(t.experiment_id, func.min(t.searcher_metric), func.max(t.searcher_metric), func.count())
    stats = {i: (lo, hi, n) for i, lo, hi, n in s.execute(stats_q.group_by(t.experiment_id))}
    out = []
    for r in views.experiment_rows(s, scope):
        # Best is the searcher's best: the smallest metric unless larger is better.
        name, m, sb = extra.get(r.id, ("", "", True))
        lo, hi, n = stats.get(r.id, (None, None, 0))
        out.append(
            ExperimentSummary(
                id=r.id,
                name=r.name,
                owner=r.owner,
                state=str(r.state),
                progress=float(r.progress or 0.0),
                searcher=name,
                metric=m,
                smaller_is_better=sb,
                best_metric=lo if sb else hi,
                trials=int(n),
                resource_pool=r.resource_pool,
                start_time=iso(r.start_time),
                end_time=iso(r.end_time),
            )
        )
    return out


def _batches_by_trial(s: Session, exp_id: int) -> dict[int, int]:
    """Each trial's batches as views.batches counts them (archived rows excluded), in two grouped
    queries instead of one per trial (1000 of them for a large search)."""
    trials = select(Trial.id).where(Trial.experiment_id == exp_id)
    # Without the archived filter the max comes from the (trial, group, steps) index alone, no
    # table rows read. Only a trial that ran more than once can have archived rows (they are what
    # a restart redid): those few are counted again with the filter.
    q = select(Metric.trial_id, func.max(Metric.steps_completed)).where(Metric.trial_id.in_(trials))
    out = {int(i): int(b or 0) for i, b in s.execute(q.group_by(Metric.trial_id))}
    rerun = select(Trial.id).where(Trial.experiment_id == exp_id, Trial.run_count > 1)
    # A rerun trial whose every row is archived has done no batches that count.
    out.update({int(i): 0 for i in s.scalars(rerun) if int(i) in out})
    exact = q.where(Metric.trial_id.in_(rerun), Metric.archived.is_(False)).group_by(Metric.trial_id)
    out.update({int(i): int(b or 0) for i, b in s.execute(exact)})
    return out


def trial_rows(s: Session, exp_id: int, scope: Scope) -> list[TrialRow]:
    """The experiment's trials, with each one's current ASHA rung where there is one."""
    exp = views.get_experiment(s, exp_id, scope)
    batches = _batches_by_trial(s, exp_id)
    rung_of = _rung_of(exp)
    q = select(Trial).where(Trial.experiment_id == exp_id).order_by(Trial.id)
    return [
        TrialRow(
            id=t.id,
            state=str(t.state),
            hparams=t.hparams,
            searcher_metric=t.searcher_metric,
            batches=batches.get(t.id, 0),
            restarts=t.restarts,
            runs=t.run_count,
            progress=t.progress,
            rung=rung_of.get(t.request_id),
            start_time=iso(t.start_time),
            end_time=iso(t.end_time),
        )
        for t in s.scalars(q)
    ]


def _brackets(exp: Experiment) -> list[dict[str, Any]]:
    state = exp.searcher_state or {}
    # SearchMethod.state_dict(): the method's own state (ASHA's brackets) sits under "method".
    method = state.get("method") if isinstance(state, dict) else None
    brackets = method.get("brackets") if isinstance(method, dict) else None
    return [b for b in brackets if isinstance(b, dict)] if isinstance(brackets, list) else []


def _rung_of(exp: Experiment) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in _brackets(exp):
        tr = b.get("trial_rung")
        if isinstance(tr, dict):
            out.update({str(k): int(v) for k, v in tr.items() if isinstance(v, int)})
    return out


def rungs(s: Session, exp_id: int, scope: Scope) -> list[Rung]:
    """ASHA's rungs from the searcher state the daemon stores (empty for other searchers)."""
    exp = views.get_experiment(s, exp_id, scope)
    by_request = {
        str(r): int(i) for r, i in s.execute(select(Trial.request_id, Trial.id).where(Trial.experiment_id == exp_id))
    }
    out: list[Rung] = []
    for bi, b in enumerate(_brackets(exp)):
        units, entries, promoted = b.get("units") or [], b.get("rungs") or [], b.get("promoted") or []
        for ri, rung in enumerate(entries):
            pairs = [(m, by_request.get(str(rid))) for m, rid in rung if isinstance(m, (int, float))]
            # Metrics are stored sign-adjusted (smaller is better inside the searcher); shown as is.
            out.append(
                Rung(
                    bracket=bi,
                    index=ri,
                    units=int(units[ri]) if ri < len(units) else 0,
                    trials=[t for _, t in pairs if t is not None],
                    metrics=[float(m) for m, t in pairs if t is not None and math.isfinite(m)],
                    promoted=[by_request[p] for p in (promoted[ri] if ri < len(promoted) else []) if p in by_request],
                )
            )
    return out


def metric_names(s: Session, exp_id: int, trial_id: int | None = None) -> dict[str, list[str]]:
    """Group -> metric names with numeric values, from a sample of rows (NAME_SAMPLE_ROWS of
    the newest NAME_SAMPLE_TRIALS trials). Call after the experiment or trial was checked
    against the scope."""
    if trial_id is not None:
        ids = [trial_id]
    else:
        newest = select(Trial.id).where(Trial.experiment_id == exp_id).order_by(Trial.id.desc())
        ids = list(s.scalars(newest.limit(NAME_SAMPLE_TRIALS)))
    # No ORDER BY: sorting a large trial's rows would cost more than reading them.
    q = select(Metric.group, Metric.metrics).where(Metric.trial_id.in_(ids), Metric.archived.is_(False))
    names: dict[str, set[str]] = {}
    for group, m in s.execute(q.limit(NAME_SAMPLE_ROWS)):
        if isinstance(m, dict):
            keys = {k for k, v in m.items() if _numeric(v) and not _BAD_NAME_CHARS & set(k)}
            names.setdefault(group, set()).update(keys)
    return {g: sorted(ns) for g, ns in sorted(names.items())}


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _epoch_seconds(dialect: str, t: Any) -> ColumnElement[Any]:
    """A timestamp as Unix seconds, computed in SQL: parsing ~100k datetimes in Python would
    cost more than the whole query."""
    if dialect == "postgresql":
        return extract("epoch", t)
    # SQLite keeps UTC text; julianday() reads it. 2440587.5 is the Julian day of 1970-01-01.
    return (func.julianday(t) - 2440587.5) * 86400.0


def curves(s: Session, exp_id: int, scope: Scope, group: str, metric: str, trial_id: int | None = None) -> CurveSet:
    """Every trial's (or one trial's) curve of ``group``/``metric``, bucketed in SQL from the
    metric_points index (no JSON is parsed)."""
    exp = views.get_experiment(s, exp_id, scope)
    out = CurveSet(group, metric, 1, _epochs_per_batch(exp))
    if not metric:
        return out
    p = MetricPoint
    trials = select(Trial.id).where(Trial.experiment_id == exp_id)
    if trial_id is not None:
        trials = trials.where(Trial.id == trial_id)
    rows = and_(p.trial_id.in_(trials), p.group == group, p.name == metric, p.archived.is_(False))
    # Sizes first: they set the bucket width.
    n_trials, max_step = s.execute(
        select(func.count(func.distinct(p.trial_id)), func.max(p.steps_completed)).where(rows)
    ).one()
    if not n_trials:
        return out
    out.bucket_batches = width = bucket_width(int(max_step or 0), points_per_series(int(n_trials)))
    # The browser draws min/max bands only for a few curves; for many, they are not even computed.
    bands = n_trials <= 20
    starts = {
        i: _utc(t).timestamp() for i, t in s.execute(select(Trial.id, Trial.start_time).where(Trial.id.in_(trials)))
    }
    by_trial: dict[int, Series] = {}
    dialect = s.get_bind().dialect.name
    for tid, step, t, v, n, *lo_hi in s.execute(_bucket_query(dialect, rows, width, bands)):
        ser = by_trial.get(tid)
        if ser is None:
            ser = by_trial[tid] = Series(tid, [], [], [], [], [], raw_points=0)
        ser.batches.append(float(step))
        # Milliseconds: SQLite's julianday() is a float of days, exact to ~20 microseconds only.
        ser.seconds.append(round(max(0.0, float(t) - starts[tid]), 3) if t is not None else 0.0)
        ser.value.append(float(v))
        if bands:
            ser.vmin.append(float(lo_hi[0]))
            ser.vmax.append(float(lo_hi[1]))
        ser.raw_points += int(n)
    # Insertion order is the query's (trial id): the browser's colors follow trial ids.
    out.series = list(by_trial.values())
    return out


def _bucket_query(dialect: str, rows: ColumnElement[bool], width: int, bands: bool) -> Any:
    """(trial, mean step, last time, mean value, count[, min, max]) per trial and bucket."""
    p = MetricPoint
    bucket = (p.steps_completed // width).label("b")
    cols = [
        p.trial_id,
        func.avg(p.steps_completed),
        _epoch_seconds(dialect, func.max(p.report_time)),
        func.avg(p.value),
        func.count(),
    ]
    if bands:
        cols += [func.min(p.value), func.max(p.value)]
    return select(*cols).where(rows).group_by(p.trial_id, bucket).order_by(p.trial_id, bucket)


def _epochs_per_batch(exp: Experiment) -> float | None:
    """Epochs per batch, as Determined counts them: global batch size / records per epoch."""
    cfg = ConfigView(exp.config)
    rpe, gbs = cfg.records_per_epoch, cfg.constant_hparam("global_batch_size")
    if _numeric(gbs) and rpe > 0:
        return float(gbs) / float(rpe)
    return None


def checkpoints(s: Session, trial_id: int, scope: Scope) -> list[dict[str, Any]]:
    """The trial's checkpoints, newest step first (views' dicts: uuid, steps, size, state...)."""
    views.get_trial(s, trial_id, scope)
    rows = s.scalars(select(Checkpoint).where(Checkpoint.trial_id == trial_id).order_by(Checkpoint.steps_completed))
    return [views.checkpoint_dict(s, ck) for ck in reversed(list(rows))]
