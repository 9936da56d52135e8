"""Apply trial events and searcher actions to the store, inside the caller's transaction.

Everything here runs in one transaction per run: the metric rows, the new byte offsets, the
searcher's new state and the trials it creates commit together or not at all (contract 2).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from detslurm.controller.config import stored_config
from detslurm.controller.executor import ExitCause
from detslurm.controller.ingest import event_files, read_new
from detslurm.searcher import Action, Close, Create, Idle, SearchMethod, Shutdown, Stop, ValidateAfter
from detslurm.store.models import (
    Checkpoint,
    Experiment,
    ExperimentState,
    IngestOffset,
    LogEntry,
    Metric,
    Trial,
    TrialRun,
    TrialState,
)

log = logging.getLogger("detslurm.controller")


def note(session: Session, trial_id: int, message: str, level: str = "INFO") -> None:
    session.add(LogEntry(trial_id=trial_id, message=message, level=level))


def _ts(ev: dict[str, Any]) -> datetime:
    try:
        return datetime.fromtimestamp(float(ev.get("time", 0)), timezone.utc)
    except (TypeError, ValueError, OverflowError):
        return datetime.now(timezone.utc)


def apply_actions(session: Session, exp: Experiment, searcher: SearchMethod, actions: Iterable[Action]) -> None:
    trials = {t.request_id: t for t in exp.trials}
    for a in actions:
        if isinstance(a, Create):
            t = Trial(
                experiment_id=exp.id,
                request_id=a.request_id,
                hparams=a.hparams,
                seed=a.seed,
                searcher_ops=list(a.ops),
                ops_closed=bool(a.ops) and not searcher_is_promotion(searcher),
                state=TrialState.ACTIVE.value if exp.state == ExperimentState.ACTIVE.value else TrialState.PAUSED.value,
                restarts=0,
                run_count=0,
                steps_completed=0,
                progress=0.0,
                early_stopped=False,
                ops_idle=False,
                ops_completed=0,
            )
            _warm_start(session, exp, t)
            session.add(t)
            exp.trials.append(t)
            trials[a.request_id] = t
        elif isinstance(a, Stop) and a.request_id in trials:
            t = trials[a.request_id]
            if not t.early_stopped and not TrialState(t.state).is_terminal:
                t.early_stopped = True
                session.flush()
                note(session, t.id, "searcher decided to early stop trial")
        elif isinstance(a, ValidateAfter) and a.request_id in trials:
            t = trials[a.request_id]
            t.searcher_ops = list(t.searcher_ops) + [a.length]
            t.ops_idle = False
        elif isinstance(a, Idle) and a.request_id in trials:
            trials[a.request_id].ops_idle = True
        elif isinstance(a, Close) and a.request_id in trials:
            t = trials[a.request_id]
            t.ops_closed = True
        elif isinstance(a, Shutdown):
            current = ExperimentState(exp.state)
            if current.is_stopping or current.is_terminal:
                continue  # a user's cancel/kill already decides how the experiment ends
            if a.failure:
                exp.error_message = "hp search failed: every trial errored"
                exp.state = ExperimentState.STOPPING_ERROR.value
            elif a.cancel:
                exp.state = ExperimentState.STOPPING_CANCELED.value
            else:
                exp.state = ExperimentState.STOPPING_COMPLETED.value


def searcher_is_promotion(searcher: SearchMethod) -> bool:
    return bool(getattr(searcher, "promotion", False))


def _warm_start(session: Session, exp: Experiment, trial: Trial) -> None:
    sc = stored_config(exp).searcher
    uuid = sc.source_checkpoint_uuid
    if uuid is None and sc.source_trial_id is not None:
        src = session.get(Trial, sc.source_trial_id)
        uuid = src.latest_checkpoint if src else None
    trial.warm_start_checkpoint = uuid


def _on_metrics(
    session: Session, exp: Experiment, trial: Trial, run: TrialRun, ev: dict[str, Any], searcher: SearchMethod
) -> list[Action]:
    group = str(ev.get("group", "training"))
    steps = int(ev.get("steps_completed", 0))
    metrics = ev.get("metrics") or {}
    session.add(
        Metric(
            trial_id=trial.id,
            run_id=run.run_id,
            group=group,
            steps_completed=steps,
            metrics=metrics,
            batch_metrics=ev.get("batch_metrics"),
            report_time=_ts(ev),
            archived=False,
        )
    )
    if group != "validation":
        return []
    sc = stored_config(exp).searcher
    value = metrics.get(sc.metric) if sc.metric else None
    if isinstance(value, (int, float)):
        better = trial.searcher_metric is None or (
            value < trial.searcher_metric if sc.smaller_is_better else value > trial.searcher_metric
        )
        if better:
            trial.searcher_metric = float(value)
    if trial.early_stopped or TrialState(trial.state).is_terminal:
        return []
    return searcher.validation_completed(trial.request_id, metrics, steps)


def _on_checkpoint(session: Session, trial: Trial, run: TrialRun, ev: dict[str, Any]) -> None:
    uuid = str(ev["uuid"])
    if session.get(Checkpoint, uuid) is not None:
        return
    steps = int(ev.get("steps_completed", 0))
    session.add(
        Checkpoint(
            uuid=uuid,
            trial_id=trial.id,
            run_id=run.run_id,
            steps_completed=steps,
            storage_path=str(ev.get("storage_path", "")),
            metadata_=ev.get("metadata") or {},
            resources=ev.get("resources") or {},
            size=int(ev.get("size", 0)),
            report_time=_ts(ev),
        )
    )
    trial.latest_checkpoint = uuid
    trial.steps_completed = steps


def apply_event(
    session: Session, exp: Experiment, trial: Trial, run: TrialRun, ev: dict[str, Any], searcher: SearchMethod
) -> list[Action]:
    typ = ev.get("type")
    if typ == "metrics":
        return _on_metrics(session, exp, trial, run, ev, searcher)
    if typ == "checkpoint":
        _on_checkpoint(session, trial, run, ev)
    elif typ == "checkpoint_deleted":
        ck = session.get(Checkpoint, str(ev.get("uuid")))
        if ck is not None:
            ck.state = "DELETED"
    elif typ == "progress":
        trial.progress = float(ev.get("progress", 0.0))
    elif typ == "status":
        trial.runner_state = str(ev.get("state"))[:64]
    elif typ == "preempt_ack":
        run.preempt_acked = True
    elif typ == "early_exit":
        # InvalidHP decides how the run's exit is read (controller/decide.py); a user-requested
        # stop is an ordinary exit.
        if ev.get("reason") == "INVALID_HP":
            run.exit_reason = ExitCause.INVALID_HP.value
    elif typ == "op_completed":
        trial.ops_idle = False
        trial.ops_completed = max(trial.ops_completed, int(ev.get("index", 0)) + 1)
        return searcher.op_completed(trial.request_id, int(ev.get("length", 0)), float(ev.get("metric", 0.0)))
    elif typ == "alert":
        note(session, trial.id, f"alert: {ev.get('title')}: {ev.get('description')}", "WARNING")
    elif typ == "corrupt":
        note(session, trial.id, f"ignored a corrupt event line: {ev.get('raw')!r}", "WARNING")
    return []


def ingest_run(session: Session, exp: Experiment, trial: Trial, run: TrialRun, searcher: SearchMethod) -> int:
    """Consume new events of one run. Returns how many events were applied."""
    count = 0
    for path in event_files(Path(run.run_dir)):
        key = path.name
        off = session.get(IngestOffset, (run.id, key))
        if off is None:
            off = IngestOffset(trial_run_pk=run.id, file=key, offset=0)
            session.add(off)
        events, new_offset = read_new(path, off.offset)
        for ev in events:
            actions = apply_event(session, exp, trial, run, ev, searcher)
            apply_actions(session, exp, searcher, actions)
            count += 1
        off.offset = new_offset
    return count
