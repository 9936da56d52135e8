from __future__ import annotations

import json
from typing import Any

import pytest

from detslurm.expconf import validate
from detslurm.searcher import (
    AdaptiveASHA,
    Close,
    Create,
    GridSearch,
    Idle,
    RandomSearch,
    SearcherError,
    Shutdown,
    Stop,
    ValidateAfter,
    build,
)
from detslurm.searcher.asha import bracket_max_concurrent, bracket_max_trials, bracket_rungs, max_rungs, rung_units
from detslurm.searcher.hparams import go_round, grid, sample

HP = {"lr": {"type": "double", "minval": 0.0, "maxval": 1.0}}


@pytest.mark.parametrize(
    "args,expected", [((20, 3, [3, 2, 1]), [12, 5, 3]), ((50, 4, [3, 2]), [37, 13]), ((100, 4, [4, 3, 2]), [70, 22, 8])]
)
def test_bracket_trials(args: tuple, expected: list[int]) -> None:
    assert bracket_max_trials(*args) == expected


@pytest.mark.parametrize("args,expected", [((11, 3, [9, 3, 1]), [4, 4, 3]), ((0, 4, [40, 10]), [10, 10])])
def test_bracket_concurrency(args: tuple, expected: list[int]) -> None:
    assert bracket_max_concurrent(*args) == expected


def test_rungs() -> None:
    assert rung_units(3, 9, 3) == [1, 3, 9]
    assert rung_units(4, 10, 2) == [1, 2, 5, 10]


def test_make_brackets_vector() -> None:
    n = max_rungs(5, 100, 10, 4)
    rungs = bracket_rungs("standard", n)
    trials = bracket_max_trials(10, 4, rungs)
    assert (n, rungs, trials, bracket_max_concurrent(2, 4, trials)) == (2, [2, 1], [7, 3], [1, 1])
    assert bracket_rungs("aggressive", 4) == [4]
    assert bracket_rungs("conservative", 3) == [3, 2, 1]


def test_worked_example_creates_ten_trials_up_front() -> None:
    s = AdaptiveASHA(HP, 1, metric="loss", smaller_is_better=True, max_trials=10, max_time=100, time_metric="batches")
    assert [b.max_trials for b in s.brackets] == [7, 3]
    assert [b.max_concurrent for b in s.brackets] == [8, 8]
    assert [b.units for b in s.brackets] == [[25, 100], [100]]
    assert len([a for a in s.initial_trials() if isinstance(a, Create)]) == 10


def test_grid_order_and_rounding() -> None:
    g = grid(
        {
            "1": {"type": "int", "minval": 0, "maxval": 20, "count": 3},
            "2": {"type": "int", "minval": 0, "maxval": 10, "count": 3},
        }
    )
    assert [(d["1"], d["2"]) for d in g] == [
        (0, 0),
        (0, 5),
        (0, 10),
        (10, 0),
        (10, 5),
        (10, 10),
        (20, 0),
        (20, 5),
        (20, 10),
    ]
    assert grid({"x": {"type": "int", "minval": 1, "maxval": 2, "count": 1}}) == [{"x": 2}]  # round(1.5) away from 0
    assert grid({"x": {"type": "int", "minval": 0, "maxval": 2, "count": 10}}) == [{"x": 0}, {"x": 1}, {"x": 2}]
    assert grid({"x": {"type": "log", "minval": 0, "maxval": 2, "base": 10, "count": 3}}) == [
        {"x": 1.0},
        {"x": 10.0},
        {"x": 100.0},
    ]
    assert grid({"x": {"type": "double", "minval": 0, "maxval": 1, "count": 1}}) == [{"x": 0.5}]
    assert grid({"n": {"a": {"type": "categorical", "vals": [1, 2]}}, "c": {"type": "const", "val": 7}}) == [
        {"c": 7, "n": {"a": 1}},
        {"c": 7, "n": {"a": 2}},
    ]
    assert (go_round(2.5), go_round(-2.5), go_round(1.4)) == (3, -3, 1)


def test_grid_takes_from_the_end_and_refills() -> None:
    g = GridSearch({"x": {"type": "categorical", "vals": [1, 2, 3]}}, seed=0, max_concurrent=2)
    first = g.initial_trials()
    assert [a.hparams for a in first] == [{"x": 3}, {"x": 2}]
    more = g.trial_exited(first[0].request_id)
    assert [a.hparams for a in more if isinstance(a, Create)] == [{"x": 1}]
    assert g.trial_exited(first[1].request_id) == []
    assert g.trial_exited(more[0].request_id) == [Shutdown()]


def test_random_search_replaces_invalid_hp_and_shuts_down() -> None:
    r = RandomSearch(HP, seed=3, max_trials=3, max_concurrent=2)
    a, b = r.initial_trials()
    r.trial_exited_early(a.request_id, "INVALID_HP")
    c = r.trial_exited(a.request_id)
    assert len(c) == 1 and isinstance(c[0], Create)  # the invalid trial is replaced
    d = r.trial_exited(b.request_id)
    assert len(d) == 1 and isinstance(d[0], Create)
    assert r.trial_exited(c[0].request_id) == []
    assert r.trial_exited(d[0].request_id) == [Shutdown(cancel=False, failure=False)]


def test_failure_when_every_trial_errors() -> None:
    r = RandomSearch(HP, seed=3, max_trials=1, max_concurrent=1)
    (a,) = r.initial_trials()
    r.trial_exited_early(a.request_id, "ERRORED")
    assert r.trial_exited(a.request_id) == [Shutdown(cancel=False, failure=True)]


def test_sampling_is_seeded_and_sorted() -> None:
    import random

    spec = {
        "b": {"type": "int", "minval": 1, "maxval": 3},
        "a": {"type": "log", "minval": -2, "maxval": -1, "base": 10},
        "c": {"type": "categorical", "vals": ["x", "y"]},
        "n": {"k": {"type": "const", "val": 1}},
    }
    one, two = sample(spec, random.Random(5)), sample(spec, random.Random(5))
    assert one == two and list(one) == ["a", "b", "c", "n"]
    assert 0.01 <= one["a"] <= 0.1 and one["b"] in (1, 2, 3) and one["n"] == {"k": 1}


def asha(**kw: Any) -> AdaptiveASHA:
    base: dict[str, Any] = dict(
        metric="loss",
        smaller_is_better=True,
        max_trials=4,
        max_time=16,
        time_metric="batches",
        divisor=2,
        max_rungs_cfg=3,
        mode="aggressive",
        max_concurrent=4,
    )
    base.update(kw)
    return AdaptiveASHA(HP, 7, **base)


def test_asha_early_stops_worse_trials() -> None:
    s = asha()
    br = s.brackets[0]
    assert br.units == [4, 8, 16] and br.max_trials == 4
    ids = [a.request_id for a in s.initial_trials()]
    assert len(ids) == 4
    assert s.validation_completed(ids[0], {"loss": 1.0, "batches": 4}, 4) == []  # first in rung 0 continues
    out = s.validation_completed(ids[1], {"loss": 2.0, "batches": 4}, 4)
    assert out == [Stop(ids[1])]  # worse half of rung 0: stopped; budget used up, no new trial
    assert s.validation_completed(ids[2], {"loss": 0.5, "batches": 8}, 8) == []  # clears rungs 0 and 1
    assert s.validation_completed(ids[0], {"loss": 0.9, "batches": 16}, 16) == [Stop(ids[0])]  # rung 1: worse
    assert s.validation_completed(ids[2], {"loss": 0.4, "batches": 16}, 16) == [Stop(ids[2])]  # top rung: done
    for rid in ids:
        s.trial_exited(rid)
    assert s.book.shut_down


def test_asha_stop_creates_replacement_under_budget() -> None:
    s = asha(max_trials=6, max_concurrent=2)
    ids = [a.request_id for a in s.initial_trials()]
    assert len(ids) == 2
    s.validation_completed(ids[0], {"loss": 1.0, "batches": 4}, 4)
    out = s.validation_completed(ids[1], {"loss": 3.0, "batches": 4}, 4)
    assert out[0] == Stop(ids[1]) and isinstance(out[1], Create)


def test_asha_maximize_and_missing_metric() -> None:
    s = asha(smaller_is_better=False)
    ids = [a.request_id for a in s.initial_trials()]
    s.validation_completed(ids[0], {"loss": 1.0, "batches": 4}, 4)
    assert s.validation_completed(ids[1], {"loss": 2.0, "batches": 4}, 4) == []  # bigger is better now
    with pytest.raises(SearcherError, match="searcher metric 'loss' is missing"):
        s.validation_completed(ids[2], {"acc": 1.0, "batches": 4}, 4)
    # A failed search takes no more reports (the experiment is erroring): no second error.
    assert s.validation_completed(ids[2], {"loss": 1.0}, 4) == []
    s = asha()
    with pytest.raises(SearcherError, match="time_metric 'batches' is missing"):
        s.validation_completed(s.initial_trials()[0].request_id, {"loss": 1.0}, 4)


def test_asha_promotion_037() -> None:
    s = asha(max_trials=4, max_concurrent=4, promotion=True, time_metric=None)
    br = s.brackets[0]
    assert br.units == [4, 8, 16]  # op lengths count from the trial's start
    creates = s.initial_trials()
    assert all(c.ops == (4,) for c in creates)
    ids = [c.request_id for c in creates]
    assert s.op_completed(ids[0], 4, 1.0) == [Idle(ids[0])]  # numPromote int(1/2)=0
    out = s.op_completed(ids[1], 4, 0.5)  # numPromote 1: the new best is promoted
    assert out == [ValidateAfter(ids[1], 8)]
    out = s.op_completed(ids[2], 4, 2.0)
    assert out == [Idle(ids[2])]
    out = s.op_completed(ids[3], 4, 3.0)  # numPromote grows to 2: index 1 (ids[0]) promoted
    assert ValidateAfter(ids[0], 8) in out and Idle(ids[3]) in out
    assert s.op_completed(ids[1], 8, 0.4) == [Idle(ids[1])]
    out = s.op_completed(ids[0], 8, 0.3)
    assert ValidateAfter(ids[0], 16) in out
    out = s.op_completed(ids[0], 16, 0.2)
    assert Close(ids[0]) in out
    assert {a.request_id for a in out if isinstance(a, Close)} == set(ids)  # nothing left to promote


@pytest.mark.parametrize("max_length,divisor,max_trials", [(200, 4, 8), (3000, 4, 16), (100, 3, 27), (1000, 2, 5)])
def test_asha_037_top_rung_trains_max_length(max_length: int, divisor: float, max_trials: int) -> None:
    """Determined's rungs (0.37, searcher ops): rung k at max_length / divisor**(top-k), the
    top rung at max_length itself, and op lengths count from the trial's start; a promoted trial
    once trained 50 + 200 = 250 batches against max_length 200."""
    for mode in ("aggressive", "standard", "conservative"):
        s = asha(
            max_time=max_length, divisor=divisor, max_trials=max_trials, promotion=True, time_metric=None, mode=mode
        )
        for br in s.brackets:
            assert br.units == [max(int(max_length / divisor**k), 1) for k in reversed(range(br.num_rungs))]
            assert br.units[-1] == max_length
    # Driven to the end: no op is ever longer than max_length, and the best trial reaches it.
    s = asha(max_time=200, divisor=4, max_trials=8, max_rungs_cfg=2, promotion=True, time_metric=None)
    lengths: dict[str, list[int]] = {c.request_id: list(c.ops) for c in s.initial_trials()}
    best = next(iter(lengths))
    for rid in list(lengths):
        for a in s.op_completed(rid, lengths[rid][-1], 0.0 if rid == best else 1.0):
            if isinstance(a, ValidateAfter):
                lengths[a.request_id].append(a.length)
    assert lengths[best] == [50, 200] and max(x for ops in lengths.values() for x in ops) == 200


def test_state_round_trip_gives_same_decisions() -> None:
    cfg = {
        "searcher": {
            "name": "adaptive_asha",
            "metric": "loss",
            "smaller_is_better": True,
            "max_trials": 8,
            "max_time": 16,
            "time_metric": "batches",
            "divisor": 2.0,
            "max_rungs": 3,
            "mode": "standard",
            "bracket_rungs": [],
            "max_concurrent_trials": 3,
            "max_length": None,
        },
        "hyperparameters": HP,
        "reproducibility": {"experiment_seed": 11},
        "entrypoint": "x",
    }
    typed = validate(cfg, {"type": "shared_fs", "host_path": "/tmp"})
    a = build(typed)
    ids = [x.request_id for x in a.initial_trials()]
    a.validation_completed(ids[0], {"loss": 1.0, "batches": 4}, 4)
    b = build(typed)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for s in (a, b):
        s.validation_completed(ids[1], {"loss": 5.0, "batches": 4}, 4)
    nxt_a = a.validation_completed(ids[2], {"loss": 9.0, "batches": 8}, 8)
    nxt_b = b.validation_completed(ids[2], {"loss": 9.0, "batches": 8}, 8)
    assert nxt_a == nxt_b and a.state_dict() == b.state_dict()


def _simulate(searcher: Any, promotion: bool, seed: int, max_events: int = 5000) -> int:
    """Drive a whole search like a controller would, with random metrics; return trials made."""
    import random as _random

    rng = _random.Random(seed)
    ops: dict[str, list[int]] = {}
    done: dict[str, int] = {}
    closed_ops: set[str] = set()
    live: list[str] = []

    def apply(actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Create):
                ops[a.request_id] = list(a.ops)
                done[a.request_id] = 0
                live.append(a.request_id)
            elif isinstance(a, ValidateAfter):
                ops[a.request_id].append(a.length)
            elif isinstance(a, Close):
                closed_ops.add(a.request_id)
            elif isinstance(a, Stop) and a.request_id in live:
                live.remove(a.request_id)
                apply(searcher.trial_exited(a.request_id))

    apply(searcher.initial_trials())
    for _ in range(max_events):
        if searcher.book.shut_down:
            return len(ops)
        if promotion:
            runnable = [r for r in live if done[r] < len(ops[r])]
            finished = [r for r in live if r in closed_ops and done[r] >= len(ops[r])]
            for r in finished:
                live.remove(r)
                apply(searcher.trial_exited(r))
            if not runnable:
                continue
            r = rng.choice(runnable)
            length = ops[r][done[r]]
            done[r] += 1
            apply(searcher.op_completed(r, length, rng.random()))
        else:
            if not live:
                break
            r = rng.choice(live)
            done[r] += 1
            apply(searcher.validation_completed(r, {"loss": rng.random(), "batches": done[r]}, done[r]))
            if r in live and done[r] >= 16:
                live.remove(r)
                apply(searcher.trial_exited(r))
    raise AssertionError(f"the search did not finish: {len(ops)} trials, live={live}")


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("promotion", [True, False])
def test_whole_searches_terminate(seed: int, promotion: bool) -> None:
    s = asha(
        max_trials=6 + seed % 5,
        max_concurrent=1 + seed % 3,
        mode=["aggressive", "standard", "conservative"][seed % 3],
        promotion=promotion,
        time_metric=None if promotion else "batches",
    )
    made = _simulate(s, promotion, seed)
    assert made == s.max_trials  # the whole budget is used, and the search ends
