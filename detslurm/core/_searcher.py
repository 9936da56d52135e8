"""SearcherContext for 0.37-style scripts: ``for op in ctx.searcher.operations(): ...``.

Operations come from the trial's ``searcher_ops.json``, written by the controller: a list of
absolute lengths, how many are completed, and whether more may come. Out of operations, the
trial acknowledges "preemption" and exits; the controller resumes it if it is promoted later.
"""

from __future__ import annotations

import enum
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from detslurm.core._distributed import DistributedContext
from detslurm.core._train import Writer, dropped_writer
from detslurm.protocol import BadRecord, SearcherOps
from detslurm.protocol.events import OpCompleted, Progress

log = logging.getLogger("detslurm.core")

# The chief polls the ops file while it waits for the searcher; a quarter second adds little
# latency and costs one small read, on a file only this trial reads.
POLL_S = 0.25


class Unit(enum.Enum):
    # Determined's values, so code that stores or compares them (Unit("EPOCHS")) keeps working.
    EPOCHS = "EPOCHS"
    RECORDS = "RECORDS"
    BATCHES = "BATCHES"


class SearcherMode(enum.Enum):
    WorkersAskChief = "WORKERS_ASK_CHIEF"
    # Determined's value, misspelling included: SearcherMode("CHEIF_ONLY") must find it.
    ChiefOnly = "CHEIF_ONLY"


class SearcherOperation:
    def __init__(self, ctx: SearcherContext, index: int, length: int, is_chief: bool) -> None:
        self._ctx = ctx
        self._index = index
        self._length = length
        self._is_chief = is_chief
        self._completed = False

    @property
    def length(self) -> int:
        return self._length

    def report_progress(self, length: float) -> None:
        if not self._is_chief:
            raise RuntimeError("you must only call op.report_progress() from the chief worker")
        if self._completed:
            raise RuntimeError("you must not call op.report_progress() after op.report_completed()")
        # Clamped: a script may overshoot the length (a last partial epoch) or report nonsense, and
        # progress outside 0..1 would break the experiment's progress column.
        frac = max(0.0, min(1.0, float(length) / self._length)) if self._length else 1.0
        self._ctx._writer.emit(Progress(progress=frac, raw=float(length)))

    def _complete(self) -> None:
        """report_completed's checks, the same on and off a cluster; the op counts as completed after."""
        if not self._is_chief:
            raise RuntimeError("you must only call op.report_completed() from the chief worker")
        if self._completed:
            raise RuntimeError("you may only call op.report_completed() once")
        self._completed = True

    def report_completed(self, searcher_metric: Any) -> None:
        self._complete()
        self._ctx._writer.emit(OpCompleted(index=self._index, length=self._length, metric=float(searcher_metric)))
        # Flushed at once: the searcher acts on a completed op (promote, stop), and a trial killed
        # right after must not lose the report.
        self._ctx._writer.flush()


class SearcherContext:
    def __init__(
        self,
        dist: DistributedContext,
        writer: Writer,
        ops_path: Path | None,
        units: Unit | None,
        should_stop: Callable[[], bool],
        on_out_of_ops: Callable[[], None],
    ) -> None:
        self._dist = dist
        self._writer = writer
        self._ops_path = ops_path
        self._units = units
        self._should_stop = should_stop
        self._on_out_of_ops = on_out_of_ops

    def _next(self, index: int) -> int | None:
        """The chief waits for operation ``index``; None once there is none (for now)."""
        if self._ops_path is None:
            # No ops file (off-cluster): one operation of length 1, so a 0.37-style loop runs once.
            return 1 if index == 0 else None
        while True:
            state = self._read_ops()
            if index < len(state.ops):
                return state.ops[index]
            # idle_after: the searcher has nothing for this trial now (e.g. ASHA has not promoted it);
            # ending here lets the trial ack and exit, freeing its allocation until it is promoted.
            if state.closed or state.idle_after >= index or self._should_stop():
                return None
            time.sleep(POLL_S)

    def _read_ops(self) -> SearcherOps:
        """The controller's ops file; absent or mid-replace reads as "nothing yet"."""
        assert self._ops_path is not None
        try:
            return SearcherOps.read(self._ops_path) or SearcherOps(ops=())
        # The file is the controller's, but lives in a dir the trial writes: a broken one is
        # treated as "nothing yet" and the controller rewrites it on its next tick.
        except BadRecord:
            return SearcherOps(ops=())

    def operations(
        self, searcher_mode: SearcherMode = SearcherMode.WorkersAskChief, auto_ack: bool = True
    ) -> Iterator[SearcherOperation]:
        chief = self._dist.rank == 0
        start = 0
        if self._ops_path is not None:
            # A resumed run starts after the ops it already completed, as Determined's master would.
            start = self._read_ops().completed
        index = start
        while True:
            length = self._next(index) if chief else None
            if searcher_mode == SearcherMode.WorkersAskChief:
                # Only the chief reads the file; the broadcast makes every rank see the same op and stop
                # together (a rank leaving the loop alone would hang the others' collectives).
                length = self._dist.broadcast(length)
            if length is None:
                break
            op = self._operation(index, length, chief)
            yield op
            if chief and not op._completed:
                raise RuntimeError(
                    "you must call op.report_completed() on each operation before requesting the next one"
                )
            index += 1
        if chief and auto_ack:
            # The ack tells the controller this exit is voluntary (out of work), not a crash to restart.
            self.acknowledge_out_of_ops()

    def _operation(self, index: int, length: int, is_chief: bool) -> SearcherOperation:
        return SearcherOperation(self, index, length, is_chief)

    def acknowledge_out_of_ops(self) -> None:
        self._on_out_of_ops()

    def get_configured_units(self) -> Unit | None:
        return self._units


class DummySearcherOperation(SearcherOperation):
    """An operation of the off-cluster twin: reports are checked as on a cluster, then logged."""

    def __init__(self, length: int, is_chief: bool) -> None:
        self._length = length
        self._is_chief = is_chief
        self._completed = False

    def report_progress(self, length: float) -> None:
        if not self._is_chief:
            raise RuntimeError("you must only call op.report_progress() from the chief worker")
        # The last progress report may repeat the full length after report_completed().
        if self._completed and length != self._length:
            raise RuntimeError("you must not call op.report_progress() after op.report_completed()")
        log.info("progress report: %s/%s", length, self._length)

    def report_completed(self, searcher_metric: Any) -> None:
        self._complete()
        log.info("searcher operation completed: searcher_metric=%s", searcher_metric)


class DummySearcherContext(SearcherContext):
    """Off-cluster twin, for unit tests and scripts run by hand: one operation of ``length``
    epochs, handed to every rank through the same broadcast as on a cluster."""

    def __init__(self, dist: DistributedContext, length: int = 1) -> None:
        super().__init__(dist, dropped_writer(), None, Unit.EPOCHS, lambda: False, lambda: None)
        self._length = length

    def _next(self, index: int) -> int | None:
        return self._length if index == 0 else None

    def _operation(self, index: int, length: int, is_chief: bool) -> SearcherOperation:
        return DummySearcherOperation(length, is_chief)


_MISSING = (
    "there is no searcher context: the experiment config has no searcher.max_length (both are "
    "deprecated); choose the training length in your script and call train.report_progress()"
)


class SearcherContextMissing(SearcherContext):
    """0.38 configs (no ``searcher.max_length``) have no operations to hand out."""

    def __init__(self) -> None:
        pass

    def operations(
        self, searcher_mode: SearcherMode = SearcherMode.WorkersAskChief, auto_ack: bool = True
    ) -> Iterator[SearcherOperation]:
        raise ValueError(_MISSING)

    def acknowledge_out_of_ops(self) -> None:
        raise ValueError(_MISSING)

    def get_configured_units(self) -> Unit | None:
        raise ValueError(_MISSING)


def deprecated_operations_warning() -> None:
    warnings.warn(
        "searcher operations are deprecated; choose the training length in your script", FutureWarning, stacklevel=3
    )
