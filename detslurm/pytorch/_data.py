"""``det.pytorch.DataLoader``: torch DataLoader arguments, turned into a sharded loader per rank.

Determined's contract, which this module keeps:

* ``batch_size`` is the PER-SLOT batch size (trials pass ``context.get_per_slot_batch_size()``);
  one training step of the trial consumes ``world size`` consecutive batches of the epoch's
  batch sequence, batch ``i`` going to rank ``i % world``. So step ``s`` of a W-rank run sees
  exactly the records of step ``s`` of a 1-rank run whose batch size is the global one.
* ``shuffle=True`` draws each epoch's order as Determined's Trainer does (torch's RandomSampler
  under one training iterator): at the epoch's first batch, from the loader's ``generator``, else
  from a generator seeded by one draw of the global RNG, which the trial seeds with its trial
  seed. Every rank draws the same order because every rank's RNG is seeded alike and drawn from
  alike, as in Determined. The global RNG's state at the epoch's start is saved with a
  checkpoint's RNG states (:func:`epoch_start_state`), so a run resumed mid-epoch draws that
  epoch's order again, where Determined draws a new one.
* Resuming skips batches by index (nothing is loaded for them).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils.data import BatchSampler, Dataset, IterableDataset, RandomSampler, Sampler, SequentialSampler

from detslurm.pytorch.samplers import SkipBatchSampler, SkipSampler

log = logging.getLogger("detslurm.pytorch")

# Mixes (seed, epoch) into one generator seed; any fixed odd constant keeps epochs distinct.
_EPOCH_MIX = 1_000_003

# The order's RNG state at the start of the epoch in progress ({"epoch", "generator_state"}): one
# per process, as the global RNG it extends is; a checkpoint saves it beside torch's (_state.py).
_EPOCH_START: dict[str, Any] = {}


def epoch_start_state() -> dict[str, Any]:
    return dict(_EPOCH_START)


def set_epoch_start_state(state: dict[str, Any]) -> None:
    _EPOCH_START.clear()
    _EPOCH_START.update(state)


def _draw_seed(generator: Optional[torch.Generator]) -> int:
    """One int64, drawn as torch draws a RandomSampler's seed or a loader iterator's base seed."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def _shuffled(n: int, own: Optional[torch.Generator], global_rng: Optional[torch.Generator] = None) -> list[int]:
    """An epoch's order as torch's RandomSampler draws it: a permutation from the loader's ``own``
    generator, else from a fresh generator seeded by one draw of the global RNG (or of
    ``global_rng`` standing in for it). The sampler draws a second, unused permutation when it
    runs out; from a loader's own generator that draw shows in the next epoch, so it is made too."""
    if own is None:
        return torch.randperm(n, generator=torch.Generator().manual_seed(_draw_seed(global_rng))).tolist()
    order = torch.randperm(n, generator=own).tolist()
    torch.randperm(n, generator=own)
    return order


def _replayed(n: int, own: Optional[torch.Generator], state: torch.Tensor) -> list[int]:
    """The order :func:`_shuffled` drew from RNG state ``state``, again: the loader's own
    generator is left where that draw left it; the global RNG is not touched."""
    if own is not None:
        own.set_state(state)
        return _shuffled(n, own)
    stand_in = torch.Generator()
    stand_in.set_state(state)
    return _shuffled(n, None, stand_in)


@dataclass(frozen=True)
class Shard:
    """Which part of the batch sequence one rank takes."""

    rank: int = 0
    size: int = 1


class _EpochBatches(Sampler[list[int]]):
    """The batch sampler handed to torch: this rank's batches of one epoch, from a given step on.

    The Trainer calls :meth:`position` before each ``iter(loader)``; torch draws indices in the
    main process, so this works with ``num_workers > 0`` and persistent workers alike."""

    def __init__(self, source: DataLoader, shard: Shard) -> None:
        self._source = source
        self._shard = shard
        self._order: Optional[list[int]] = None
        self._skip_steps = 0

    def position(self, order: Optional[list[int]], skip_steps: int) -> None:
        """The next iteration: the epoch of ``order`` (a shuffled loader's), from step ``skip_steps`` on."""
        self._order, self._skip_steps = order, skip_steps

    def steps_per_epoch(self) -> int:
        """Full steps (one batch per rank) in an epoch; a last incomplete round is dropped so
        that every rank takes the same number of steps (ranks step in lock-step under DDP)."""
        return self._source._num_batches() // self._shard.size

    def __len__(self) -> int:
        return max(0, self.steps_per_epoch() - self._skip_steps)

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._source._batches(self._order)
        size, rank = self._shard.size, self._shard.rank
        # Resuming skips whole steps of all ranks: indices are skipped, no sample is loaded for them.
        start = self._skip_steps * size + rank
        stop = self.steps_per_epoch() * size
        yield from itertools.islice(batches, start, stop, size)


class DataLoader:
    """Records torch DataLoader arguments; the Trainer builds the real loader for each rank.

    Accepts torch.utils.data.DataLoader's arguments. ``sampler`` and ``batch_sampler`` may be
    given as in torch: a plain RandomSampler or SequentialSampler becomes ``shuffle`` (drawn as
    the module doc says, from the sampler's generator) or the records in order; any other
    sampler is iterated once per epoch and its batches are sharded and skipped like the
    built-in ones (its order is then its own)."""

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: Optional[int] = 1,
        shuffle: bool = False,
        sampler: Optional[Sampler[Any]] = None,
        batch_sampler: Optional[Sampler[Sequence[int]]] = None,
        num_workers: int = 0,
        collate_fn: Optional[Callable[[list[Any]], Any]] = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Optional[Callable[[int], None]] = None,
        multiprocessing_context: Any = None,
        generator: Optional[torch.Generator] = None,
        *,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                "det.pytorch.DataLoader does not support an IterableDataset (it cannot be sharded or "
                "resumed by index); return a torch.utils.data.DataLoader for it instead"
            )
        # The same checks and message as torch's DataLoader, so a loader that torch accepts (or
        # refuses) behaves the same here; batch_size 1 is torch's default, not a user choice.
        if batch_sampler is not None and (batch_size != 1 or shuffle or sampler is not None or drop_last):
            raise ValueError(
                "DataLoader: batch_sampler is mutually exclusive with batch_size, shuffle, sampler, drop_last"
            )
        if sampler is not None and shuffle:
            raise ValueError("DataLoader: sampler is mutually exclusive with shuffle")
        if batch_sampler is None and (batch_size is None or batch_size < 1):
            raise ValueError(f"DataLoader: batch_size must be a positive int (got {batch_size!r})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.batch_sampler = batch_sampler
        # torch's own samplers only say "in order" or "shuffled": we draw that order ourselves.
        # A RandomSampler drawing with replacement or a fixed number of samples is not a plain
        # shuffle: it stays a custom sampler and keeps its own semantics.
        # The order's generator is the loader's (Determined builds its RandomSampler with it), or
        # the given RandomSampler's own.
        self._order_generator = generator
        if isinstance(sampler, RandomSampler) and not sampler.replacement and sampler._num_samples is None:
            shuffle, self._order_generator = True, sampler.generator
            sampler = None
        elif isinstance(sampler, SequentialSampler):
            sampler = None
        self.shuffle = shuffle
        self.sampler = sampler
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.generator = generator
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers

    # -- the batch sequence of one epoch (all ranks together) ----------------------------------
    def _num_batches(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        n = len(self.sampler) if self.sampler is not None else len(self.dataset)  # type: ignore[arg-type]
        bs = int(self.batch_size or 1)
        # Ceiling division without floats: the last, short batch counts unless drop_last.
        return n // bs if self.drop_last else -(-n // bs)

    def _draw_order(self) -> Optional[list[int]]:
        """A shuffled loader's next epoch order; None for any other loader (its sampler's order)."""
        if not self.shuffle:
            return None
        return _shuffled(len(self.dataset), self._order_generator)  # type: ignore[arg-type]

    def _batches(self, order: Optional[list[int]]) -> Iterator[list[int]]:
        """One epoch's batches: of ``order`` when shuffled (see :meth:`_draw_order`), else of the
        batch sampler, the sampler, or the records in order."""
        if self.batch_sampler is not None:
            return (list(b) for b in self.batch_sampler)
        if order is None:
            order = list(self.sampler) if self.sampler is not None else list(range(len(self.dataset)))  # type: ignore[arg-type]
        return iter(BatchSampler(order, int(self.batch_size or 1), self.drop_last))

    def __len__(self) -> int:
        """Batches in one epoch, before sharding (as torch's len(DataLoader))."""
        return self._num_batches()

    def get_data_loader(
        self, repeat: bool = False, skip: int = 0, num_replicas: int = 1, rank: int = 0
    ) -> torch.utils.data.DataLoader[Any]:
        """A torch loader over this one's batches (Determined's): one pass, or passes forever with
        ``repeat`` (a shuffled one reshuffles each pass), dealt round-robin to ``num_replicas``
        ranks, this ``rank``'s share without its first ``skip`` batches. The Trainer positions
        its loaders by trial seed and epoch instead (:class:`ShardedLoader`)."""
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"get_data_loader(): rank {rank} is not one of num_replicas={num_replicas} ranks")
        if skip < 0:
            raise ValueError(f"get_data_loader(): skip must be >= 0 (got {skip})")
        batches = adapt_batch_sampler(
            _PassBatches(self),  # type: ignore[arg-type]
            repeat=repeat,
            skip=skip,
            num_replicas=num_replicas,
            rank=rank,
        )
        return torch.utils.data.DataLoader(self.dataset, batch_sampler=batches, **self._torch_kwargs())

    def __iter__(self) -> Iterator[Any]:
        """One pass over the data, as a torch loader iterates (code run outside the Trainer)."""
        return iter(self.get_data_loader())

    def _torch_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "num_workers": self.num_workers,
            "collate_fn": self.collate_fn,
            "pin_memory": self.pin_memory,
            "timeout": self.timeout,
            "worker_init_fn": self.worker_init_fn,
            "multiprocessing_context": self.multiprocessing_context,
            "generator": self.generator,
            "persistent_workers": self.persistent_workers,
        }
        if self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs


class _PassBatches(Sampler[list[int]]):
    """A DataLoader's batches, pass after pass: a shuffled one draws a new order at each pass's
    first batch, as torch's RandomSampler does."""

    def __init__(self, source: DataLoader) -> None:
        self.source = source

    def __len__(self) -> int:
        return self.source._num_batches()

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.source._batches(self.source._draw_order())


class ShardedLoader:
    """One rank's torch DataLoader over a det.pytorch.DataLoader, positioned by (epoch, step)."""

    def __init__(self, source: DataLoader, shard: Shard, seed: int) -> None:
        self.source = source
        self.batches = _EpochBatches(source, shard)
        self._seed = seed
        self._started = False
        kwargs = source._torch_kwargs()
        # Each epoch's torch iterator draws its workers' base seed from the loader's generator: a
        # private one, re-seeded per epoch, so that these draws touch neither the global RNG nor
        # the user's generator (Determined's one iterator drew once: see _epoch_order).
        self._generator = torch.Generator()
        kwargs["generator"] = self._generator
        self.loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(
            source.dataset, batch_sampler=self.batches, **kwargs
        )
        if self.batches.steps_per_epoch() < 1:
            raise ValueError(
                f"the training data has {source._num_batches()} batch(es) of {source.batch_size} per epoch, "
                f"fewer than one per rank ({shard.size} ranks): use a smaller per-slot batch size or more data"
            )
        leftover = source._num_batches() % shard.size
        if leftover and shard.rank == 0:
            log.warning(
                "%d batch(es) at the end of each epoch are not trained: %d batches do not divide among %d ranks",
                leftover,
                source._num_batches(),
                shard.size,
            )

    def steps_per_epoch(self) -> int:
        return self.batches.steps_per_epoch()

    def epoch(self, epoch: int, skip_steps: int = 0) -> Iterator[Any]:
        """This rank's batches of ``epoch``, after the first ``skip_steps`` steps. Called when the
        epoch's first batch is due: a shuffled order is drawn then, as Determined draws it."""
        self.batches.position(self._epoch_order(epoch, skip_steps), skip_steps)
        # Worker seeds, like the order, repeat when an epoch is resumed.
        self._generator.manual_seed((self._seed * _EPOCH_MIX + epoch + 1) % (2**63))
        return iter(self.loader)

    def _epoch_order(self, epoch: int, skip_steps: int) -> Optional[list[int]]:
        first, self._started = not self._started, True
        own = self.source._order_generator
        if first and (epoch, skip_steps) == (0, 0):
            # A fresh run: Determined's training iterator, made once, drew its workers' base seed
            # from the same RNG just before the first order.
            _draw_seed(own)
        if not self.source.shuffle:
            return None
        n = len(self.source.dataset)  # type: ignore[arg-type]
        if skip_steps and _EPOCH_START.get("epoch") == epoch:
            return _replayed(n, own, _EPOCH_START["generator_state"])  # resumed mid-epoch
        # Otherwise a new epoch, or a resume from a checkpoint without it (Determined's or an older
        # one): drawn from the RNG as it is now, which is what Determined does on a resume.
        state = own.get_state() if own is not None else torch.get_rng_state()
        set_epoch_start_state({"epoch": epoch, "generator_state": state})
        return _shuffled(n, own)


def evaluation_loader(source: Any, shard: Shard, seed: int) -> Any:
    """The validation loader for one rank: a det DataLoader is sharded by batch (every batch
    once, the last round may leave some ranks without one); a plain torch loader is used as is.

    Like Determined's, each pass draws its iterator's base seed (and a shuffled order) from the
    loader's generator or the global RNG, on every rank that validates. Where only the chief
    iterates it (evaluate_full_dataset on several ranks) it draws from a private generator
    instead: a draw on one rank alone would set the ranks' training orders apart."""
    if not isinstance(source, DataLoader):
        return source
    chief_only = shard.size == 1 and _world_size() > 1
    private = torch.Generator().manual_seed(seed) if chief_only else None
    batches = _ValidationBatches(source, shard, private)
    kwargs = source._torch_kwargs()
    if private is not None:
        kwargs["generator"] = private
    return torch.utils.data.DataLoader(source.dataset, batch_sampler=batches, **kwargs)


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _ValidationBatches(Sampler[list[int]]):
    def __init__(self, source: DataLoader, shard: Shard, private: Optional[torch.Generator]) -> None:
        self._source, self._shard, self._private = source, shard, private

    def __len__(self) -> int:
        n, size = self._source._num_batches(), self._shard.size
        # Validation drops nothing: every batch is evaluated once, so the low ranks take one more
        # when the batches do not divide evenly.
        return n // size + (1 if self._shard.rank < n % size else 0)

    def __iter__(self) -> Iterator[list[int]]:
        if self._private is not None and self._source.shuffle:
            order: Optional[list[int]] = _shuffled(len(self._source.dataset), self._private)  # type: ignore[arg-type]
        else:
            order = self._source._draw_order()
        batches = self._source._batches(order)
        yield from itertools.islice(batches, self._shard.rank, None, self._shard.size)


def adapt_batch_sampler(
    batch_sampler: BatchSampler, repeat: bool = False, skip: int = 0, num_replicas: int = 1, rank: int = 0
) -> BatchSampler:
    """``batch_sampler`` repeated (training), sharded over ``num_replicas`` ranks, then without
    its first ``skip`` batches of this rank (resuming): the skip counts this rank's batches,
    so it comes after the shard."""
    from detslurm.pytorch import samplers

    if repeat:
        batch_sampler = samplers.RepeatBatchSampler(batch_sampler)
    if num_replicas > 1:
        batch_sampler = samplers.DistributedBatchSampler(batch_sampler, num_replicas, rank)
    if skip > 0:
        batch_sampler = samplers.SkipBatchSampler(batch_sampler, skip)
    return batch_sampler


def data_length(data: Any) -> int:
    """Records in a batch: the length of the tensor or array, or of the first value of a dict,
    list or tuple of them (every leaf holds the same number of records)."""
    if isinstance(data, torch.Tensor) or _is_ndarray(data):
        return len(data)
    if isinstance(data, (dict, list, tuple)):
        if not data:
            raise ValueError(f"data_length(): an empty {type(data).__name__} holds no records")
        first = next(iter(data.values())) if isinstance(data, dict) else data[0]
        return len(first)
    raise TypeError(
        f"data_length(): a batch is a tensor, an array, or a dict, list or tuple of them, not {type(data).__name__}"
    )


def _is_ndarray(data: Any) -> bool:
    return type(data).__module__ == "numpy" and type(data).__name__ == "ndarray"


# The kinds of numpy dtype that torch has tensors for: floats, complex, ints, uints, bools.
_TENSOR_KINDS = "fciub"


def to_device(data: Any, device: torch.device, warned_types: Optional[set[type]] = None) -> Any:
    """``data`` with every tensor (and anything with a ``.to()``) moved to ``device`` and numeric
    numpy arrays made tensors there, through nested dicts, lists and tuples. What cannot move
    is returned as it is, with one warning per type (recorded in ``warned_types``)."""
    warned = warned_types if warned_types is not None else set()
    if isinstance(data, dict):
        return {k: to_device(v, device, warned) for k, v in data.items()}
    if isinstance(data, list):
        return [to_device(v, device, warned) for v in data]
    if isinstance(data, tuple):
        return tuple(to_device(v, device, warned) for v in data)
    if _is_ndarray(data):
        if data.dtype.kind in _TENSOR_KINDS:
            return torch.from_numpy(data).to(device)
    elif callable(getattr(data, "to", None)):
        return data.to(device)
    if type(data) not in warned:
        warned.add(type(data))
        log.warning("to_device(): cannot move a %s to %s; it is passed on as it is", type(data).__name__, device)
    return data


def skips_itself(loader: Any) -> bool:
    """Whether a torch loader's samplers include one of Determined's skip samplers (anywhere in
    a chain of batch samplers: DistributedBatchSampler(SkipBatchSampler(RepeatBatchSampler(...))))."""
    if isinstance(getattr(loader, "sampler", None), SkipSampler):
        return True
    sampler = getattr(loader, "batch_sampler", None)
    for _ in range(16):  # a guard against a sampler that names itself
        if isinstance(sampler, (SkipBatchSampler, SkipSampler)):
            return True
        sampler = getattr(sampler, "batch_sampler", None)
        if sampler is None:
            return False
    return False
