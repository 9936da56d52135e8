"""What every part of the Trainer reads: the trial, its context and callbacks, and where training is.

The Trainer is built in layers, each a class over the one before: this state, then checkpoints
(``_trainer_checkpoints.py``), then metrics and validation (``_trainer_metrics.py``), then the
loop (``_trainer.py``). A subclass (the DeepSpeed Trainer) overrides any layer's methods.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Optional

from detslurm.pytorch._context import PyTorchTrialContext
from detslurm.pytorch._data import Shard
from detslurm.pytorch._trial import PyTorchCallback, PyTorchTrial


class _TrainerState:
    """The trial, its context and callbacks, where training is and the Trainer's settings."""

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

    def _on_cluster(self) -> bool:
        return self.core is not None and self.core.info is not None

    def _shard(self) -> Shard:
        dist = self.context.distributed
        return Shard(rank=dist.rank, size=dist.size)
