"""Adaptive ASHA: brackets of asynchronous successive halving.

Two styles, as in Determined:
- 0.38 (``max_time`` + ``time_metric``): trials train on their own; each validation is placed
  in rungs and a trial that falls out of the top 1/divisor is stopped (early stopping).
- 0.37 (``max_length``): the searcher hands out ``ValidateAfter`` lengths and promotes the
  best trials of a rung to the next one (promotion).
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Callable
from typing import Any

from detslurm.searcher.base import (
    EXIT_INVALID_HP,
    Action,
    Close,
    Create,
    Idle,
    SearchMethod,
    Stop,
    ValidateAfter,
    metric_value,
)
from detslurm.searcher.hparams import sample

# Determined inserts MaxFloat64 for a trial that exited early: it ranks last in its rung, yet
# still counts towards the rung size that decides how many others continue.
WORST = sys.float_info.max


def max_rungs(max_rungs_cfg: int, max_time: int, max_trials: int, divisor: float) -> int:
    """Determined's rung cap: no more rungs than the time budget or the trial count can fill."""
    by_time = int(math.log(max_time) / math.log(divisor)) + 1
    by_trials = int(math.log(max_trials) / math.log(divisor)) + 1
    return min(max_rungs_cfg, by_time, by_trials)


def bracket_rungs(mode: str, n: int, explicit: list[int] | None = None) -> list[int]:
    """Rungs per bracket for a mode, most rungs (most aggressive bracket) first, as Determined orders them."""
    if explicit:
        rungs = list(explicit)
    elif mode == "aggressive":
        rungs = [n]
    elif mode == "standard":
        rungs = list(range((n - 1) // 2 + 1, n + 1))
    else:
        rungs = list(range(1, n + 1))
    return sorted(rungs, reverse=True)


def bracket_max_trials(max_trials: int, divisor: float, rungs: list[int]) -> list[int]:
    """Split max_trials over brackets by Determined's weights (divisor**(rungs-1)/rungs)."""
    weights = [divisor ** (r - 1) / r for r in rungs]
    total = sum(weights)
    split = [max(int(w / total * max_trials), 1) for w in weights]
    # Rounding leftovers go to the first (most aggressive) bracket, so the total is exactly max_trials.
    split[0] += max_trials - sum(split)
    return split


def bracket_max_concurrent(mct: int, divisor: float, trials: list[int]) -> list[int]:
    """Split max_concurrent_trials over brackets (0 = no limit), remainder to the first brackets."""
    n = len(trials)
    if mct == 0:
        return [max(trials[-1], int(divisor))] * n
    # Every bracket needs at least one running trial, or it would never start.
    mct = max(mct, n)
    out = [mct // n] * n
    for i in range(mct % n):
        out[i] += 1
    return out


def rung_units(num_rungs: int, max_time: int, divisor: float) -> list[int]:
    """The training length (in time_metric units, or max_length's) a trial must reach to enter
    each rung: max_time / divisor**k, the top rung at max_time itself. In the 0.37 style these
    are the lengths of the searcher ops, which count from the trial's start, so a promoted trial
    of the top rung trains exactly max_length. (Determined's code keeps cumulative sums and
    hands out their differences, which comes to the same absolute lengths.)"""
    return [max(int(max_time / divisor ** (num_rungs - 1 - i)), 1) for i in range(num_rungs)]


class _Bracket:
    """One successive-halving search; state is plain JSON."""

    def __init__(self, num_rungs: int, units: list[int], max_trials: int, max_concurrent: int, divisor: float) -> None:
        self.num_rungs = num_rungs
        self.units = units
        self.max_trials = max_trials
        self.max_concurrent = max_concurrent
        self.divisor = divisor
        # Pairs are lists, not tuples, so the state survives a JSON round trip through the store unchanged.
        self.rungs: list[list[list[Any]]] = [[] for _ in range(num_rungs)]  # [[metric, rid], ...]
        self.trial_rung: dict[str, int] = {}
        self.promoted: list[list[str]] = [[] for _ in range(num_rungs)]
        self.created = 0
        # Trials that exited with invalid hparams do not use up the budget (see under_budget).
        self.invalid = 0
        self.closed: list[str] = []

    def initial_count(self) -> int:
        if self.max_concurrent > 0:
            return min(self.max_concurrent, self.max_trials)
        # With no concurrency limit, start enough trials that halving R-1 times still leaves one at the top.
        return max(1, min(int(self.divisor ** (self.num_rungs - 1)), self.max_trials))

    def under_budget(self) -> bool:
        return self.created - self.invalid < self.max_trials

    def insert(self, rung: int, metric: float, rid: str) -> int:
        keys = [m for m, _ in self.rungs[rung]]
        # bisect_left puts a new metric before equal ones (Determined's tie rule); metrics are stored
        # sign-adjusted, so smaller is always better here.
        idx = bisect.bisect_left(keys, metric)
        self.rungs[rung].insert(idx, [metric, rid])
        return idx

    def remove_everywhere(self, rid: str) -> None:
        for rung in self.rungs:
            rung[:] = [e for e in rung if e[1] != rid]

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Bracket:
        # Bypasses __init__: the stored dict already holds every attribute it would compute.
        b = cls.__new__(cls)
        b.__dict__.update(d)
        return b


class AdaptiveASHA(SearchMethod):
    name = "adaptive_asha"

    def __init__(
        self,
        hparams: dict[str, Any],
        seed: int,
        *,
        metric: str,
        smaller_is_better: bool,
        max_trials: int,
        max_time: int,
        time_metric: str | None,
        divisor: float = 4,
        max_rungs_cfg: int = 5,
        mode: str = "standard",
        explicit_rungs: list[int] | None = None,
        max_concurrent: int = 16,
        promotion: bool = False,
    ) -> None:
        super().__init__(seed, metric)
        self.spec = hparams
        # Negate larger-is-better metrics once, so every rung sorts ascending.
        self.sign = 1.0 if smaller_is_better else -1.0
        self.time_metric = time_metric
        self.promotion = promotion
        self.max_trials = max_trials
        n = max_rungs(max_rungs_cfg, max_time, max_trials, divisor)
        rungs = bracket_rungs(mode, n, explicit_rungs)
        trials = bracket_max_trials(max_trials, divisor, rungs)
        mcts = bracket_max_concurrent(max_concurrent, divisor, trials)
        self.brackets = [
            _Bracket(r, rung_units(r, max_time, divisor), t, c, divisor)
            for r, t, c in zip(rungs, trials, mcts, strict=False)
        ]
        self.owner: dict[str, int] = {}

    def _create(self, b: int) -> Create:
        br = self.brackets[b]
        br.created += 1
        ops = (br.units[0],) if self.promotion else ()
        act = self.new_request(sample(self.spec, self.rng), ops)
        self.owner[act.request_id] = b
        br.trial_rung[act.request_id] = 0
        return act

    def initial_trials(self) -> list[Action]:
        return [self._create(b) for b, br in enumerate(self.brackets) for _ in range(br.initial_count())]

    # -- 0.38: early stopping --------------------------------------------------------------
    def on_validation(self, request_id: str, metrics: dict[str, Any], steps: int) -> list[Action]:
        if self.promotion or request_id not in self.owner:
            return []
        assert self.metric is not None
        value = self.sign * metric_value(metrics, self.metric, "searcher metric", "searcher.metric")
        assert self.time_metric is not None
        time = metric_value(metrics, self.time_metric, "time_metric", "searcher.time_metric")
        b = self.owner[request_id]
        br = self.brackets[b]
        actions: list[Action] = []
        r = br.trial_rung.get(request_id, 0)
        # One report can clear several rungs when validations are sparser than the rung spacing.
        while r < br.num_rungs and time >= br.units[r]:
            idx = br.insert(r, value, request_id)
            if r == br.num_rungs - 1:
                actions.append(Stop(request_id))
                break
            # Outside the top 1/divisor of what has arrived so far: stop (asynchronous halving judges
            # a rung before it is full; the best so far always continues).
            if idx >= max(int(len(br.rungs[r]) / br.divisor), 1):
                actions.append(Stop(request_id))
                break
            r += 1
            br.trial_rung[request_id] = r
        # Determined creates a new ASHA trial only when one is stopped (or exits early): that keeps the
        # bracket's concurrency constant.
        if actions and br.under_budget():
            actions.append(self._create(b))
        return actions

    # -- 0.37: promotion ------------------------------------------------------------------
    def on_op_completed(self, request_id: str, length: int, metric: float) -> list[Action]:
        if not self.promotion or request_id not in self.owner:
            return []
        b = self.owner[request_id]
        br = self.brackets[b]
        r = br.trial_rung.get(request_id, 0)
        value = self.sign * float(metric)
        if r == br.num_rungs - 1:
            br.insert(r, value, request_id)
            # Nothing to promote from the top rung: the budget goes to a new trial (else a
            # bracket whose other trials wait for promotion would stall).
            top: list[Action] = [Close(request_id)]
            if br.under_budget():
                top.append(self._create(b))
            return top + self._maybe_close_all(b)
        n = len(br.rungs[r])
        idx = br.insert(r, value, request_id)
        # 0.37 promotion: the new arrival may itself rank high enough, or the growing rung may make
        # room for the next waiting trial (the one at index n/divisor).
        num_promote = int((n + 1) / br.divisor)
        actions: list[Action] = []
        if idx < num_promote:
            actions += self._promote(b, r, request_id)
        else:
            actions.append(Idle(request_id))
            if num_promote > int(n / br.divisor):
                cand = br.rungs[r][int(n / br.divisor)][1]
                if cand not in br.promoted[r]:
                    actions += self._promote(b, r, cand)
        if not any(isinstance(a, ValidateAfter) for a in actions) and br.under_budget():
            actions.append(self._create(b))
        return actions + self._maybe_close_all(b)

    def _promote(self, b: int, r: int, rid: str) -> list[Action]:
        br = self.brackets[b]
        br.promoted[r].append(rid)
        br.trial_rung[rid] = r + 1
        return [ValidateAfter(rid, br.units[r + 1])]

    def _maybe_close_all(self, b: int) -> list[Action]:
        """Once every trial of a full bracket has reported, nobody else can be promoted."""
        br = self.brackets[b]
        if br.under_budget():
            return []
        reported = {rid for rung in br.rungs for _, rid in rung}
        mine = [rid for rid, owner in self.owner.items() if owner == b]
        waiting = [rid for rid in mine if rid not in reported and rid not in self.book.closed]
        if waiting:
            return []
        busy = {
            rid
            for r in range(br.num_rungs - 1)
            for rid in br.promoted[r]
            if br.trial_rung[rid] == r + 1 and not any(e[1] == rid for e in br.rungs[r + 1])
        }
        if busy:
            return []
        out: list[Action] = []
        for rid in mine:
            if rid not in br.closed:
                br.closed.append(rid)
                out.append(Close(rid))
        return out

    # -- exits ----------------------------------------------------------------------------
    def trial_exited_early(self, request_id: str, reason: str) -> list[Action]:
        super().trial_exited_early(request_id, reason)
        b = self.owner.get(request_id)
        if b is None:
            return []
        br = self.brackets[b]
        # Determined's rules: an invalid-hparams trial vanishes from every rung and does not count against
        # the budget; any other early exit stays in its rung as the worst result.
        if reason == EXIT_INVALID_HP:
            br.invalid += 1
            br.remove_everywhere(request_id)
        else:
            br.insert(min(br.trial_rung.get(request_id, 0), br.num_rungs - 1), WORST, request_id)
        return [self._create(b)] if br.under_budget() else []

    def progress(self, trial_work: Callable[[], float]) -> float:
        """Determined's estimate: rung-0 entries over 1.2 x max_trials, then completed trials once all are in."""
        parts = []
        for i, br in enumerate(self.brackets):
            # WORST marks a trial that exited early: placed in the rung, but it did not get there.
            p = sum(1 for m, _ in br.rungs[0] if m != WORST) / (1.2 * br.max_trials)
            if not br.under_budget():
                # Only this bracket's trials: counting every bracket's overstated the progress. A
                # trial that failed or was canceled did not do its part (a failed search is not 100%).
                unfinished = set(self.book.errored) | set(self.book.canceled)
                done = sum(
                    1 for rid, o in self.owner.items() if o == i and rid in self.book.closed and rid not in unfinished
                )
                p = max(p, (done - br.invalid) / br.max_trials)
            parts.append(min(1.0, p))
        return sum(parts) / len(parts) if parts else 0.0

    def method_state(self) -> dict[str, Any]:
        return {"brackets": [b.to_json() for b in self.brackets], "owner": self.owner}

    def load_method_state(self, state: dict[str, Any]) -> None:
        self.brackets = [_Bracket.from_json(b) for b in state["brackets"]]
        self.owner = dict(state["owner"])
