"""PyTorchTrialContext: what a PyTorchTrial uses to wrap models/optimizers and step them."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch

from detslurm.core import Context as CoreContext
from detslurm.core import DistributedContext, DummyDistributedContext


class LRScheduler:
    class StepMode(enum.Enum):
        STEP_EVERY_EPOCH = "STEP_EVERY_EPOCH"
        STEP_EVERY_BATCH = "STEP_EVERY_BATCH"
        MANUAL_STEP = "MANUAL_STEP"
        STEP_EVERY_OPTIMIZER_STEP = "STEP_EVERY_OPTIMIZER_STEP"

    def __init__(self, scheduler: Any, step_mode: LRScheduler.StepMode) -> None:
        self.scheduler = scheduler
        self.step_mode = step_mode


class PyTorchTrialContext:
    def __init__(
        self,
        core: Optional[CoreContext],
        hparams: dict[str, Any],
        exp_conf: dict[str, Any],
        distributed: DistributedContext,
    ) -> None:
        self._core = core
        self._hparams = dict(hparams)
        self._config = dict(exp_conf)
        self.distributed = distributed
        self.models: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[LRScheduler] = []
        self._stop_requested = False
        local = distributed.local_rank
        self.device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
        self._use_ddp = distributed.size > 1 and os.environ.get("USE_TORCH_DISTRIBUTED", "").lower() in ("1", "true")

    # -- hyperparameters and config ----------------------------------------------------------
    def get_hparams(self) -> dict[str, Any]:
        return dict(self._hparams)

    def get_hparam(self, name: str) -> Any:
        if name not in self._hparams:
            have = ", ".join(sorted(self._hparams)) or "none"
            raise KeyError(f"hyperparameter {name!r} not found; the trial has: {have}")
        return self._hparams[name]

    def get_experiment_config(self) -> dict[str, Any]:
        return dict(self._config)

    def get_data_config(self) -> dict[str, Any]:
        data: dict[str, Any] = self._config.get("data", {})
        return data

    def get_global_batch_size(self) -> int:
        if "global_batch_size" not in self._hparams:
            raise KeyError("get_global_batch_size() needs a `global_batch_size` hyperparameter")
        return int(self._hparams["global_batch_size"])

    def get_per_slot_batch_size(self) -> int:
        return max(1, self.get_global_batch_size() // self.distributed.size)

    def get_trial_id(self) -> int:
        info = self._core.info if self._core else None
        return info.trial.trial_id if info else 0

    def get_experiment_id(self) -> int:
        info = self._core.info if self._core else None
        return info.trial.experiment_id if info else 0

    # -- wrapping and stepping ---------------------------------------------------------------
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        self.models.append(model)
        if self._use_ddp:
            ids = [self.device.index] if self.device.type == "cuda" else None
            return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return model

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, backward_passes_per_step: int = 1
    ) -> torch.optim.Optimizer:
        self.optimizers.append(optimizer)
        return optimizer

    def wrap_lr_scheduler(self, lr_scheduler: Any, step_mode: LRScheduler.StepMode, frequency: int = 1) -> Any:
        self.lr_schedulers.append(LRScheduler(lr_scheduler, step_mode))
        return lr_scheduler

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, create_graph: bool = False) -> None:
        loss.backward(retain_graph=retain_graph, create_graph=create_graph)  # type: ignore[no-untyped-call]

    def step_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        clip_grads: Optional[Callable[[Iterable[torch.nn.Parameter]], None]] = None,
        auto_zero_grads: bool = True,
        scaler: Any = None,
    ) -> None:
        if clip_grads is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            clip_grads(params)
        optimizer.step()
        if auto_zero_grads:
            optimizer.zero_grad()
        for s in self.lr_schedulers:
            if s.step_mode == LRScheduler.StepMode.STEP_EVERY_OPTIMIZER_STEP:
                s.scheduler.step()

    def to_device(self, data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return data.to(self.device)
        if isinstance(data, dict):
            return {k: self.to_device(v) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return type(data)(self.to_device(v) for v in data)
        return data

    def set_stop_requested(self, stop_requested: bool) -> None:
        self._stop_requested = bool(stop_requested)

    def get_stop_requested(self) -> bool:
        return self._stop_requested

    def is_chief(self) -> bool:
        return self.distributed.rank == 0


class CheckpointLoadContext(PyTorchTrialContext):
    """A context for instantiating a trial outside training, e.g. to load a checkpoint."""

    def __init__(self, hparams: Optional[dict[str, Any]] = None) -> None:
        super().__init__(None, hparams or {}, {}, DummyDistributedContext())
