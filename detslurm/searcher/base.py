"""Searcher framework: actions, bookkeeping shared by every method, persistable state.

Searchers are pure: they take events (trial created, validation reported, trial exited) and
return actions. The controller persists ``state_dict()`` in the same transaction as the
metrics that produced it, so a killed controller never feeds an event twice or loses one.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

from detslurm.errors import DetSlurmError


class SearcherError(DetSlurmError):
    """The search cannot go on (e.g. the searcher metric is missing from a validation)."""


@dataclass(frozen=True)
class Create:
    """Start a new trial; request_id is its identity across controller restarts."""

    request_id: str
    seed: int
    hparams: dict[str, Any]
    ops: tuple[int, ...] = ()  # 0.37 style: the first ValidateAfter target(s)


@dataclass(frozen=True)
class Stop:
    """Stop a trial early (ASHA); the controller marks it early-stopped (controller/apply.py)."""

    request_id: str


@dataclass(frozen=True)
class ValidateAfter:
    """0.37 style: train until this absolute length, then report via op.report_completed."""

    request_id: str
    length: int


@dataclass(frozen=True)
class Close:
    """0.37 style: no more operations for this trial."""

    request_id: str


@dataclass(frozen=True)
class Idle:
    """0.37 style: no operation for now; the trial may exit and be resumed on promotion."""

    request_id: str


@dataclass(frozen=True)
class Shutdown:
    """The search is over: cancel if every trial was canceled, failure if every trial errored."""

    cancel: bool = False
    failure: bool = False


Action = Union[Create, Stop, ValidateAfter, Close, Idle, Shutdown]

# Determined's early-exit reasons; the searcher treats them differently (an invalid-hparams trial
# is replaced, a canceled or errored one counts towards Shutdown's cancel/failure).
EXIT_INVALID_HP = "INVALID_HP"
EXIT_USER_CANCELED = "USER_CANCELED"
EXIT_ERRORED = "ERRORED"


@dataclass
class Book:
    """What every searcher tracks about its trials."""

    requested: list[str] = field(default_factory=list)
    # Lists, not sets: the book goes into state_dict() as JSON, and order keeps replays identical.
    closed: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    errored: list[str] = field(default_factory=list)
    canceled: list[str] = field(default_factory=list)
    shut_down: bool = False
    # Why the search failed (a SearcherError), or "": a failed search takes no more reports, so
    # the experiment's remaining events are read without failing it again for each of them.
    failed: str = ""


class SearchMethod:
    """Base class. Subclasses implement the hooks and keep their state in plain JSON types."""

    name = "base"

    def __init__(self, seed: int, metric: str | None = None) -> None:
        self.rng = random.Random(seed)
        self.book = Book()
        # searcher.metric: every validation must carry it, whatever the method (see validation_completed).
        self.metric = metric

    # -- helpers -------------------------------------------------------------------------
    def new_request(self, hparams: dict[str, Any], ops: tuple[int, ...] = ()) -> Create:
        # Drawn from the seeded RNG after the hparams, in Determined's order (hparams, request id, trial
        # seed), so one experiment seed reproduces the whole search.
        rid = f"{self.rng.getrandbits(64):016x}"
        seed = self.rng.randrange(2**31)
        self.book.requested.append(rid)
        return Create(request_id=rid, seed=seed, hparams=hparams, ops=ops)

    def maybe_shutdown(self) -> list[Action]:
        b = self.book
        # Determined shuts down when every requested trial is closed and the method wants no more;
        # shut_down makes it fire once even if a duplicate exit event arrives.
        if b.shut_down or not b.requested or len(set(b.closed)) < len(b.requested) or self.wants_more():
            return []
        b.shut_down = True
        failure = len(b.errored) >= len(b.requested)
        cancel = len(b.canceled) == len(b.requested)
        return [Shutdown(cancel=cancel, failure=failure)]

    def wants_more(self) -> bool:
        """Whether the method will still create trials (holds Shutdown back while true)."""
        return False

    # -- events --------------------------------------------------------------------------
    def initial_trials(self) -> list[Action]:
        """The actions for a new experiment: the first trials to create."""
        raise NotImplementedError

    def validation_completed(self, request_id: str, metrics: dict[str, Any], steps: int) -> list[Action]:
        """A trial reported validation metrics; ``steps`` is its training length so far.

        A validation without the searcher metric is a SearcherError for every method and style,
        not only for the ones that rank trials by it (0.38 ASHA): the best checkpoint, the trial's
        best metric and ``det e lc --best`` all read it, and a misspelt ``searcher.metric`` would
        otherwise pass silently. Determined's Trainer and Trial API fail the same way."""
        if self.book.failed:
            return []
        try:
            if self.metric is not None:
                metric_value(metrics, self.metric, "searcher metric", "searcher.metric")
            return self.on_validation(request_id, metrics, steps)
        except SearcherError as e:
            self.book.failed = str(e)
            raise

    def on_validation(self, request_id: str, metrics: dict[str, Any], steps: int) -> list[Action]:
        """The method's reaction to a validation that carries the searcher metric."""
        return []

    def op_completed(self, request_id: str, length: int, metric: float) -> list[Action]:
        """0.37 style: a trial finished a ValidateAfter operation with this searcher metric."""
        return [] if self.book.failed else self.on_op_completed(request_id, length, metric)

    def on_op_completed(self, request_id: str, length: int, metric: float) -> list[Action]:
        """The method's reaction to a completed operation (0.37 ASHA promotes on it)."""
        return []

    def trial_exited_early(self, request_id: str, reason: str) -> list[Action]:
        """Record why a trial stopped before its search said so; its exit follows separately."""
        if reason == EXIT_INVALID_HP:
            self.book.invalid.append(request_id)
        elif reason == EXIT_USER_CANCELED:
            self.book.canceled.append(request_id)
        else:
            self.book.errored.append(request_id)
        return []

    def trial_exited(self, request_id: str) -> list[Action]:
        """A trial's job ended for good; may create a replacement or shut the search down."""
        if request_id not in self.book.closed:
            self.book.closed.append(request_id)
        return self.maybe_shutdown()

    def progress(self, trial_work: Callable[[], float]) -> float:
        """The experiment's progress in [0, 1], shown by ``det experiment list``.

        ``trial_work()`` is the trials' work so far, counted in trials: 1 for each trial that
        completed, its last reported progress for any other (running, paused, failed, canceled).
        Determined counts every closed trial as 1; here a failed trial counts only what it did,
        so a search whose trials all failed does not read 100%. It is a query: methods that do
        not need it (ASHA ranks by rungs) do not call it."""
        return 0.0

    # -- persistence ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the search, in plain JSON types (stored with each event batch)."""
        # The Mersenne Twister state is a tuple holding a 625-int tuple; lists make it JSON for the store,
        # and restoring it lets a restarted controller continue the exact same random sequence.
        st = self.rng.getstate()
        return {
            "name": self.name,
            "rng": [st[0], list(st[1]), st[2]],
            "book": self.book.__dict__.copy(),
            "method": self.method_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""
        r = state["rng"]
        self.rng.setstate((r[0], tuple(r[1]), r[2]))
        self.book = Book(**state["book"])
        self.load_method_state(state["method"])

    def method_state(self) -> dict[str, Any]:
        return {}

    def load_method_state(self, state: dict[str, Any]) -> None:
        pass


def metric_value(metrics: dict[str, Any], key: str, what: str, setting: str) -> float:
    """The named metric as a float, or a SearcherError saying which metrics were reported and
    which config ``setting`` names it."""
    if key not in metrics:
        raise SearcherError(
            f"{what} {key!r} is missing from the reported validation metrics "
            f"(got: {', '.join(sorted(map(str, metrics))) or 'none'}); {setting} in the experiment config "
            "must name a metric that every validation report carries"
        )
    try:
        return float(metrics[key])
    except (TypeError, ValueError):
        raise SearcherError(f"{what} {key!r} must be a number, got {metrics[key]!r}") from None
