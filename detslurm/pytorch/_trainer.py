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
import json
import logging
import pickle
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from detslurm.expconf.view import ConfigView, SearcherView
from detslurm.pytorch._context import LRScheduler, PyTorchTrialContext
from detslurm.pytorch._data import DataLoader, Shard, ShardedLoader, evaluation_loader, skips_itself
from detslurm.pytorch._reducer import Reducer, reduce_rows, reduce_values, scalar
from detslurm.pytorch._state import (
    LOAD_DATA_FILE,
    STATE_FILE,
    TRAINER_STATE_FILE,
    TRIAL_STATE_FILE,
    load_data,
    load_trial_state,
    rng_state,
    set_rng_state,
    trial_state_dict,
)
from detslurm.pytorch._trial import PyTorchCallback, PyTorchTrial
from detslurm.pytorch._units import Batch, TrainUnit, total_batches

log = logging.getLogger("detslurm.pytorch")


class Trainer:
    def __init__(self, trial: PyTorchTrial, context: PyTorchTrialContext) -> None:
        self.trial = trial
        self.context = context
        self.core = context._core
        self.callbacks = trial.build_callbacks()
        for name, cb in self.callbacks.items():
            if type(cb).on_checkpoint_end is not PyTorchCallback.on_checkpoint_end:
                # Determined's words and category, once per callback that still overrides it.
                warnings.warn(
                    f"callback {name!r}: on_checkpoint_end is deprecated, please use on_checkpoint_write_end instead",
                    FutureWarning,
                    stacklevel=2,
                )
        self.batches_trained = 0
        self.epoch_idx = 0
        self._epoch_rng: Optional[dict[str, Any]] = None
        self._profiling: dict[str, Any] = {"enabled": False}
        self.step_timings: list[float] = []
        self._records_timed = 0  # get_batch_length() of the timed batches (profiling only)
        self._best: Optional[float] = None
        self._last_ckpt_at = -1
        self._last_val_at = -1
        self._bpe = 1
        self._policy = "best"
        self._val_source: Any = None
        # Determined accepts evaluate_batch(batch) and evaluate_batch(batch, batch_idx); the
        # signature, read once, says which one the user wrote.
        self._eval_takes_idx = len(inspect.signature(trial.evaluate_batch).parameters) >= 2

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
    def _on_cluster(self) -> bool:
        return self.core is not None and self.core.info is not None

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

    def _shard(self) -> Shard:
        dist = self.context.distributed
        return Shard(rank=dist.rank, size=dist.size)

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

    # -- reporting -----------------------------------------------------------------------
    def _custom_reductions(self, training: bool) -> dict[str, Any]:
        """The wrapped reducers' metrics, then every reducer reset: as in Determined, each
        training window and each validation starts from reset reducers."""
        out = self.context.reduce_metrics(for_training=training)
        self.context.reset_reducers()
        return out

    def _report_training(self, pending: list[dict[str, Any]]) -> None:
        if not pending:
            return
        _to_numbers(pending)
        batch_metrics = _across_ranks(pending, self.context.distributed)
        pending.clear()
        keys = set().union(*(m.keys() for m in batch_metrics))
        avg = {k: reduce_values([m[k] for m in batch_metrics if k in m], Reducer.AVG) for k in keys}
        avg.update(self._custom_reductions(training=True))
        # Where training is, unless the trial reported keys of those names (as Determined does).
        avg.setdefault("batches", self.batches_trained)
        avg.setdefault("epochs", self.batches_trained // self._bpe)
        if self.core is not None and self.context.is_chief():
            # Every rank takes part in the reductions above (collectives), only the chief reports:
            # the store gets one row per window, not one per rank.
            self.core.train.report_training_metrics(self.batches_trained, avg, batch_metrics=batch_metrics)
            if self.step_timings:
                t = self.step_timings
                self.core.train.report_metrics(
                    "profiling",
                    self.batches_trained,
                    {
                        "train_batch_s_mean": sum(t) / len(t),
                        "train_batch_s_max": max(t),
                        "samples": len(t),
                        "records_per_s": self._records_timed / max(sum(t), 1e-9),
                    },
                )
        for cb in self.callbacks.values():
            cb.on_training_workload_end(avg, batch_metrics)

    def _evaluate(self, test_mode: bool) -> dict[str, Any]:
        ctx = self.context
        ctx.reset_reducers()
        for m in ctx.models:
            m.eval()
        with torch.no_grad():
            # An overridden evaluate_full_dataset wins, as in Determined: the user asked to see the
            # whole validation set at once.
            if self._full_dataset_defined():
                metrics = self._evaluate_full_dataset()
            else:
                metrics = self._evaluate_batches(test_mode)
        for m in ctx.models:
            m.train()
        metrics.update(self._custom_reductions(training=False))
        return metrics

    def _full_dataset_defined(self) -> bool:
        return type(self.trial).evaluate_full_dataset is not PyTorchTrial.evaluate_full_dataset

    def _evaluate_full_dataset(self) -> dict[str, Any]:
        """On the chief only, over the whole (unsharded) validation data; the others get the result."""
        dist = self.context.distributed
        metrics: Optional[dict[str, Any]] = None
        if dist.rank == 0:
            loader = evaluation_loader(self._val_source, Shard(), self.context.get_trial_seed())
            metrics = {k: scalar(v) for k, v in self.trial.evaluate_full_dataset(loader).items()}
        result: Optional[dict[str, Any]] = dist.broadcast(metrics) if dist.size > 1 else metrics
        assert result is not None
        return result

    def _evaluate_batches(self, test_mode: bool) -> dict[str, Any]:
        loader = evaluation_loader(self._val_source, self._shard(), self.context.get_trial_seed())
        # Any: the user's evaluate_batch may be the one-argument form (see __init__).
        evaluate: Any = self.trial.evaluate_batch

        def outputs() -> Iterator[Any]:
            for i, batch in enumerate(loader):
                if self.context.experimental._auto_to_device:
                    batch = self.context.to_device(batch)
                yield evaluate(batch, i) if self._eval_takes_idx else evaluate(batch)
                if test_mode:
                    break

        return self._evaluation_metrics(outputs())

    def _evaluation_metrics(self, outputs: Iterator[Any]) -> dict[str, Any]:
        """The validation callbacks around ``outputs`` (evaluate_batch's results, drawn lazily so
        that the batches run between the callbacks), each checked, then reduced across ranks."""
        rows: list[dict[str, Any]] = []
        for cb in self.callbacks.values():
            cb.on_validation_epoch_start()
        for out in outputs:
            if not isinstance(out, dict):
                raise TypeError(f"evaluate_batch() must return a dict of metrics, not {type(out).__name__}")
            rows.append({k: scalar(v) for k, v in out.items()})
        for cb in self.callbacks.values():
            cb.on_validation_epoch_end(rows)
        return reduce_rows(rows, self.trial.evaluation_reducer(), self.context.distributed)

    def _validate(self, test_mode: bool) -> None:
        # A step can be both a period boundary and the end of training: validate it once only.
        if self._last_val_at == self.batches_trained:
            return
        for cb in self.callbacks.values():
            cb.on_validation_start()
        metrics = self._evaluate(test_mode)
        # Callbacks see the trial's own metrics; the report adds where training is, unless the
        # trial reported keys of those names itself (Determined's order and rule).
        for cb in self.callbacks.values():
            cb.on_validation_end(metrics)
        metrics.setdefault("batches", self.batches_trained)
        metrics.setdefault("epochs", self.batches_trained // self._bpe)
        self._last_val_at = self.batches_trained
        sc = ConfigView(self.context.get_experiment_config()).searcher
        metric = sc.metric
        # On a cluster the searcher needs this metric to decide; failing here names the cause,
        # where a missing metric would otherwise stall or mislead the search.
        if self._on_cluster() and metric and metric not in metrics:
            raise RuntimeError(
                f"the searcher metric {metric!r} is not in the validation metrics "
                f"({', '.join(sorted(metrics))}); return it from evaluate_batch/evaluate_full_dataset"
            )
        if self.core is not None and self.context.is_chief():
            self.core.train.report_validation_metrics(self.batches_trained, metrics)
        if self._policy == "all" or (self._policy == "best" and self._is_best(metrics, sc)):
            self._checkpoint()

    def _is_best(self, metrics: dict[str, Any], sc: SearcherView) -> bool:
        v = metrics.get(sc.metric)
        if not isinstance(v, (int, float)):
            return False
        # True is Determined's default for searcher.smaller_is_better (losses).
        sign = 1.0 if sc.smaller_is_better else -1.0
        if self._best is None or sign * v < sign * self._best:
            self._best = float(v)
            return True
        return False

    # -- checkpoints ---------------------------------------------------------------------
    def _trial_id(self) -> Optional[int]:
        info = self.core.info if self.core is not None else None
        return info.trial.trial_id if info is not None else None

    def _checkpoint(self) -> None:
        if self._last_ckpt_at == self.batches_trained or self.core is None:
            return
        self._last_ckpt_at = self.batches_trained
        uuid = ""
        # State is the same on every rank after the step (DDP), so the chief's copy is the
        # checkpoint; as in Determined, only the chief's callbacks see it saved and written, and
        # every rank's hear of its upload.
        if self.context.is_chief():
            state = trial_state_dict(self.context, self.callbacks)
            state["epoch_rng_state"] = self._epoch_rng  # for plain torch loaders (see the module doc)
            for cb in self.callbacks.values():
                cb.on_checkpoint_save_start(state)
            with self.core.checkpoint.store_path(self._checkpoint_metadata()) as (path, uuid):
                torch.save(state, path / STATE_FILE)
                self._write_trial_files(path)
        dist = self.context.distributed
        self._checkpoint_done(dist.broadcast(uuid) if dist.size > 1 else uuid)

    def _checkpoint_metadata(self) -> dict[str, Any]:
        return {
            "determined_version": "detslurm",
            "steps_completed": self.batches_trained,
            "framework": f"torch-{torch.__version__}",
            "format": "pickle",
        }

    def _write_trial_files(self, path: Path) -> None:
        """Where training is, how to load the trial again and its code (the chief's part)."""
        # Determined's fields only: its Trainer rebuilds its state from exactly these (any other
        # key fails there), so a user can resume our checkpoints under Determined. Off-cluster
        # the trial id is 0, as Determined's: any other id means another trial (a warm start).
        trial_state = {
            "trial_id": self._trial_id() or 0,
            "last_ckpt": self.batches_trained,
            "step_id": 0,
            "last_val": max(self._last_val_at, 0),
            "batches_trained": self.batches_trained,
            "epochs_trained": self.batches_trained // self._bpe,
        }
        with open(path / TRIAL_STATE_FILE, "wb") as f:
            pickle.dump(trial_state, f)
        # What only this Trainer keeps: the best searcher metric so far (checkpoint_policy="best").
        (path / TRAINER_STATE_FILE).write_text(json.dumps({"best": self._best}))
        (path / LOAD_DATA_FILE).write_text(json.dumps(load_data(self.trial, self.context)))
        if self._on_cluster():
            self._save_code(path / "code")
        for cb in self.callbacks.values():
            # Both with the directory being written, the deprecated hook first (Determined's order).
            cb.on_checkpoint_end(str(path))
            cb.on_checkpoint_write_end(str(path))

    def _checkpoint_done(self, uuid: str) -> None:
        for cb in self.callbacks.values():
            cb.on_checkpoint_upload_end(uuid)

    @staticmethod
    def _save_code(dest: Path) -> None:
        """The trial's code travels with its weights (det.import_from_path loads it later).
        Only on a trial, where the working dir is the extracted context snapshot (<= 95 MiB)."""
        src = Path.cwd()
        shutil.copytree(
            src,
            dest,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git", "checkpoints"),
            dirs_exist_ok=True,
            symlinks=True,
        )

    def _load(self, storage_id: str) -> None:
        assert self.core is not None
        with self.core.checkpoint.restore_path(storage_id) as path:
            state = torch.load(path / STATE_FILE, map_location=self.context.device, weights_only=False)
            trial_state = self._read_trial_state(path)
        for cb in self.callbacks.values():
            cb.on_checkpoint_load_start(state)
        load_trial_state(self.context, state)
        self._resume_at(storage_id, state, trial_state)

    def _warm_start(self, trial_state: dict[str, Any]) -> bool:
        """Whether the checkpoint is another trial's (its weights only are taken)."""
        saved_trial = trial_state.get("trial_id")
        return saved_trial is not None and self._trial_id() is not None and saved_trial != self._trial_id()

    def _resume_position(self, storage_id: str) -> int:
        """The batch a run resuming the checkpoint ``storage_id`` starts at."""
        assert self.core is not None
        with self.core.checkpoint.restore_path(storage_id) as path:
            trial_state = self._read_trial_state(path)
        return 0 if self._warm_start(trial_state) else int(trial_state["batches_trained"])

    @staticmethod
    def _read_trial_state(path: Path) -> dict[str, Any]:
        """Where training is in the checkpoint at ``path``: Determined's fields and ours."""
        with open(path / TRIAL_STATE_FILE, "rb") as f:
            trial_state: dict[str, Any] = pickle.load(f)
        if (path / TRAINER_STATE_FILE).is_file():
            trial_state.update(json.loads((path / TRAINER_STATE_FILE).read_text()))
        return trial_state

    def _resume_at(self, storage_id: str, state: dict[str, Any], trial_state: dict[str, Any]) -> None:
        """Callbacks, RNG and where training is, from a loaded checkpoint."""
        for k, sd in state.get("callbacks", {}).items():
            if k in self.callbacks:
                self.callbacks[k].load_state_dict(sd)
        if self._warm_start(trial_state):
            # A warm start (Continue Trial, source_trial_id): keep the weights, count from zero.
            saved_trial = trial_state.get("trial_id")
            log.info("warm start from checkpoint %s of trial %s: training starts at batch 0", storage_id, saved_trial)
            return
        rng = state.get("rng_state")
        if isinstance(rng, dict) and "cpu_rng_state" in rng:
            set_rng_state(rng)
        self._epoch_rng = state.get("epoch_rng_state")
        self.batches_trained = int(trial_state["batches_trained"])
        self.epoch_idx = int(trial_state.get("epoch_idx", self.batches_trained // self._bpe))
        self._best = trial_state.get("best")
        self._last_ckpt_at = self.batches_trained
        log.info("resumed from checkpoint %s at batch %d", storage_id, self.batches_trained)


def _detached(v: Any) -> Any:
    """A batch's metric kept where it is (a tensor stays on its device, detached from the graph).

    Converting each batch's loss to a Python number would cost a device sync per batch (on a
    GPU the host waits for the step to finish); :func:`_to_numbers` converts a whole reporting
    window at once instead, as a careful hand-written loop does."""
    if isinstance(v, torch.Tensor):
        # Several values (a per-sample loss) stay a list, as Determined keeps the array: the
        # window's average is over all of them.
        return v.detach() if v.numel() == 1 else scalar(v)
    return scalar(v)


def _across_ranks(rows: list[dict[str, Any]], dist: Any) -> list[dict[str, Any]]:
    """A window's per-batch metrics as Determined reports them: with several ranks, each batch's
    metrics averaged over the ranks (a value of several numbers becomes the mean of all of
    them); with one, the rank's own rows. Ranks with no rows (those of a pipeline that do not
    report) are left out."""
    if dist.size == 1:
        return list(rows)
    everyone = [r for r in dist.allgather(rows) if r]
    batches = [[ranks[i] for ranks in everyone if i < len(ranks)] for i in range(max(map(len, everyone)))]
    return [{k: reduce_values([r[k] for r in batch if k in r], Reducer.AVG) for k in batch[0]} for batch in batches]


def _to_numbers(pending: list[dict[str, Any]]) -> None:
    """Every tensor metric of the window made a plain number, in one transfer per device and
    dtype (an integer count stays an int, as ``.item()`` would give it)."""
    where = [(row, k) for row in pending for k, v in row.items() if isinstance(v, torch.Tensor)]
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[dict[str, Any], str]]] = {}
    for row, k in where:
        groups.setdefault((row[k].device, row[k].dtype), []).append((row, k))
    for places in groups.values():
        # reshape() only where needed: it costs a dispatch (~5 us) per value even when a no-op.
        values = torch.stack([row[k] if row[k].dim() == 0 else row[k].reshape(()) for row, k in places]).tolist()
        for (row, k), value in zip(places, values, strict=True):
            row[k] = value
