"""single, random and grid search."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from detslurm.searcher.base import EXIT_INVALID_HP, Action, SearchMethod
from detslurm.searcher.hparams import grid, sample


class RandomSearch(SearchMethod):
    """Determined's random search; ``single`` is this with one trial and one at a time."""

    name = "random"

    def __init__(
        self,
        hparams: dict[str, Any],
        seed: int,
        max_trials: int,
        max_concurrent: int,
        ops: tuple[int, ...] = (),
        metric: str | None = None,
    ) -> None:
        super().__init__(seed, metric)
        self.spec = hparams
        self.max_trials = max_trials
        self.max_concurrent = max_concurrent
        self.ops = ops
        self.created = 0

    def _create(self) -> Action:
        self.created += 1
        return self.new_request(sample(self.spec, self.rng), self.ops)

    def initial_trials(self) -> list[Action]:
        # max_concurrent_trials 0 means no limit, as in Determined.
        n = self.max_trials if self.max_concurrent == 0 else min(self.max_trials, self.max_concurrent)
        return [self._create() for _ in range(n)]

    def trial_exited_early(self, request_id: str, reason: str) -> list[Action]:
        super().trial_exited_early(request_id, reason)
        if reason == EXIT_INVALID_HP:
            self.created -= 1  # replaced when the trial exits
        return []

    def trial_exited(self, request_id: str) -> list[Action]:
        # An exit reported twice must not create a second replacement.
        if request_id in self.book.closed:
            return []
        self.book.closed.append(request_id)
        actions: list[Action] = []
        # A repeated exit returned above, so each exit creates at most one trial: that keeps at most
        # max_concurrent trials alive without tracking which are running.
        if self.created < self.max_trials:
            actions.append(self._create())
        return actions + self.maybe_shutdown()

    def wants_more(self) -> bool:
        return self.created < self.max_trials

    def progress(self, trial_work: Callable[[], float]) -> float:
        # Trials replaced for invalid hyperparameters completed, but did none of the search's work.
        return _fraction(trial_work() - len(set(self.book.invalid)), self.max_trials)

    def method_state(self) -> dict[str, Any]:
        return {"created": self.created}

    def load_method_state(self, state: dict[str, Any]) -> None:
        self.created = state["created"]


class GridSearch(SearchMethod):
    """Determined's grid search: one trial per grid point, at most max_concurrent at a time."""

    name = "grid"

    def __init__(
        self,
        hparams: dict[str, Any],
        seed: int,
        max_concurrent: int,
        ops: tuple[int, ...] = (),
        metric: str | None = None,
    ) -> None:
        super().__init__(seed, metric)
        # Trials are taken from the end of the grid, as Determined does.
        self.remaining = grid(hparams)
        self.total = len(self.remaining)
        self.max_concurrent = max_concurrent
        self.ops = ops

    def _create(self) -> Action:
        return self.new_request(self.remaining.pop(), self.ops)

    def initial_trials(self) -> list[Action]:
        # 0 means no limit, as in Determined.
        n = len(self.remaining) if self.max_concurrent == 0 else min(len(self.remaining), self.max_concurrent)
        return [self._create() for _ in range(n)]

    def trial_exited(self, request_id: str) -> list[Action]:
        # An exit reported twice must not create a second replacement.
        if request_id in self.book.closed:
            return []
        self.book.closed.append(request_id)
        actions: list[Action] = [self._create()] if self.remaining else []
        return actions + self.maybe_shutdown()

    def wants_more(self) -> bool:
        return bool(self.remaining)

    def progress(self, trial_work: Callable[[], float]) -> float:
        return _fraction(trial_work(), self.total)

    def method_state(self) -> dict[str, Any]:
        # The unvisited points themselves are stored (not an index), so a resumed search does not depend
        # on recomputing the same grid.
        return {"remaining": self.remaining, "total": self.total}

    def load_method_state(self, state: dict[str, Any]) -> None:
        self.remaining = state["remaining"]
        self.total = state["total"]


def _fraction(work: float, of: int) -> float:
    return min(1.0, max(0.0, work / max(1, of)))
