"""DeepSpeedTrialContext: the PyTorch trial context, holding DeepSpeed engines instead of
models and optimizers (the engine owns both, and its own gradient accumulation)."""

from __future__ import annotations

import json
import logging
import warnings
from typing import Any, Optional, Union

from detslurm.core import Context as CoreContext
from detslurm.pytorch._context import PyTorchTrialContext
from detslurm.pytorch.deepspeed._mpu import ModelParallelUnit, make_data_parallel_mpu, make_deepspeed_mpu

log = logging.getLogger("detslurm.pytorch.deepspeed")


def _merged(base: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in source.items():
        if key in base and isinstance(base[key], dict) and isinstance(value, dict):
            out[key] = _merged(base[key], value)
        else:
            out[key] = value
    return out


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dups = sorted({k for k in keys if keys.count(k) > 1})
    if dups:
        raise ValueError(f"duplicate key(s) in the DeepSpeed config: {', '.join(dups)}")
    return dict(pairs)


def overwrite_deepspeed_config(
    base_ds_config: Union[str, dict[str, Any]], source_ds_dict: dict[str, Any]
) -> dict[str, Any]:
    """``base_ds_config`` (a dict, or the path of a DeepSpeed JSON config) with the values of
    ``source_ds_dict`` put in, nested dicts merged key by key; neither input is changed."""
    if isinstance(base_ds_config, str):
        try:
            with open(base_ds_config) as f:
                base = json.load(f, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as e:
            raise ValueError(f"cannot read the DeepSpeed config {base_ds_config}: {e}") from None
    elif isinstance(base_ds_config, dict):
        base = base_ds_config
    else:
        raise TypeError(f"base_ds_config must be a path or a dict, not {type(base_ds_config).__name__}")
    return _merged(json.loads(json.dumps(base)), source_ds_dict)


class DeepSpeedTrialContext(PyTorchTrialContext):
    """What a DeepSpeedTrial is handed: hparams, config and the engines it wrapped."""

    def __init__(
        self,
        core_context: CoreContext,
        trial_seed: Optional[int],
        hparams: Optional[dict[str, Any]],
        slots_per_trial: int,
        num_gpus: int,
        exp_conf: Optional[dict[str, Any]],
        steps_completed: int,
        enable_tensorboard_logging: bool = True,
    ) -> None:
        super().__init__(core_context, hparams or {}, exp_conf or {}, core_context.distributed)
        self._trial_seed = trial_seed
        self._steps_completed = int(steps_completed)
        self._slots_per_trial = int(slots_per_trial)
        self._num_gpus = int(num_gpus)
        self._mpu = make_data_parallel_mpu(core_context.distributed)
        self._called_set_mpu = False
        self._use_pipeline_parallel = False
        self._manual_grad_accumulation = False
        self._data_repro_checks_disabled = False
        self._train_micro_batch_size_per_gpu: Optional[int] = None
        self._num_micro_batches_per_slot: Optional[int] = None
        self.set_enable_tensorboard_logging(enable_tensorboard_logging)

    def get_trial_seed(self) -> int:
        return super().get_trial_seed() if self._trial_seed is None else int(self._trial_seed)

    def get_initial_batch(self) -> int:
        return self._steps_completed

    def set_mpu(self, mpu: ModelParallelUnit) -> None:
        """A custom model-parallel layout (after the first ``wrap_model_engine``; once only)."""
        if not self.models:
            raise ValueError("call wrap_model_engine() before set_mpu()")
        if self._called_set_mpu:
            raise ValueError("set_mpu() may be called once per trial")
        self._called_set_mpu = True
        self._mpu = mpu

    def wrap_model_engine(self, model: Any) -> Any:
        """Registers a DeepSpeed engine (for checkpoints and evaluation); the first one sets the
        micro batch size and the micro batches per slot (its gradient accumulation steps)."""
        import deepspeed

        model = model.to(self.device)
        if isinstance(model, deepspeed.PipelineEngine):
            self._use_pipeline_parallel = True
            if not self.models:
                self._mpu = make_deepspeed_mpu(model.mpu)
        if not self.models:
            self._train_micro_batch_size_per_gpu = int(model.train_micro_batch_size_per_gpu())
            self._num_micro_batches_per_slot = int(model.gradient_accumulation_steps())
        elif model.train_micro_batch_size_per_gpu() != self._train_micro_batch_size_per_gpu:
            log.warning(
                "engine %d has another train micro batch size than the first: records are counted by the first",
                len(self.models) + 1,
            )
        self.models.append(model)
        return model

    def disable_auto_grad_accumulation(self) -> None:
        """train_batch is called once per batch (not once per micro batch): it trains on
        get_num_micro_batches_per_slot() micro batches itself."""
        self._manual_grad_accumulation = True

    def disable_dataset_reproducibility_checks(self) -> None:
        """Allows build_*_data_loader to return any torch DataLoader (its order and position
        on resume are then the trial's business)."""
        self._data_repro_checks_disabled = True

    @property
    def use_pipeline_parallel(self) -> bool:
        return self._use_pipeline_parallel

    def get_train_micro_batch_size_per_gpu(self) -> int:
        if self._train_micro_batch_size_per_gpu is None:
            raise ValueError("call wrap_model_engine() before asking for the train micro batch size")
        return self._train_micro_batch_size_per_gpu

    def get_num_micro_batches_per_slot(self) -> int:
        if self._num_micro_batches_per_slot is None:
            raise ValueError("call wrap_model_engine() before asking for the micro batches per slot")
        return self._num_micro_batches_per_slot

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        warnings.warn(
            "train_micro_batch_size_per_gpu is deprecated: call get_train_micro_batch_size_per_gpu()",
            FutureWarning,
            stacklevel=2,
        )
        return self.get_train_micro_batch_size_per_gpu()

    @property
    def num_micro_batches_per_slot(self) -> int:
        warnings.warn(
            "num_micro_batches_per_slot is deprecated: call get_num_micro_batches_per_slot()",
            FutureWarning,
            stacklevel=2,
        )
        return self.get_num_micro_batches_per_slot()
