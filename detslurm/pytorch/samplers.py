"""Building blocks for a torch DataLoader that shards, repeats, shuffles and resumes as the
Trainer's own det.pytorch.DataLoader does (Determined's ``det.pytorch.samplers``).

Chain them in this order: shuffle, then repeat, then shard, then batch, then skip. A shuffle
after a repeat would never end; a skip before a shuffle would change the order on resume.
Typical training loader::

    sampler = ReproducibleShuffleSampler(SequentialSampler(dataset), context.get_trial_seed())
    sampler = DistributedSampler(RepeatSampler(sampler), num_workers=size, rank=rank)
    batches = SkipBatchSampler(BatchSampler(sampler, batch_size, drop_last=False),
                               context.get_initial_batch())
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, Sampler


def _length(inner: Any) -> int:
    if not isinstance(inner, Sized):
        raise TypeError(f"{type(inner).__name__} has no length")
    return len(inner)


def _every_nth(inner: Any, n: int, offset: int) -> Iterator[Any]:
    if n == 1:
        yield from inner
        return
    for i, item in enumerate(inner):
        if i % n == offset:
            yield item


def _after(inner: Any, skip: int) -> Iterator[Any]:
    iterator = iter(inner)
    for _ in range(skip):
        if next(iterator, _END) is _END:
            return
    yield from iterator


_END = object()


def _shard_length(total: int, num_workers: int, rank: int) -> int:
    """Items of ``total`` that rank gets when item i goes to rank i % num_workers."""
    return total // num_workers + int(total % num_workers > rank)


class RepeatSampler(Sampler):  # type: ignore[type-arg]
    """The indices of ``sampler``, again and again without end; len() is one pass."""

    def __init__(self, sampler: Sampler) -> None:  # type: ignore[type-arg]
        self._sampler = sampler

    def __len__(self) -> int:
        return _length(self._sampler)

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield from self._sampler


class RepeatBatchSampler(BatchSampler):
    """The batches of ``batch_sampler``, again and again without end; len() is one pass."""

    def __init__(self, batch_sampler: BatchSampler) -> None:
        # BatchSampler.__init__ is not called: this wraps a batch sampler instead of a sampler.
        self.batch_sampler = batch_sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield from self.batch_sampler


class DistributedSampler(Sampler):  # type: ignore[type-arg]
    """This rank's share of ``sampler``: item i goes to rank ``i % num_workers``. Unlike torch's
    DistributedSampler it neither shuffles nor pads: it is one link of a chain, and the sampler
    it wraps may be endless (a RepeatSampler)."""

    def __init__(self, sampler: Sampler, num_workers: int, rank: int) -> None:  # type: ignore[type-arg]
        self._sampler = sampler
        self._num_workers = num_workers
        self._rank = rank

    def __len__(self) -> int:
        return _shard_length(_length(self._sampler), self._num_workers, self._rank)

    def __iter__(self) -> Iterator[Any]:
        return _every_nth(self._sampler, self._num_workers, self._rank)


class DistributedBatchSampler(BatchSampler):
    """This rank's share of the batches of ``batch_sampler``: batch i goes to rank
    ``i % num_workers``. Without a repeat underneath, ranks may get different numbers of batches
    when the count does not divide; the Trainer's training data always repeats."""

    def __init__(self, batch_sampler: BatchSampler, num_workers: int, rank: int) -> None:
        if num_workers < 1:
            raise ValueError(f"DistributedBatchSampler: num_workers must be at least 1 (got {num_workers})")
        if not 0 <= rank < num_workers:
            raise ValueError(f"DistributedBatchSampler: rank must be in [0, {num_workers}) (got {rank})")
        self.batch_sampler = batch_sampler
        self.num_workers = num_workers
        self.rank = rank

    def __len__(self) -> int:
        return _shard_length(len(self.batch_sampler), self.num_workers, self.rank)

    def __iter__(self) -> Iterator[Any]:
        return _every_nth(self.batch_sampler, self.num_workers, self.rank)


class SkipSampler(BatchSampler):
    """``sampler`` without its first ``skip`` items. len() stays the wrapped one's (the skip
    applies once, to a repeating sampler). Prefer SkipBatchSampler: Determined counts batches,
    and only whole batches resume exactly when batch sizes vary."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self._sampler = sampler
        self._skip = skip

    def __len__(self) -> int:
        return _length(self._sampler)

    def __iter__(self) -> Iterator[Any]:
        return _after(self._sampler, self._skip)


class SkipBatchSampler(BatchSampler):
    """``batch_sampler`` without its first ``skip`` batches (``context.get_initial_batch()``
    when resuming). len() stays the wrapped one's: the skip applies once, to repeating data."""

    def __init__(self, batch_sampler: BatchSampler, skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip
        self.length = len(batch_sampler)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        return _after(self.batch_sampler, self.skip)


class ReproducibleShuffleSampler(Sampler):  # type: ignore[type-arg]
    """The indices of ``sampler`` in an order drawn from ``seed``: each pass draws the next
    permutation from one numpy RandomState, so the same seed gives the same sequence of epochs
    (Determined's: the same seed gives the same data order under either)."""

    def __init__(self, sampler: Sampler, seed: int) -> None:  # type: ignore[type-arg]
        self._sampler = sampler
        self._rng = np.random.RandomState(seed)

    def __iter__(self) -> Iterator[Any]:
        indices = list(self._sampler)
        self._rng.shuffle(indices)
        return iter(indices)

    def __len__(self) -> int:
        return _length(self._sampler)


class ReproducibleShuffleBatchSampler(Sampler):  # type: ignore[type-arg]
    """The batches of ``batch_sampler`` in an order drawn from ``seed`` (as
    ReproducibleShuffleSampler; shuffling records rather than batches mixes better)."""

    def __init__(self, batch_sampler: BatchSampler, seed: int) -> None:
        self._batch_sampler = batch_sampler
        self._rng = np.random.RandomState(seed)

    def __iter__(self) -> Iterator[Any]:
        batches = list(self._batch_sampler)
        self._rng.shuffle(batches)
        return iter(batches)

    def __len__(self) -> int:
        return len(self._batch_sampler)


__all__ = [
    "DistributedBatchSampler",
    "DistributedSampler",
    "RepeatBatchSampler",
    "RepeatSampler",
    "ReproducibleShuffleBatchSampler",
    "ReproducibleShuffleSampler",
    "SkipBatchSampler",
    "SkipSampler",
]
