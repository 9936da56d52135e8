"""The Trainer: train / validate / checkpoint / preempt, resumable to the exact batch.

Resuming reproduces an uninterrupted run. With a det.pytorch.DataLoader the data order is a
function of (trial seed, epoch) and the trained batches are skipped by index. With a plain torch
DataLoader (accepted, unsharded) the checkpoint also holds the RNG state at the start of the
current epoch, so the loader's order is drawn again exactly and the trained batches are skipped.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch

from detslurm.expconf.view import ConfigView
from detslurm.pytorch._context import LRScheduler
from detslurm.pytorch._data import DataLoader, ShardedLoader, skips_itself
from detslurm.pytorch._reducer import scalar
from detslurm.pytorch._state import rng_state, set_rng_state
from detslurm.pytorch._trainer_metrics import _Metrics
from detslurm.pytorch._units import Batch, TrainUnit, total_batches

log = logging.getLogger("detslurm.pytorch")


class Trainer(_Metrics):
    """Determined's ``det.pytorch.Trainer``: ``fit`` trains the trial, validating, reporting and
    checkpointing as its periods say. Its parts are layered classes: see ``_trainer_state.py``."""

    def configure_profiler(
        self,
        sync_timings: bool = True,
        enabled: bool = False,
        begin_on_batch: int = 0,
        end_after_batch: Optional[int] = None,
    ) -> None:
        # Determined's parameter order and defaults: configure_profiler(True) means sync_timings.
        self._profiling = {"enabled": enabled, "sync": sync_timings, "begin": begin_on_batch, "end": end_after_batch}

    # -- configuration -------------------------------------------------------------------
    def _max_batches(self, max_length: Optional[TrainUnit], bpe: int, test_mode: bool) -> int:
        if test_mode:
            return 1
        if max_length is None:
            ml = ConfigView(self.context.get_experiment_config()).searcher.max_length
            if not self._on_cluster() or ml is None:
                raise ValueError(
                    "`fit(max_length=X)` must be set when training locally (or, on a cluster, "
                    "searcher.max_length must be in the experiment config)"
                )
            gbs = self.context.get_hparams().get("global_batch_size")
            max_length = TrainUnit.from_values(**ml.as_dict(), global_batch_size=gbs)
            assert max_length is not None
        return total_batches(max_length, bpe)

    def _training_source(self) -> tuple[Any, int]:
        """(what to iterate, steps in one pass over the data) for build_training_data_loader()."""
        source = self.trial.build_training_data_loader()
        if isinstance(source, DataLoader):
            sharded = ShardedLoader(source, self._shard(), self.context.get_trial_seed())
            return sharded, sharded.steps_per_epoch()
        if not isinstance(source, torch.utils.data.DataLoader):
            raise TypeError(
                "build_training_data_loader() must return a det.pytorch.DataLoader or a torch.utils.data.DataLoader, "
                f"not {type(source).__name__}"
            )
        if self.context.distributed.size > 1 and self.context.distributed.rank == 0:
            log.warning(
                "build_training_data_loader() returned a torch.utils.data.DataLoader: with %d slots every rank "
                "iterates all of it (no sharding); return a det.pytorch.DataLoader to shard the data",
                self.context.distributed.size,
            )
        # max(1, ...): an empty loader would make the epoch length 0 and every period divide by it.
        return source, max(1, len(source))

    def _validation_source(self) -> Any:
        return self.trial.build_validation_data_loader()

    def _unit_epoch_len(self, data_steps: int) -> int:
        """Batches per Epoch unit: records_per_epoch / global batch size when the config sets
        records_per_epoch (Determined's legacy knob), else one pass over the training data."""
        rpe = ConfigView(self.context.get_experiment_config()).records_per_epoch
        if rpe > 0:
            return max(1, rpe // self.context.get_global_batch_size())
        return data_steps

    # -- the loop ------------------------------------------------------------------------
    def fit(
        self,
        checkpoint_period: Optional[TrainUnit] = None,
        validation_period: Optional[TrainUnit] = None,
        max_length: Optional[TrainUnit] = None,
        reporting_period: TrainUnit = Batch(100),
        checkpoint_policy: str = "best",
        latest_checkpoint: Optional[str] = None,
        step_zero_validation: bool = False,
        test_mode: bool = False,
        profiling_enabled: bool = False,
    ) -> None:
        if profiling_enabled and not self._profiling["enabled"]:
            self.configure_profiler(enabled=True)
        if checkpoint_policy not in ("best", "all", "none"):
            raise ValueError(f"checkpoint_policy must be 'best', 'all' or 'none' (got {checkpoint_policy!r})")
        if not self._on_cluster() and checkpoint_policy == "best":
            checkpoint_policy = "all"  # no searcher metric to rank checkpoints by, locally
        self._policy = checkpoint_policy
        # Where this run starts, before the loaders are built: a torch loader built on
        # SkipBatchSampler(..., context.get_initial_batch()) skips exactly what the run resumes past
        # (0 when fit is given no checkpoint, as in Determined).
        first_batch = self._resume_position(latest_checkpoint) if latest_checkpoint else 0
        self.context._initial_batch = first_batch
        source, data_steps = self._training_source()
        # Built before training starts, as Determined does, so a broken validation loader fails
        # at once rather than after the first training period.
        self._val_source = self._validation_source()
        bpe = self._unit_epoch_len(data_steps)
        self._bpe = bpe
        self.context._epoch_len = bpe
        max_batches = self._max_batches(max_length, bpe, test_mode)
        # Determined's order: every callback's on_trial_startup (with the batch the run resumes
        # at), the checkpoint loaded (on_checkpoint_load_start, load_state_dict), then every
        # on_training_start; on_trial_shutdown follows whatever happens after the startup.
        for cb in self.callbacks.values():
            cb.on_trial_startup(first_batch, latest_checkpoint)
        try:
            if latest_checkpoint:
                self._load(latest_checkpoint)
            for cb in self.callbacks.values():
                cb.on_training_start()
            if step_zero_validation and self.batches_trained == 0 and not test_mode:
                self._validate(test_mode)
            stream = self._stream(source, data_steps)
            periods = (checkpoint_period, validation_period, reporting_period)
            with self.context.profiler or contextlib.nullcontext():
                self._train(stream, bpe, max_batches, periods, test_mode)
        finally:
            for cb in self.callbacks.values():
                cb.on_trial_shutdown()

    def _stream(self, source: Any, data_steps: int) -> Iterator[Any]:
        """This rank's batches from step ``batches_trained`` on, across data epochs, forever."""
        return self._loader_steps(source, data_steps, self.batches_trained)

    def _loader_steps(self, source: Any, data_steps: int, start: int) -> Iterator[Any]:
        """The loader's batches from its ``start``-th on (``data_steps`` per pass), forever."""
        # Data epochs, not Epoch units: the loader's position depends on passes over the data even
        # when records_per_epoch makes the Epoch unit a different length.
        epoch, skip = divmod(start, data_steps)
        while True:
            if isinstance(source, ShardedLoader):
                yield from source.epoch(epoch, skip)
            else:
                yield from self._plain_epoch(source, skip)
            epoch, skip = epoch + 1, 0

    def _plain_epoch(self, loader: Any, skip: int) -> Iterator[Any]:
        # A loader built on Determined's skip samplers (SkipBatchSampler or SkipSampler with
        # context.get_initial_batch(), as Determined's docs teach) skips the trained batches
        # itself: skipping them here too would lose as many again.
        if skip and skips_itself(loader):
            skip = 0
        # A torch loader's sampler draws its order from the global RNG at the first next():
        # draw it from the epoch-start RNG state, skip what was trained, restore the current state.
        if skip == 0 or self._epoch_rng is None:
            self._epoch_rng = rng_state()
        resume_state = rng_state()
        set_rng_state(self._epoch_rng)
        iterator = iter(loader)
        for _ in itertools.islice(iterator, skip):
            pass
        if skip:
            set_rng_state(resume_state)
        yield from iterator

    def _train(
        self,
        stream: Iterator[Any],
        bpe: int,
        max_batches: int,
        periods: tuple[Optional[TrainUnit], Optional[TrainUnit], TrainUnit],
        test_mode: bool,
    ) -> None:
        pending: list[dict[str, Any]] = []
        first = True
        alone = self.context.distributed.size == 1
        while self.batches_trained < max_batches:
            self.epoch_idx = self.batches_trained // bpe
            if first or self.batches_trained % bpe == 0:
                self._on_epoch_start(self.epoch_idx)
            first = False
            # Batches before the next one at which anything is due only step: the per-batch
            # bookkeeping below would otherwise cost a few percent of a small model's step.
            # A stop the trial requests is still seen after the very batch that requested it.
            quiet_until = self._next_due(bpe, max_batches, periods) - 1
            while self.batches_trained < quiet_until:
                self._train_one(pending, stream)
                if alone and self.context._stop_requested:
                    break
            else:
                self._train_one(pending, stream)
            if self.batches_trained % bpe == 0:
                # Epoch end before any checkpoint at this batch: the checkpoint then holds the
                # schedulers as stepped, and a resumed run does not step them a second time.
                self._step_schedulers(LRScheduler.StepMode.STEP_EVERY_EPOCH)
                for cb in self.callbacks.values():
                    cb.on_training_epoch_end(self.epoch_idx)
            if self._boundaries(pending, bpe, max_batches, periods, test_mode):
                return

    def _train_one(self, pending: list[dict[str, Any]], stream: Iterator[Any]) -> None:
        """One batch trained; its metrics appended to the reporting window."""
        pending.append(self._step(next(stream)))

    def _on_epoch_start(self, epoch_idx: int) -> None:
        for cb in self.callbacks.values():
            if inspect.signature(cb.on_training_epoch_start).parameters:
                cb.on_training_epoch_start(epoch_idx)
            else:
                # Determined's callbacks before 0.17.8 took no epoch_idx; it still calls them so.
                log.warning("on_training_epoch_start() without an epoch_idx parameter is deprecated: add epoch_idx")
                cb.on_training_epoch_start()  # type: ignore[call-arg]

    def _next_due(
        self, bpe: int, max_batches: int, periods: tuple[Optional[TrainUnit], Optional[TrainUnit], TrainUnit]
    ) -> int:
        """The first batch count after now at which an epoch ends, training ends or a period hits."""
        b = self.batches_trained
        due = [(b // bpe + 1) * bpe, max_batches]
        due += [h for p in periods if p is not None and (h := p.next_hit(b, bpe)) is not None]
        return min(due)

    def _step(self, batch: Any) -> dict[str, Any]:
        ctx = self.context
        if ctx.experimental._auto_to_device:
            batch = ctx.to_device(batch)
        prof = self._profiling
        timed = prof["enabled"] and (
            self.batches_trained >= prof.get("begin", 0)
            and (prof.get("end") is None or self.batches_trained <= prof["end"])
        )
        # Set before train_batch so step_optimizer() and the context's epoch helpers know which
        # batch this is (aggregation steps on every aggregation_frequency-th one).
        ctx._current_batch_idx = self.batches_trained
        ctx._scaler_stepped = False
        t0 = time.perf_counter() if timed else 0.0
        if ctx._wrapped_models and not ctx._should_communicate_and_update():
            # Accumulating gradients: no all-reduce until the batch that steps the optimizer.
            with contextlib.ExitStack() as stack:
                for ddp in ctx._wrapped_models:
                    stack.enter_context(ddp.no_sync())  # type: ignore[operator]
                metrics = self.trial.train_batch(batch, self.epoch_idx, self.batches_trained)
        else:
            # batch_idx is the batch's index since the start of training (Determined's meaning).
            metrics = self.trial.train_batch(batch, self.epoch_idx, self.batches_trained)
        if ctx._scaler is not None and ctx._scaler_stepped:
            ctx._scaler.update()
        if ctx.profiler is not None:
            ctx.profiler.step()  # set_profiler(): its schedule counts batches
        if timed:
            self.step_timings.append(time.perf_counter() - t0)
            self._records_timed += self.trial.get_batch_length(batch)
        self.batches_trained += 1
        if ctx.lr_schedulers:
            self._step_schedulers(LRScheduler.StepMode.STEP_EVERY_BATCH)
        if not isinstance(metrics, dict):
            raise TypeError(f"train_batch() must return a dict of metrics, not {type(metrics).__name__}")
        return {k: _detached(v) for k, v in metrics.items()}

    def _step_schedulers(self, mode: LRScheduler.StepMode) -> None:
        for s in self.context.lr_schedulers:
            if s.step_mode == mode:
                s.step_due()

    def _boundaries(
        self,
        pending: list[dict[str, Any]],
        bpe: int,
        max_batches: int,
        periods: tuple[Optional[TrainUnit], Optional[TrainUnit], TrainUnit],
        test_mode: bool,
    ) -> bool:
        """Report / validate / checkpoint as due; True when training must stop now."""
        ckpt_p, val_p, rep_p = periods
        b, done = self.batches_trained, self.batches_trained >= max_batches
        validate_due = val_p is not None and val_p.hits(b, bpe)
        checkpoint_due = ckpt_p is not None and ckpt_p.hits(b, bpe)
        validate, checkpoint = done or validate_due, done or checkpoint_due
        # Training metrics are flushed at every validation/checkpoint too: a restart resumes at
        # a checkpoint, so no reported window ever straddles one (same rows as an uninterrupted run).
        boundary = validate or checkpoint or rep_p.hits(b, bpe)
        # A stop the trial requested is acted on at once by a lone rank, but with several ranks
        # only at the next boundary, where every rank is: checkpointing is collective, and one
        # rank going there alone would leave the others waiting in their next collective.
        alone = self.context.distributed.size == 1
        if not boundary and not (alone and self.context._stop_requested):
            return False  # the common case: nothing due after this batch
        if boundary:
            self._report_training(pending)
        # Determined's order: the periods' validation and checkpoint, then at the end of training
        # the final ones not already done at this batch (so a checkpoint period ending on the last
        # batch checkpoints before the final validation).
        if validate_due:
            self._validate(test_mode)
        if checkpoint_due:
            self._checkpoint()
        if done:
            self._validate(test_mode)
            self._checkpoint()
        # Preemption is checked at boundaries only (a collective on every rank: not per batch).
        requested = self.context.get_stop_requested()
        if not alone:
            requested = any(self.context.distributed.allgather(requested))
        stop = requested or (boundary and self._should_preempt())
        if stop and not done:
            self._report_training(pending)
            self._checkpoint()
        return stop or (done and test_mode)

    def _should_preempt(self) -> bool:
        return bool(self.core is not None and self.core.preempt.should_preempt())


def _detached(v: Any) -> Any:
    """A batch's metric kept where it is (a tensor stays on its device, detached from the graph).

    Converting each batch's loss to a Python number would cost a device sync per batch (on a
    GPU the host waits for the step to finish); ``_trainer_metrics._to_numbers`` converts a whole reporting
    window at once instead, as a careful hand-written loop does."""
    if isinstance(v, torch.Tensor):
        # Several values (a per-sample loss) stay a list, as Determined keeps the array: the
        # window's average is over all of them.
        return v.detach() if v.numel() == 1 else scalar(v)
    return scalar(v)
