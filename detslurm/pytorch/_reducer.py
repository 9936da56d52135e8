"""Metric reduction: per-batch metrics over all ranks' batches, and user MetricReducers.

Rank values cross process boundaries through DistributedContext collectives, which carry JSON
only (no pickles): a MetricReducer's ``per_slot_reduce()`` must return JSON-able values
(numbers, lists, dicts; numpy/torch values become lists)."""

from __future__ import annotations

import abc
import enum
import itertools
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from detslurm.core import DistributedContext


class Reducer(enum.Enum):
    # Determined's values, so Reducer(1) and stored numbers mean the same here.
    AVG = 1
    SUM = 2
    MAX = 3
    MIN = 4


class MetricReducer(abc.ABC):
    """A custom reduction: ``update`` it from evaluate_batch / train_batch yourself, then the
    Trainer calls reset() before, per_slot_reduce() on every rank and cross_slot_reduce() once."""

    @abc.abstractmethod
    def reset(self) -> None: ...

    @abc.abstractmethod
    def per_slot_reduce(self) -> Any: ...

    @abc.abstractmethod
    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any: ...


class _FunctionReducer(MetricReducer):
    """``wrap_reducer(fn)``: collects ``update(value)`` calls; ``fn`` sees all ranks' values."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self._fn = fn
        self._values: list[Any] = []

    def update(self, value: Any) -> None:
        # tolist(): tensors and numpy arrays become plain lists here, because the allgather
        # carries JSON only (see the module doc).
        self._values.append(value.tolist() if callable(getattr(value, "tolist", None)) else value)

    def reset(self) -> None:
        self._values = []

    def per_slot_reduce(self) -> Any:
        return self._values

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any:
        # Interleaved (rank 0's first value, rank 1's first, ..., rank 0's second...): with one
        # update() per batch that is the global batch order of the sharded data, so the user's
        # fn sees the values in the order one process would have produced them (as Determined's).
        rounds = itertools.zip_longest(*per_slot_metrics, fillvalue=_ABSENT)
        return self._fn([v for r in rounds for v in r if v is not _ABSENT])


_ABSENT = object()


class WrappedReducer:
    """One ``wrap_reducer`` registration: the reducer, its metric name, and when it reports."""

    def __init__(self, reducer: MetricReducer, name: Optional[str], for_training: bool, for_validation: bool) -> None:
        self.reducer, self.name = reducer, name
        self.for_training, self.for_validation = for_training, for_validation

    def metrics(self, value: Any) -> dict[str, Any]:
        """The metrics of this reducer's cross_slot_reduce() result ``value``."""
        r = self.reducer
        what = f"{r._fn.__name__}()" if isinstance(r, _FunctionReducer) else type(r).__name__
        if self.name is not None:
            if isinstance(value, dict):
                raise TypeError(
                    f"the reducer {what} was wrapped with name={self.name!r} but returned a dict: return one "
                    "metric, or wrap it without a name to return a dict of metrics"
                )
            return {self.name: scalar(value)}
        if not isinstance(value, dict):
            raise TypeError(
                f"the reducer {what} was wrapped without a name but returned {type(value).__name__}: return a "
                "dict of metrics, or wrap it with name= to return one metric"
            )
        return {str(k): scalar(v) for k, v in value.items()}


class ReducerContext:
    """``wrap_reducer`` and the reductions of what was wrapped, over the ranks of
    ``distributed``: the part of a trial context that custom metric reducers need (the PyTorch
    Trainer's context and the batch processor's share it, as in Determined)."""

    def __init__(self, distributed: DistributedContext) -> None:
        self.distributed = distributed
        self.reducers: list[WrappedReducer] = []

    def wrap_reducer(
        self,
        reducer: Union[Callable[[list[Any]], Any], MetricReducer],
        name: Optional[str] = None,
        for_training: bool = True,
        for_validation: bool = True,
    ) -> MetricReducer:
        """A custom metric reduction across batches and ranks, reported with the training
        metrics (``for_training``) and the validation metrics (``for_validation``). A plain
        function gets every value passed to ``update()`` on every rank, in batch order; with
        ``name`` its result is that one metric, without it a dict of metrics (a MetricReducer's
        cross_slot_reduce() likewise)."""
        if any(w.reducer is reducer for w in self.reducers):
            raise ValueError(f"wrap_reducer(): this {type(reducer).__name__} is already wrapped; wrap it once")
        if isinstance(reducer, MetricReducer):
            wrapped: MetricReducer = reducer
        elif callable(reducer):
            wrapped = _FunctionReducer(reducer)
        else:
            raise TypeError(
                f"wrap_reducer() takes a function or a det.pytorch.MetricReducer, not {type(reducer).__name__}"
            )
        self.reducers.append(WrappedReducer(wrapped, name, for_training, for_validation))
        return wrapped

    def reset_reducers(self) -> None:
        """reset() on every wrapped reducer (the Trainer does it before each training window and
        each validation)."""
        for w in self.reducers:
            w.reducer.reset()

    def reduce_metrics(self, for_training: bool) -> dict[str, Any]:
        """The metrics of the reducers wrapped for training (or for validation), reduced across
        all ranks. Collective: every rank calls it and gets the same metrics."""
        chosen = [w for w in self.reducers if (w.for_training if for_training else w.for_validation)]
        if not chosen:
            return {}
        gathered = self.distributed.allgather([w.reducer.per_slot_reduce() for w in chosen])
        return self.run_cross_slot_reduction(chosen, gathered)

    def run_cross_slot_reduction(self, reducables: list[WrappedReducer], gathered: list[Any]) -> dict[str, Any]:
        """``gathered`` holds one list per rank, one value per reducer of ``reducables``; each
        reducer's cross_slot_reduce() gets its values of all ranks."""
        metrics: dict[str, Any] = {}
        for i, w in enumerate(reducables):
            metrics.update(w.metrics(w.reducer.cross_slot_reduce([per_rank[i] for per_rank in gathered])))
        return metrics


def scalar(v: Any) -> Any:
    """A metric value as plain data: one number where it is one (tensors and numpy values of one
    element), else the nested list of its values. A per-sample loss stays per sample, as
    Determined keeps it (as a numpy array there; lists here, which cross the ranks' JSON
    collectives and the event file); reductions use all of its values."""
    if isinstance(v, torch.Tensor):
        v = v.detach()
        return v.item() if v.numel() == 1 else v.cpu().tolist()
    if callable(getattr(v, "item", None)) and getattr(v, "size", 2) == 1:
        return v.item()
    # A numpy array of several values (size counts them; a list's len would not be here).
    if callable(getattr(v, "tolist", None)) and isinstance(getattr(v, "size", None), int):
        return v.tolist()
    return v


def reduce_values(values: list[Any], how: Reducer) -> Any:
    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not nums:
        if (flat := _all_numbers(values)) is not None:
            # Lists of numbers (a vector metric): reduced over every value of every batch, as
            # Determined's numpy reductions of the stacked batches do.
            nums = flat
        else:
            # A metric that is never a number (a string) cannot be averaged: the latest value is
            # reported as it is.
            return values[-1] if values else None
    if how is Reducer.AVG:
        return sum(nums) / len(nums)
    if how is Reducer.SUM:
        return sum(nums)
    return max(nums) if how is Reducer.MAX else min(nums)


def _all_numbers(values: list[Any]) -> Optional[list[float]]:
    """Every number in ``values``, a list of (nested) lists of numbers; None if any is not."""
    out: list[float] = []
    todo = list(reversed(values))
    while todo:
        v = todo.pop()
        if isinstance(v, (list, tuple)):
            todo.extend(reversed(v))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(float(v))
        else:
            return None
    return out or None


def reduce_rows(
    rows: list[dict[str, Any]], how: Union[Reducer, dict[str, Reducer]], dist: DistributedContext
) -> dict[str, Any]:
    """Per-batch metric rows of every rank, reduced as if one process had seen all batches
    (AVG is the mean over all batches of all ranks, not a mean of per-rank means)."""
    # Every row of every rank goes to every rank, so the mean weighs each batch the same even
    # when ranks saw different numbers of batches (the last, short shard).
    everyone = dist.allgather(rows) if dist.size > 1 else [rows]
    merged = [r for rank_rows in everyone for r in rank_rows]
    keys = sorted(set().union(*(r.keys() for r in merged))) if merged else []
    out: dict[str, Any] = {}
    for k in keys:
        rule = how if isinstance(how, Reducer) else how.get(k, Reducer.AVG)
        out[k] = reduce_values([r[k] for r in merged if k in r], rule)
    return out
