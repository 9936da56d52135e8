"""Searcher framework: actions, bookkeeping shared by every method, persistable state.

Searchers are pure: they take events (trial created, validation reported, trial exited) and
return actions. The controller persists ``state_dict()`` in the same transaction as the
metrics that produced it, so a killed controller never feeds an event twice or loses one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Union

from detslurm.errors import DetSlurmError


class SearcherError(DetSlurmError):
    """The search cannot go on (e.g. the searcher metric is missing from a validation)."""


@dataclass(frozen=True)
class Create:
    request_id: str
    seed: int
    hparams: dict[str, Any]
    ops: tuple[int, ...] = ()  # 0.37 style: the first ValidateAfter target(s)


@dataclass(frozen=True)
class Stop:
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
    cancel: bool = False
    failure: bool = False


Action = Union[Create, Stop, ValidateAfter, Close, Idle, Shutdown]

EXIT_INVALID_HP = "INVALID_HP"
EXIT_USER_CANCELED = "USER_CANCELED"
EXIT_ERRORED = "ERRORED"


@dataclass
class Book:
    """What every searcher tracks about its trials."""

    requested: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    errored: list[str] = field(default_factory=list)
    canceled: list[str] = field(default_factory=list)
    shut_down: bool = False


class SearchMethod:
    """Base class. Subclasses implement the hooks and keep their state in plain JSON types."""

    name = "base"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.book = Book()

    # -- helpers -------------------------------------------------------------------------
    def new_request(self, hparams: dict[str, Any], ops: tuple[int, ...] = ()) -> Create:
        rid = f"{self.rng.getrandbits(64):016x}"
        seed = self.rng.randrange(2**31)
        self.book.requested.append(rid)
        return Create(request_id=rid, seed=seed, hparams=hparams, ops=ops)

    def maybe_shutdown(self) -> list[Action]:
        b = self.book
        if b.shut_down or not b.requested or len(set(b.closed)) < len(b.requested) or self.wants_more():
            return []
        b.shut_down = True
        failure = len(b.errored) >= len(b.requested)
        cancel = len(b.canceled) == len(b.requested)
        return [Shutdown(cancel=cancel, failure=failure)]

    def wants_more(self) -> bool:
        return False

    # -- events --------------------------------------------------------------------------
    def initial_trials(self) -> list[Action]:
        raise NotImplementedError

    def validation_completed(self, request_id: str, metrics: dict[str, Any], steps: int) -> list[Action]:
        return []

    def op_completed(self, request_id: str, length: int, metric: float) -> list[Action]:
        return []

    def trial_exited_early(self, request_id: str, reason: str) -> list[Action]:
        if reason == EXIT_INVALID_HP:
            self.book.invalid.append(request_id)
        elif reason == EXIT_USER_CANCELED:
            self.book.canceled.append(request_id)
        else:
            self.book.errored.append(request_id)
        return []

    def trial_exited(self, request_id: str) -> list[Action]:
        if request_id not in self.book.closed:
            self.book.closed.append(request_id)
        return self.maybe_shutdown()

    def progress(self) -> float:
        return 0.0

    # -- persistence ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        st = self.rng.getstate()
        return {
            "name": self.name,
            "rng": [st[0], list(st[1]), st[2]],
            "book": self.book.__dict__.copy(),
            "method": self.method_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        r = state["rng"]
        self.rng.setstate((r[0], tuple(r[1]), r[2]))
        self.book = Book(**state["book"])
        self.load_method_state(state["method"])

    def method_state(self) -> dict[str, Any]:
        return {}

    def load_method_state(self, state: dict[str, Any]) -> None:
        pass


def metric_value(metrics: dict[str, Any], key: str, what: str) -> float:
    if key not in metrics:
        raise SearcherError(
            f"{what} {key!r} is missing from the reported validation metrics "
            f"(got: {', '.join(sorted(metrics)) or 'none'})"
        )
    try:
        return float(metrics[key])
    except (TypeError, ValueError):
        raise SearcherError(f"{what} {key!r} must be a number, got {metrics[key]!r}") from None
