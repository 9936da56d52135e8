"""The Trainer: train / validate / checkpoint / preempt, resumable to the exact batch.

Resuming reproduces an uninterrupted run: a checkpoint holds the models, optimizers, schedulers,
callbacks, every RNG state, and the RNG state at the start of the current epoch, so the data
order of a partly trained epoch is drawn again exactly and the trained batches are skipped.
"""

from __future__ import annotations

import itertools
import json
import logging
import pickle
import random
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from detslurm.pytorch._context import LRScheduler, PyTorchTrialContext
from detslurm.pytorch._trial import PyTorchTrial, Reducer
from detslurm.pytorch._units import Batch, TrainUnit, total_batches

log = logging.getLogger("detslurm.pytorch")


def _scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().float().mean().item() if v.numel() != 1 else v.detach().item()
    return v


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _reduce(values: list[Any], how: Reducer) -> Any:
    nums = [float(v) for v in values if isinstance(v, (int, float))]
    if not nums:
        return values[-1] if values else None
    return {Reducer.AVG: sum(nums) / len(nums), Reducer.SUM: sum(nums), Reducer.MAX: max(nums), Reducer.MIN: min(nums)}[
        how
    ]


class Trainer:
    def __init__(self, trial: PyTorchTrial, context: PyTorchTrialContext) -> None:
        self.trial = trial
        self.context = context
        self.core = context._core
        self.callbacks = trial.build_callbacks()
        self.batches_trained = 0
        self.epoch_idx = 0
        self._epoch_rng: Optional[dict[str, Any]] = None
        self._profiling: dict[str, Any] = {"enabled": False}
        self.step_timings: list[float] = []
        self._best: Optional[float] = None
        self._last_ckpt_at = -1
        self._last_val_at = -1
        self._bpe = 1
        self._policy = "best"

    def configure_profiler(
        self,
        enabled: bool = True,
        sync_timings: bool = True,
        begin_on_batch: int = 0,
        end_after_batch: Optional[int] = None,
    ) -> None:
        self._profiling = {"enabled": enabled, "sync": sync_timings, "begin": begin_on_batch, "end": end_after_batch}

    # -- configuration -------------------------------------------------------------------
    def _on_cluster(self) -> bool:
        return self.core is not None and self.core.info is not None

    def _max_batches(self, max_length: Optional[TrainUnit], bpe: int, test_mode: bool) -> int:
        if test_mode:
            return 1
        if max_length is None:
            ml = (self.context.get_experiment_config().get("searcher") or {}).get("max_length")
            if not self._on_cluster() or not ml:
                raise ValueError(
                    "`fit(max_length=X)` must be set when training locally (or, on a cluster, "
                    "searcher.max_length must be in the experiment config)"
                )
            gbs = self.context.get_hparams().get("global_batch_size")
            max_length = TrainUnit.from_values(**ml, global_batch_size=gbs)
            assert max_length is not None
        return total_batches(max_length, bpe)

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
            self.configure_profiler(True)
        if not self._on_cluster() and checkpoint_policy == "best":
            checkpoint_policy = "all"  # no searcher metric to rank checkpoints by, locally
        self._policy = checkpoint_policy
        train_loader = self.trial.build_training_data_loader()
        self._val_loader = self.trial.build_validation_data_loader()
        bpe = max(1, len(train_loader))
        self._bpe = bpe
        max_batches = self._max_batches(max_length, bpe, test_mode)
        if latest_checkpoint:
            self._load(latest_checkpoint)
        for cb in self.callbacks.values():
            cb.on_trial_startup(self.batches_trained, latest_checkpoint)
            cb.on_training_start()
        try:
            if step_zero_validation and self.batches_trained == 0 and not test_mode:
                self._validate(test_mode)
            self._train(
                train_loader, bpe, max_batches, checkpoint_period, validation_period, reporting_period, test_mode
            )
        finally:
            for cb in self.callbacks.values():
                cb.on_trial_shutdown()

    def _train(
        self,
        loader: Any,
        bpe: int,
        max_batches: int,
        ckpt_p: Optional[TrainUnit],
        val_p: Optional[TrainUnit],
        rep_p: TrainUnit,
        test_mode: bool,
    ) -> None:
        pending: list[dict[str, Any]] = []
        while self.batches_trained < max_batches:
            self.epoch_idx = self.batches_trained // bpe
            skip = self.batches_trained % bpe
            if skip == 0 or self._epoch_rng is None:
                self._epoch_rng = _rng_state()
            resume_state = _rng_state()
            _set_rng_state(self._epoch_rng)
            # The sampler draws this epoch's order at the first next(): draw it from the
            # epoch-start RNG state and skip what was trained, then restore the checkpoint's state.
            iterator = iter(loader)
            for _ in itertools.islice(iterator, skip):
                pass
            if skip:
                _set_rng_state(resume_state)
            for cb in self.callbacks.values():
                cb.on_training_epoch_start(self.epoch_idx)
            for batch_idx, batch in enumerate(iterator, start=skip):
                pending.append(self._step(batch, batch_idx))
                stop = self._boundaries(pending, bpe, max_batches, ckpt_p, val_p, rep_p, test_mode)
                if stop:
                    return
                if self.batches_trained >= max_batches:
                    break
            self._step_schedulers(LRScheduler.StepMode.STEP_EVERY_EPOCH)
            for cb in self.callbacks.values():
                cb.on_training_epoch_end(self.epoch_idx)

    def _step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        batch = self.context.to_device(batch)
        prof = self._profiling
        timed = (
            prof["enabled"]
            and self.batches_trained >= prof.get("begin", 0)
            and (prof.get("end") is None or self.batches_trained <= prof["end"])
        )
        t0 = time.perf_counter()
        metrics = self.trial.train_batch(batch, self.epoch_idx, batch_idx)
        if timed:
            self.step_timings.append(time.perf_counter() - t0)
        self.batches_trained += 1
        self._step_schedulers(LRScheduler.StepMode.STEP_EVERY_BATCH)
        return {k: _scalar(v) for k, v in (metrics or {}).items()}

    def _step_schedulers(self, mode: LRScheduler.StepMode) -> None:
        for s in self.context.lr_schedulers:
            if s.step_mode == mode:
                s.scheduler.step()

    def _boundaries(
        self,
        pending: list[dict[str, Any]],
        bpe: int,
        max_batches: int,
        ckpt_p: Optional[TrainUnit],
        val_p: Optional[TrainUnit],
        rep_p: TrainUnit,
        test_mode: bool,
    ) -> bool:
        """Report / validate / checkpoint as due; True when training must stop now."""
        b, done = self.batches_trained, self.batches_trained >= max_batches
        validate = (val_p is not None and val_p.hits(b, bpe)) or done
        checkpoint = (ckpt_p is not None and ckpt_p.hits(b, bpe)) or done
        # Training metrics are flushed at every validation/checkpoint too: a restart resumes at
        # a checkpoint, so no reported window ever straddles one (same rows as an uninterrupted run).
        boundary = rep_p.hits(b, bpe) or validate or checkpoint
        if boundary:
            self._report_training(pending)
        if validate:
            self._validate(test_mode)
        if checkpoint:
            self._checkpoint()
        # Preemption is checked at boundaries only (a collective on every rank: not per batch).
        stop = self.context.get_stop_requested() or (boundary and self._should_preempt())
        if stop and not done:
            self._report_training(pending)
            self._checkpoint()
        return stop or (done and test_mode)

    def _should_preempt(self) -> bool:
        return bool(self.core is not None and self.core.preempt.should_preempt())

    # -- reporting -----------------------------------------------------------------------
    def _allreduce_mean(self, metrics: dict[str, Any]) -> dict[str, Any]:
        dist = self.context.distributed
        if dist.size == 1:
            return metrics
        everyone = dist.allgather(metrics)
        keys = set().union(*(m.keys() for m in everyone))
        return {k: _reduce([m[k] for m in everyone if k in m], Reducer.AVG) for k in keys}

    def _report_training(self, pending: list[dict[str, Any]]) -> None:
        if not pending:
            return
        keys = set().union(*(m.keys() for m in pending))
        avg = self._allreduce_mean({k: _reduce([m[k] for m in pending if k in m], Reducer.AVG) for k in keys})
        batch_metrics = list(pending)
        pending.clear()
        if self.core is not None and self.context.is_chief():
            self.core.train.report_training_metrics(self.batches_trained, avg, batch_metrics=batch_metrics)
            if self.step_timings:
                t = self.step_timings
                self.core.train.report_metrics(
                    "profiling",
                    self.batches_trained,
                    {"train_batch_s_mean": sum(t) / len(t), "train_batch_s_max": max(t), "samples": len(t)},
                )
        for cb in self.callbacks.values():
            cb.on_training_workload_end(avg, batch_metrics)

    def _evaluate(self, test_mode: bool) -> dict[str, Any]:
        trial = self.trial
        models = self.context.models
        for m in models:
            m.eval()
        with torch.no_grad():
            if type(trial).evaluate_full_dataset is not PyTorchTrial.evaluate_full_dataset:
                metrics = {k: _scalar(v) for k, v in trial.evaluate_full_dataset(self._val_loader).items()}
            else:
                rows = []
                for i, batch in enumerate(self._val_loader):
                    out = trial.evaluate_batch(self.context.to_device(batch), i)
                    rows.append({k: _scalar(v) for k, v in out.items()})
                    if test_mode:
                        break
                red = trial.evaluation_reducer()
                keys = set().union(*(r.keys() for r in rows)) if rows else set()
                metrics = {
                    k: _reduce(
                        [r[k] for r in rows if k in r], red if isinstance(red, Reducer) else red.get(k, Reducer.AVG)
                    )
                    for k in keys
                }
        for m in models:
            m.train()
        return self._allreduce_mean(metrics)

    def _validate(self, test_mode: bool) -> None:
        if self._last_val_at == self.batches_trained:
            return
        for cb in self.callbacks.values():
            cb.on_validation_start()
        metrics = self._evaluate(test_mode)
        metrics["batches"] = self.batches_trained
        metrics["epochs"] = self.batches_trained / self._bpe
        self._last_val_at = self.batches_trained
        sc = self.context.get_experiment_config().get("searcher") or {}
        metric = sc.get("metric")
        if self._on_cluster() and metric and metric not in metrics:
            raise RuntimeError(
                f"the searcher metric {metric!r} is not in the validation metrics "
                f"({', '.join(sorted(metrics))}); return it from evaluate_batch/evaluate_full_dataset"
            )
        if self.core is not None and self.context.is_chief():
            self.core.train.report_validation_metrics(self.batches_trained, metrics)
        for cb in self.callbacks.values():
            cb.on_validation_end(metrics)
        if self._policy == "all" or (self._policy == "best" and self._is_best(metrics, sc)):
            self._checkpoint()

    def _is_best(self, metrics: dict[str, Any], sc: dict[str, Any]) -> bool:
        v = metrics.get(sc.get("metric", ""))
        if not isinstance(v, (int, float)):
            return False
        sign = 1.0 if sc.get("smaller_is_better", True) else -1.0
        if self._best is None or sign * v < sign * self._best:
            self._best = float(v)
            return True
        return False

    # -- checkpoints ---------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        ctx = self.context
        return {
            "models_state_dict": [m.state_dict() for m in ctx.models],
            "optimizers_state_dict": [o.state_dict() for o in ctx.optimizers],
            "lr_schedulers_state_dict": [s.scheduler.state_dict() for s in ctx.lr_schedulers],
            "callbacks": {k: cb.state_dict() for k, cb in self.callbacks.items()},
            "rng_state": _rng_state(),
            "epoch_rng_state": self._epoch_rng,
        }

    def _checkpoint(self) -> None:
        if self._last_ckpt_at == self.batches_trained or self.core is None:
            return
        self._last_ckpt_at = self.batches_trained
        state = self._state()
        for cb in self.callbacks.values():
            cb.on_checkpoint_save_start(state)
        if not self.context.is_chief():
            return
        md = {
            "determined_version": "detslurm",
            "steps_completed": self.batches_trained,
            "framework": f"torch-{torch.__version__}",
            "format": "pickle",
        }
        with self.core.checkpoint.store_path(md) as (path, _uuid):
            torch.save(state, path / "state_dict.pth")
            with open(path / "trial_state.pkl", "wb") as f:
                pickle.dump(
                    {"batches_trained": self.batches_trained, "epoch_idx": self.epoch_idx, "best": self._best}, f
                )
            (path / "load_data.json").write_text(
                json.dumps({"trial_type": "PyTorchTrial", "trial_cls_spec": type(self.trial).__qualname__})
            )
            if self._on_cluster():
                self._save_code(path / "code")
        for cb in self.callbacks.values():
            cb.on_checkpoint_end(str(path))

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
            state = torch.load(path / "state_dict.pth", weights_only=False)
            with open(path / "trial_state.pkl", "rb") as f:
                trial_state = pickle.load(f)
        for cb in self.callbacks.values():
            cb.on_checkpoint_load_start(state)
        ctx = self.context
        for m, sd in zip(ctx.models, state["models_state_dict"], strict=False):
            m.load_state_dict(sd)
        for o, sd in zip(ctx.optimizers, state["optimizers_state_dict"], strict=False):
            o.load_state_dict(sd)
        for s, sd in zip(ctx.lr_schedulers, state["lr_schedulers_state_dict"], strict=False):
            s.scheduler.load_state_dict(sd)
        for k, sd in state.get("callbacks", {}).items():
            if k in self.callbacks:
                self.callbacks[k].load_state_dict(sd)
        _set_rng_state(state["rng_state"])
        self._epoch_rng = state.get("epoch_rng_state")
        self.batches_trained = int(trial_state["batches_trained"])
        self.epoch_idx = int(trial_state["epoch_idx"])
        self._best = trial_state.get("best")
        self._last_ckpt_at = self.batches_trained
        log.info("resumed from checkpoint %s at batch %d", storage_id, self.batches_trained)
