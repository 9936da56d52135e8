"""The ORM's side of reading the store: rows as ORM objects for the operations that change them
(``get_experiment``, ``get_trial``, ...), and the waits' and the dashboard's questions. The
dicts and rows the CLI, the client and the dashboard show are built by the read layer
(``store.reads``), here inside the caller's session: one answer to each question.

Every entry point takes the caller's :class:`~detslurm.identity.Scope`: in a store shared by
several users, another user's experiment, trial or checkpoint is "not found"
(docs/design/security.md). Helpers that take a trial id (runs, metric curves) come after
``get_trial``/``get_experiment`` has checked it. Call them inside ``Store.read()``: nothing here
writes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import func, select
from sqlalchemy.orm import Session, object_session

from detslurm.errors import NotFoundError
from detslurm.identity import Scope
from detslurm.slurm.reasons import pending_words as pending_words
from detslurm.store.models import Checkpoint, Experiment, ExperimentState, Metric, Trial, TrialRun
from detslurm.store.reads import ExperimentRow as ExperimentRow
from detslurm.store.reads import Reads
from detslurm.store.reads import trial_reason as trial_reason


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
    """The trial's batches: its highest step among live metric rows (archived ones were redone
    after the checkpoint a restarted run resumed from, so they do not count)."""
    return _reads(s).batches(trial_id)


def experiment_dict(exp: Experiment) -> dict[str, Any]:
    """The experiment as the CLI's --json, the dashboard and the client show it (store.reads builds it)."""
    s = object_session(exp)
    assert s is not None, "experiment_dict needs a row of an open session"
    return _reads(s).experiment(exp.id, None)[0]


def trial_dict(s: Session, t: Trial) -> dict[str, Any]:
    """The trial as the CLI, the dashboard and the client show it (store.reads builds it)."""
    return _reads(s).trial(t.id, None)


def validation_metric(s: Session, ck: Checkpoint, metric: str) -> float | None:
    """The validation ``metric`` reported at the checkpoint's step count (as Determined pairs
    them); None for a checkpoint saved between validations."""
    return _reads(s).validation_metric(ck.uuid, metric)


def run_dict(r: TrialRun) -> dict[str, Any]:
    """The run as `det t describe` and the dashboard show it (store.reads builds it)."""
    s = object_session(r)
    assert s is not None, "run_dict needs a row of an open session"
    return next(d for d in _reads(s).run_dicts(r.trial_id) if d["run_id"] == r.run_id)


def checkpoint_dict(s: Session, ck: Checkpoint) -> dict[str, Any]:
    """The checkpoint as `det c list`, the dashboard and the client show it (store.reads builds it)."""
    return _reads(s).checkpoint(ck.uuid, None)


def checkpoints(s: Session, exp_id: int, scope: Scope) -> list[Checkpoint]:
    get_experiment(s, exp_id, scope)
    q = (
        select(Checkpoint)
        .join(Trial)
        .where(Trial.experiment_id == exp_id)
        .order_by(Checkpoint.trial_id, Checkpoint.steps_completed)
    )
    return list(s.scalars(q))


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


def experiment_rows(s: Session, scope: Scope, include_archived: bool = False) -> list[ExperimentRow]:
    """The listed columns of the scope's experiments, by id (store.reads' query)."""
    return _reads(s).experiment_rows(scope.owner, include_archived)


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


def _reads(s: Session) -> Reads:
    """The read layer's queries inside this session's transaction."""
    return Reads.on(s.connection())
