"""Apply trial events and searcher actions to the store, inside the caller's transaction.

Everything here runs in one transaction per run: the metric rows, the new byte offsets, the
searcher's new state and the trials it creates commit together or not at all (contract 2).
Each event is applied in its own SAVEPOINT, so one event the store refuses costs only itself;
metric reports, the bulk of every file, are written by ``bulk_metrics.PendingMetrics`` alone
(many rows per statement, a refused row costing only itself there too).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import inspect, select
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session

from detslurm.controller.bulk_metrics import PendingMetrics
from detslurm.controller.config import stored_config
from detslurm.controller.executor import ExitCause
from detslurm.controller.fastjson import decode_line
from detslurm.protocol import (
    Alert,
    BadEvent,
    CheckpointDeleted,
    CheckpointSaved,
    EarlyExit,
    Event,
    ExpPaths,
    Line,
    Metrics,
    OpCompleted,
    PreemptAck,
    Progress,
    RunMetadata,
    RunPaths,
    Status,
    read_lines,
)
from detslurm.protocol.reader import Batch, preview
from detslurm.searcher import (
    Action,
    Close,
    Create,
    Idle,
    SearcherError,
    SearchMethod,
    Shutdown,
    Stop,
    ValidateAfter,
)
from detslurm.store.models import (
    Checkpoint,
    Experiment,
    ExperimentState,
    IngestOffset,
    LogEntry,
    Trial,
    TrialRun,
    TrialState,
)
from detslurm.store.sanitize import json_safe

log = logging.getLogger("detslurm.controller")
MAX_NOTE = 2000  # characters of one note about trial-written input
MAX_LISTED = 5  # bad lines described in one quarantine note (all are counted)
# Reads one event file from a byte offset (protocol.read_lines, or a counting fake in tests).
Reader = Callable[[Path, int], Batch]


def note(session: Session, trial_id: int, message: str, level: str = "INFO") -> None:
    """Add a controller message to the trial's log (shown by ``det trial logs``), in this transaction."""
    session.add(LogEntry(trial_id=trial_id, message=message, level=level))


def _ts(t: float) -> datetime:
    try:
        return datetime.fromtimestamp(t, timezone.utc)
    # The time comes from the trial (untrusted): an absurd one is replaced, not allowed to fail ingest.
    except (ValueError, OverflowError, OSError):
        return datetime.now(timezone.utc)


def apply_actions(session: Session, exp: Experiment, searcher: SearchMethod, actions: Iterable[Action]) -> None:
    """Record the searcher's actions (new trials, stops, ops, shutdown) in the store."""
    actions = list(actions)
    if not actions:
        return  # most events ask nothing of the searcher: do not load every trial for them
    trials = _named_trials(session, exp, actions)
    for a in actions:
        if isinstance(a, Create):
            # ExperimentState(): an experiment being created holds its state as the plain value.
            if ExperimentState(exp.state).is_stopping or ExperimentState(exp.state).is_terminal:
                # A killed, canceled or ending experiment starts nothing: the replacement the
                # searcher asks for when the stop ends a trial is dropped (Determined's searcher
                # stops with its experiment), so no trial is created after a kill.
                continue
            t = Trial(
                experiment_id=exp.id,
                request_id=a.request_id,
                hparams=a.hparams,
                seed=a.seed,
                searcher_ops=list(a.ops),
                # A legacy max_length gives one op and nothing after it, unless ASHA promotion hands out more
                # (it then closes the trial itself with Close).
                ops_closed=bool(a.ops) and not searcher_is_promotion(searcher),
                # A trial created while the experiment is paused waits, paused, for ``det experiment activate``.
                state=TrialState.ACTIVE if exp.state == ExperimentState.ACTIVE else TrialState.PAUSED,
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
            # Through the backref: a collection not loaded is not loaded for it (10,000 trials).
            t.experiment = exp
            trials[a.request_id] = t
        elif isinstance(a, Stop) and a.request_id in trials:
            t = trials[a.request_id]
            if not t.early_stopped and not t.state.is_terminal:
                # Recorded only: the trial's next exit then completes it instead of restarting it (decide.py).
                t.early_stopped = True
                # Flush so a trial created earlier in this batch has its id before the note refers to it.
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
            current = exp.state
            if current.is_stopping or current.is_terminal:
                continue  # a user's cancel/kill already decides how the experiment ends
            if a.failure:
                exp.error_message = "hp search failed: every trial errored"
                exp.state = ExperimentState.STOPPING_ERROR
            elif a.cancel:
                exp.state = ExperimentState.STOPPING_CANCELED
            else:
                exp.state = ExperimentState.STOPPING_COMPLETED


def _named_trials(session: Session, exp: Experiment, actions: list[Action]) -> dict[str, Trial]:
    """The trials the actions name, by request id: one query for just those, unless the
    experiment's trials are loaded already."""
    if "trials" not in inspect(exp).unloaded:
        return {t.request_id: t for t in exp.trials}
    names = sorted({a.request_id for a in actions if isinstance(a, (Stop, ValidateAfter, Idle, Close))})
    if not names:
        return {}
    q = select(Trial).where(Trial.experiment_id == exp.id).where(Trial.request_id.in_(names))
    return {t.request_id: t for t in session.scalars(q)}


def searcher_is_promotion(searcher: SearchMethod) -> bool:
    """Whether the searcher hands out more ops over time (0.37 ASHA promotion)."""
    return bool(getattr(searcher, "promotion", False))


def _warm_start(session: Session, exp: Experiment, trial: Trial) -> None:
    sc = stored_config(exp).searcher
    # Determined's warm start: an explicit checkpoint wins, else the source trial's latest one.
    uuid = sc.source_checkpoint_uuid
    if uuid is None and sc.source_trial_id is not None:
        src = session.get(Trial, sc.source_trial_id)
        uuid = src.latest_checkpoint if src else None
    trial.warm_start_checkpoint = uuid


def _searcher_sees(exp: Experiment, trial: Trial, ev: Metrics, searcher: SearchMethod) -> list[Action]:
    """What a metrics report means beyond its row: the trial's best searcher metric, and the
    searcher's reaction to a validation (its actions, not applied yet)."""
    # Every group is stored, but only validation metrics feed the searcher, as in Determined.
    if ev.group != "validation":
        return []
    sc = stored_config(exp).searcher
    value = ev.metrics.get(sc.metric) if sc.metric else None
    # The trial's best searcher metric so far, shown by ``det trial describe``.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        better = trial.searcher_metric is None or (
            value < trial.searcher_metric if sc.smaller_is_better else value > trial.searcher_metric
        )
        if better:
            trial.searcher_metric = float(value)
    # A stopped trial may still report while it winds down; the searcher has already decided on it.
    if trial.early_stopped or trial.state.is_terminal:
        return []
    return searcher.validation_completed(trial.request_id, ev.metrics, ev.steps_completed)


def _stopped_at(run: TrialRun, signalled: float, when: float) -> None:
    """The run's stop time so far: signal -> acknowledgement, or -> the checkpoint written after
    it (Determined's pattern acknowledges first, then checkpoints and exits)."""
    # Both times are the compute node's clock; a negative difference is a clock step, not speed.
    took = max(0.0, when - signalled)
    run.preempt_stop_s = max(run.preempt_stop_s or 0.0, took)


def _on_checkpoint(session: Session, trial: Trial, run: TrialRun, ev: CheckpointSaved) -> None:
    if run.preempt_acked and run.preempt_signal_time is not None:
        _stopped_at(run, run.preempt_signal_time, ev.time)
    # The first report of a uuid wins: a trial cannot re-point a recorded checkpoint at another path
    # or take over one that belongs to another trial.
    if session.get(Checkpoint, ev.uuid) is not None:
        return
    session.add(
        Checkpoint(
            uuid=ev.uuid,
            trial_id=trial.id,
            run_id=run.run_id,
            steps_completed=ev.steps_completed,
            storage_path=ev.storage_path,
            metadata_=json_safe(ev.metadata),
            resources=dict(ev.resources),
            size=ev.size,
            report_time=_ts(ev.time),
        )
    )
    # A restart resumes from the most recently reported checkpoint, and DET_STEPS_COMPLETED says
    # how far that was.
    trial.latest_checkpoint = ev.uuid
    trial.steps_completed = ev.steps_completed


def apply_event(
    session: Session, exp: Experiment, trial: Trial, run: TrialRun, ev: Event, searcher: SearchMethod
) -> list[Action]:
    """Apply one decoded event of ``run`` to the store; returns the searcher's reactions."""
    match ev:
        case Metrics():
            # Ingest's one writer of metric rows, points and TensorBoard records is
            # bulk_metrics.PendingMetrics (_Ingest.line); a second path here would drift from it.
            raise TypeError("metric reports are written by bulk_metrics.PendingMetrics, not apply_event")
        case CheckpointSaved():
            _on_checkpoint(session, trial, run, ev)
        case CheckpointDeleted():
            ck = session.get(Checkpoint, ev.uuid)
            # A trial may only mark its own checkpoints deleted.
            if ck is not None and ck.trial_id == trial.id:
                ck.state = "DELETED"
        case Progress():
            trial.progress = ev.progress
        case Status():
            trial.runner_state = ev.state[:64]
        case PreemptAck():
            run.preempt_acked = True
            if ev.signal_time is not None and run.preempt_signal_time is None:
                run.preempt_signal_time = ev.signal_time
                _stopped_at(run, ev.signal_time, ev.time)
        case EarlyExit():
            # InvalidHP decides how the run's exit is read (controller/decide.py); a
            # user-requested stop is an ordinary exit.
            if ev.reason == "INVALID_HP":
                run.exit_reason = ExitCause.INVALID_HP.value
        case OpCompleted():
            trial.ops_idle = False
            # max: an op reported twice, or out of order, never moves the count back.
            trial.ops_completed = max(trial.ops_completed, ev.index + 1)
            return searcher.op_completed(trial.request_id, ev.length, ev.metric)
        case Alert():
            note(session, trial.id, _bounded(f"alert: {ev.title}: {ev.description}"), "WARNING")
        case RunMetadata():
            # metadata.json in the trial dir stays the source (core's get_metadata reads it);
            # the note makes the change visible in `det trial logs`.
            shown = json.dumps(json_safe(ev.metadata), sort_keys=True)
            note(session, trial.id, _bounded(f"trial metadata set (run {run.run_id}): {shown}"))
    return []


def ingest_run(
    session: Session,
    exp: Experiment,
    trial: Trial,
    run: TrialRun,
    searcher: SearchMethod,
    reader: Reader = read_lines,
    unfinished: set[int] | None = None,
) -> int:
    """Consume new events of one run; returns how many were applied. ``reader`` reads one
    file from an offset (injected to count opens); a run with lines left to read (a chunk
    bound, NUL bytes waiting) is added to ``unfinished``: its next tick must read again even
    if its files do not change.

    Never raises for anything a trial wrote: a line that does not decode, or whose event the
    store refuses, is quarantined (offset moved past it, one WARNING note per file and pass).
    Only a SearcherError (the experiment errors) and a failing store escape."""
    count = 0
    for path in RunPaths.from_run_dir(Path(run.run_dir)).event_files():
        off = session.get(IngestOffset, (run.id, path.name))
        if off is None:
            off = IngestOffset(trial_run_pk=run.id, file=path.name, offset=0)
            session.add(off)
        if off.offset < 0:  # refused before (not a regular file): never read again
            continue
        batch = reader(path, off.offset)
        if batch.refused is not None or batch.shrunk_from is not None:
            _odd_file(session, trial, run, path.name, off, batch)
            if batch.refused is not None:
                continue
        if (batch.more or batch.waiting) and unfinished is not None:
            unfinished.add(run.id)
        # Bad lines are collected and noted once per file and pass: a trial writing millions of
        # them adds one note per tick, not millions of rows.
        bad: list[str] = []

        # The reports' TensorBoard records are written by the pending rows' flushes (bulk_metrics.py).
        pending = PendingMetrics(trial.id, run.run_id, ExpPaths(Path(exp.exp_dir)).trial_tensorboard(trial.id))
        at = _Ingest(session, exp, trial, run, searcher, off, pending, _refusals(bad))
        # The offset moves once per pass (below); an event that errors the experiment moves it
        # past itself before it raises (SearcherError), and a failing store rolls back the tick.
        try:
            for line in batch.lines:
                count += at.line(line)
        except SearcherError:
            # The experiment errors, and the offset is past the lines refused before the
            # event that failed it: they still get their note.
            if bad:
                _quarantined(session, trial, run, path.name, bad)
            raise
        count -= at.pending.flush(session, at.refused)
        # Past skipped blank lines (and the rest of a too-long line) as well.
        off.offset = batch.offset
        if bad:
            _quarantined(session, trial, run, path.name, bad)
        if batch.waiting:
            log.info("trial %s run %s %s: %s", trial.id, run.run_id, path.name, batch.waiting)
    return count


# Events whose whole effect is an attribute of the trial or run: nothing the store could refuse,
# so they need no SAVEPOINT of their own (and do not interrupt a bulk of metric rows).
_ATTRIBUTE_EVENTS = (Progress, Status, PreemptAck)


@dataclass
class _Ingest:
    """One event file's pass: applies its lines in order, metric rows in bulk (bulk_metrics.py)
    and every other event in its own SAVEPOINT, as before."""

    session: Session
    exp: Experiment
    trial: Trial
    run: TrialRun
    searcher: SearchMethod
    off: IngestOffset
    pending: PendingMetrics
    refused: Callable[[Line, str], None]

    def line(self, line: Line) -> int:
        """Apply one line; how many events were applied (minus metric rows found refused)."""
        ev = _decoded(line)
        if isinstance(ev, str):
            self.refused(line, ev)
            return 0
        if isinstance(ev, Metrics):
            self.pending.add(line, ev, _ts(ev.time))
            problem = self._searcher_step(line, ev) if ev.group == "validation" else None
        elif isinstance(ev, _ATTRIBUTE_EVENTS):
            apply_event(self.session, self.exp, self.trial, self.run, ev, self.searcher)
            return 1
        else:
            # Rows first: ids keep the trial's order, and the event may read them.
            bad = self.pending.flush(self.session, self.refused)
            problem = _apply_one(self.session, self.exp, self.trial, self.run, line, ev, self.searcher, self.off)
            if problem is None:
                return 1 - bad
            self.refused(line, problem)
            return -bad
        if problem is not None:
            self.refused(line, problem)
            return 0
        return 1

    def _searcher_step(self, line: Line, ev: Metrics) -> str | None:
        """A validation's searcher side: the searcher sees it, and its actions (rare: ASHA's
        decisions) are applied with the report's row in a SAVEPOINT after the rows before it.
        A failure costs only this event, as its own SAVEPOINT did before: its row is dropped
        and the trial's best metric restored. None when done."""
        best = self.trial.searcher_metric
        try:
            actions = _searcher_sees(self.exp, self.trial, ev, self.searcher)
            if actions:
                mine = self.pending.drop(line)
                self.pending.flush(self.session, self.refused)
                with self.session.begin_nested():
                    self.pending.insert(self.session, mine)
                    apply_actions(self.session, self.exp, self.searcher, actions)
        except SearcherError:
            # The experiment errors on this event: the rows before it are kept, and it is never
            # fed again.
            self.pending.drop(line)
            self.pending.flush(self.session, self.refused)
            self.off.offset = line.end
            raise
        except (OperationalError, InterfaceError):
            raise
        except Exception as e:
            self.pending.drop(line)
            self.trial.searcher_metric = best
            log.warning("trial %s: could not apply a metrics event", self.trial.id, exc_info=True)
            return f"could not apply metrics: {type(e).__name__}: {str(e)[:200]}"
        return None


def _refusals(bad: list[str]) -> Callable[[Line, str], None]:
    """A callback that describes a refused line into ``bad`` (one quarantine note per file)."""

    def refused(line: Line, problem: str) -> None:
        bad.append(f"byte {line.start}: {problem}: {preview(line.data)}")

    return refused


def _decoded(line: Line) -> Event | str:
    """The line's event, or why it cannot be used (the reader's or the decoder's reason)."""
    if line.problem is not None:
        return line.problem
    try:
        return decode_line(line.data)
    except BadEvent as e:
        return e.reason


def _apply_one(
    session: Session,
    exp: Experiment,
    trial: Trial,
    run: TrialRun,
    line: Line,
    ev: Event,
    searcher: SearchMethod,
    off: IngestOffset,
) -> str | None:
    """Apply one decoded event in its own SAVEPOINT; None when applied, else why it was not."""
    try:
        # The searcher object itself is not rolled back with the savepoint; only the searcher's
        # own bugs can fail after it changed, and they then cost this one event's decision.
        with session.begin_nested():
            apply_actions(session, exp, searcher, apply_event(session, exp, trial, run, ev, searcher))
    except SearcherError:
        off.offset = line.end  # the experiment errors on this event: do not feed it again
        raise
    except (OperationalError, InterfaceError):
        raise  # the store itself failed: the whole tick rolls back and is retried
    except Exception as e:
        # A value the store refuses, or a bug: this event only; the others still commit.
        log.warning("trial %s: could not apply a %s event", trial.id, ev.TYPE.value, exc_info=True)
        return f"could not apply {ev.TYPE.value}: {type(e).__name__}: {str(e)[:200]}"
    return None


# The offset of an event file that is refused for good (see _odd_file).
REFUSED_FILE = -1


def _odd_file(session: Session, trial: Trial, run: TrialRun, file: str, off: IngestOffset, batch: Batch) -> None:
    """A note for an event file the trial's writer would never make: refused for good (its
    offset becomes REFUSED_FILE), or shorter than what was read (read again from its start)."""
    if batch.refused is not None:
        off.offset = REFUSED_FILE
        message = f"event file {file} of run {run.run_id} {batch.refused}: it is not read"
    else:
        message = (
            f"event file {file} of run {run.run_id} shrank below the {batch.shrunk_from} bytes already "
            "read (it lost its tail, or the trial truncated it): it is read on from the end of its last whole line"
        )
    note(session, trial.id, _bounded(message), "WARNING")
    log.warning("trial %s: %s", trial.id, message)


def _quarantined(session: Session, trial: Trial, run: TrialRun, file: str, bad: list[str]) -> None:
    head = f"quarantined {len(bad)} bad event line(s) of run {run.run_id} {file}: "
    note(session, trial.id, _bounded(head + "; ".join(bad[:MAX_LISTED])), "WARNING")
    log.warning("trial %s: %s%s", trial.id, head, bad[0])


def _bounded(message: str) -> str:
    # Notes quote trial-written text: no NUL (PostgreSQL text refuses it), bounded length.
    message = message.replace("\x00", "\\0")
    return message if len(message) <= MAX_NOTE else message[: MAX_NOTE - 3] + "..."
