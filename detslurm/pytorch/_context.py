"""PyTorchTrialContext: what a PyTorchTrial uses to wrap models/optimizers and step them."""

from __future__ import annotations

import enum
import logging
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch

from detslurm.core import Context as CoreContext
from detslurm.core import DistributedContext, DummyDistributedContext
from detslurm.expconf.view import ConfigView
from detslurm.pytorch._amp import ApexAmp, ApexError, autocast_forward, import_apex_amp
from detslurm.pytorch._reducer import ReducerContext

log = logging.getLogger("detslurm.pytorch")


class _DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """DDP through which the model's own attributes stay reachable (``self.model.weight``,
    ``self.model.encode(...)``), as through the DDP wrapper Determined's wrap_model returns."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


class PyTorchExperimentalContext:
    """``context.experimental``: Determined's switches for automatic mixed precision and for
    the Trainer's own handling of batches."""

    def __init__(self, parent: PyTorchTrialContext) -> None:
        self._parent = parent
        self._auto_amp = False
        self._auto_to_device = True

    def use_amp(self) -> None:
        """Mixed precision with no code in train_batch: models wrapped after this call run their
        forward pass under ``torch.autocast`` (outputs come back as float32), and on CUDA a
        GradScaler is wrapped (backward() scales the loss, step_optimizer() steps through it).
        Call it before ``wrap_model``."""
        if self._parent.models:
            raise RuntimeError("context.experimental.use_amp() must be called before context.wrap_model()")
        if self._parent.device.type == "cuda":
            # float16 needs loss scaling; the CPU's bfloat16 has float32's range and needs none.
            self._parent.wrap_scaler(torch.amp.GradScaler("cuda"))
        self._auto_amp = True

    def disable_dataset_reproducibility_checks(self) -> None:
        pass  # nothing is checked: a plain torch DataLoader is accepted as it is

    def disable_auto_to_device(self) -> None:
        """The Trainer hands batches to train_batch/evaluate_batch as the loader made them,
        without moving them to the device first (call ``context.to_device`` yourself)."""
        self._auto_to_device = False


class LRScheduler:
    class StepMode(enum.Enum):
        # Determined's values: code that stores or passes the number (StepMode(2)) keeps working.
        STEP_EVERY_EPOCH = 1
        STEP_EVERY_BATCH = 2
        MANUAL_STEP = 3
        STEP_EVERY_OPTIMIZER_STEP = 4

    def __init__(self, scheduler: Any, step_mode: LRScheduler.StepMode, frequency: int = 1) -> None:
        if not isinstance(step_mode, LRScheduler.StepMode):
            raise TypeError(f"wrap_lr_scheduler: step_mode must be an LRScheduler.StepMode, not {step_mode!r}")
        if frequency < 1:
            raise ValueError(f"wrap_lr_scheduler: frequency must be >= 1 (got {frequency})")
        self.scheduler = scheduler
        self.step_mode = step_mode
        self.frequency = frequency
        self._calls = 0

    def step_due(self) -> None:
        """One occurrence of this scheduler's unit; the scheduler steps every ``frequency``."""
        # Counted here, not read from the scheduler: `frequency` is Determined's, and torch's
        # schedulers know nothing of it.
        self._calls += 1
        if self._calls % self.frequency == 0:
            self.scheduler.step()

    def step(self, *args: Any, **kwargs: Any) -> None:
        """The wrapped scheduler's step(), as called by hand (MANUAL_STEP)."""
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return list(self.scheduler.get_last_lr())

    def state_dict(self) -> Any:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.scheduler.load_state_dict(state_dict)


class PyTorchTrialContext(ReducerContext):
    def __init__(
        self,
        core: Optional[CoreContext],
        hparams: dict[str, Any],
        exp_conf: dict[str, Any],
        distributed: DistributedContext,
        aggregation_frequency: int = 1,
    ) -> None:
        self._core = core
        self._hparams = dict(hparams)
        self._config = dict(exp_conf)
        super().__init__(distributed)
        self.models: list[torch.nn.Module] = []
        # `models` holds the bare modules (their state_dicts are what checkpoints store, without
        # DDP's "module." prefix); the DDP wrappers are kept apart for training.
        self._wrapped_models: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[LRScheduler] = []
        self._scaler: Any = None
        self._apex: Optional[ApexAmp] = None  # set by configure_apex_amp()
        self._scaler_stepped = False
        self._stop_requested = False
        self.experimental = PyTorchExperimentalContext(self)
        # Determined's default: the Trainer writes its metrics for TensorBoard (set_enable_tensorboard_logging).
        self._enable_tensorboard_logging = True
        # A torch.profiler.profile set by set_profiler(); the Trainer runs and steps it.
        self.profiler: Any = None
        if aggregation_frequency < 1:
            raise ValueError(f"aggregation_frequency must be >= 1 (got {aggregation_frequency})")
        self._aggregation_frequency = int(aggregation_frequency)
        # Determined's default: accumulated gradients are averaged, so changing aggregation_frequency
        # does not change the effective learning rate.
        self._average_aggregated = ConfigView(self._config).average_aggregated_gradients
        self._per_optimizer_average: dict[int, bool] = {}
        # Set by the Trainer before each train_batch: the optimizer steps on every
        # aggregation_frequency-th batch only (gradients accumulate in between).
        self._current_batch_idx = 0
        # The batch Trainer.fit resumes at, set before it builds the loaders (None outside fit).
        self._initial_batch: Optional[int] = None
        self._epoch_len = 1
        local = distributed.local_rank
        # One GPU per rank, chosen by local rank: the launchers start one process per slot on a
        # node, and Slurm's GPU binding makes the node's slots visible as cuda:0..n-1.
        self.device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
        # Without CUDA every tensor already lives on the only device: to_device has nothing to move.
        self._cpu_only = not torch.cuda.is_available()
        # DDP only when a torch.distributed process group exists (the launcher or the harness set
        # this flag); a DistributedContext alone may be backed by other collectives.
        self._use_ddp = distributed.size > 1 and os.environ.get("USE_TORCH_DISTRIBUTED", "").lower() in ("1", "true")

    # -- hyperparameters and config ----------------------------------------------------------
    def get_hparams(self) -> dict[str, Any]:
        return dict(self._hparams)

    def get_hparam(self, name: str) -> Any:
        if name in self._hparams:
            return self._hparams[name]
        # ValueError, as Determined raises. Off-cluster with none given, say where they come from.
        if self._hparams or (self._core is not None and self._core.info is not None):
            have = ", ".join(sorted(self._hparams)) or "none"
            raise ValueError(f"hyperparameter {name!r} not found; the trial has: {have}")
        raise ValueError(
            f"hyperparameter {name!r} is not set: off-cluster, hyperparameters come from "
            "det.pytorch.init(hparams={...}); under det e create, from the config's hyperparameters"
        )

    def get_experiment_config(self) -> dict[str, Any]:
        return dict(self._config)

    def get_data_config(self) -> dict[str, Any]:
        return ConfigView(self._config).data

    def _batch_sizes(self) -> tuple[int, int]:
        """(per-slot, effective global) as Determined computes them: the global batch size is
        rounded down to a multiple of the number of slots, with a warning."""
        if "global_batch_size" not in self._hparams:
            raise KeyError("get_global_batch_size() needs a `global_batch_size` hyperparameter")
        raw = self._hparams["global_batch_size"]
        # bool is an int subclass: `global_batch_size: true` must not pass as 1.
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or int(raw) != raw or raw < 1:
            raise ValueError(f"hyperparameters.global_batch_size must be a positive integer (got {raw!r})")
        slots = self.distributed.size
        if raw < slots:
            raise ValueError(f"hyperparameters.global_batch_size ({int(raw)}) must be >= the number of slots ({slots})")
        per_slot = int(raw) // slots
        if per_slot * slots != raw and not getattr(self, "_warned_rounding", False):
            self._warned_rounding = True
            log.warning(
                "global_batch_size changed from %d to %d to divide equally across %d slots",
                raw,
                per_slot * slots,
                slots,
            )
        return per_slot, per_slot * slots

    def get_global_batch_size(self) -> int:
        return self._batch_sizes()[1]

    def get_per_slot_batch_size(self) -> int:
        return self._batch_sizes()[0]

    def get_trial_seed(self) -> int:
        """The seed of the data order (and of init()'s RNG seeding): the trial's seed on a
        cluster, else reproducibility.experiment_seed from the config, else 0."""
        info = self._core.info if self._core else None
        if info is not None:
            return int(info.trial.trial_seed)
        return ConfigView(self._config).experiment_seed

    def get_initial_batch(self) -> int:
        """The batch a resumed trial starts at (0 on a fresh start and off-cluster): what a
        SkipBatchSampler skips in a torch loader built from det.pytorch.samplers."""
        if self._initial_batch is not None:
            return self._initial_batch
        info = self._core.info if self._core else None
        return int(info.trial._steps_completed) if info is not None else 0

    def get_trial_id(self) -> int:
        info = self._core.info if self._core else None
        return info.trial.trial_id if info else 0

    def get_experiment_id(self) -> int:
        info = self._core.info if self._core else None
        return info.trial.experiment_id if info else 0

    # -- wrapping and stepping ---------------------------------------------------------------
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Moves the model to this rank's device; under torch.distributed (more than one
        process) it returns it wrapped in DistributedDataParallel, which averages gradients."""
        model = model.to(self.device)
        self.models.append(model)
        wrapped = model
        if self._use_ddp:
            # device_ids must be None for CPU modules (gloo); on GPU it pins DDP to this rank's device.
            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = _DistributedDataParallel(model, device_ids=ids)
            self._wrapped_models.append(wrapped)
        if self.experimental._auto_amp:
            wrapped = self.autocast_forward_pass(wrapped)
        return wrapped

    def autocast_forward_pass(self, to_wrap: torch.nn.Module) -> torch.nn.Module:
        """``to_wrap`` whose forward pass runs under ``torch.autocast`` for this rank's device,
        with half-precision outputs returned as float32 (so the loss needs no autocast). It is
        the same model otherwise: attributes, parameters and state_dict are the model's."""
        return autocast_forward(to_wrap, self.device.type)

    def wrap_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        backward_passes_per_step: int = 1,
        fp16_compression: Optional[bool] = None,
        average_aggregated_gradients: Optional[bool] = None,
    ) -> torch.optim.Optimizer:
        """Registers the optimizer for checkpoints and step_optimizer(). Gradient aggregation is
        set with optimizations.aggregation_frequency (or pytorch.init(aggregation_frequency=))."""
        if backward_passes_per_step != 1:
            raise NotImplementedError(
                "wrap_optimizer(backward_passes_per_step=...) is Horovod-only and not supported by the "
                "detslurm Trainer: set optimizations.aggregation_frequency instead"
            )
        if fp16_compression:
            raise NotImplementedError("wrap_optimizer(fp16_compression=True) is Horovod-only and not supported")
        if average_aggregated_gradients is not None:
            # Keyed by id(): optimizers are not hashable by value, and the object lives as long as the
            # context holds it in self.optimizers.
            self._per_optimizer_average[id(optimizer)] = bool(average_aggregated_gradients)
        self.optimizers.append(optimizer)
        return optimizer

    def wrap_lr_scheduler(self, lr_scheduler: Any, step_mode: LRScheduler.StepMode, frequency: int = 1) -> Any:
        """The Trainer steps it per ``step_mode`` (every ``frequency`` batches / epochs /
        optimizer steps); MANUAL_STEP leaves stepping to you. Its state is checkpointed."""
        # The user's own scheduler is returned, not the wrapper, as Determined does, so their code
        # can keep calling it directly.
        self.lr_schedulers.append(LRScheduler(lr_scheduler, step_mode, frequency))
        return lr_scheduler

    def wrap_scaler(self, scaler: Any) -> Any:
        """A torch.amp.GradScaler (CPU or CUDA), checkpointed with the trial. Used as
        Determined documents it: the trial scales the loss (``backward(scaler.scale(loss))``),
        unscales before clipping, passes it to ``step_optimizer(opt, scaler=scaler)`` and calls
        ``update()``; only ``experimental.use_amp()`` does these itself."""
        if self._scaler is not None:
            raise ValueError("wrap_scaler() may be called once per trial")
        if self._apex is not None:
            raise ApexError("Do not mix APEX with PyTorch AMP (configure_apex_amp was called).")
        self._scaler = scaler
        return scaler

    def configure_apex_amp(
        self,
        models: Union[torch.nn.Module, list[torch.nn.Module]],
        optimizers: Union[torch.optim.Optimizer, list[torch.optim.Optimizer]],
        enabled: Optional[bool] = True,
        opt_level: Optional[str] = "O1",
        cast_model_type: Optional[torch.dtype] = None,
        patch_torch_functions: Optional[bool] = None,
        keep_batchnorm_fp32: Optional[Union[bool, str]] = None,
        master_weights: Optional[bool] = None,
        loss_scale: Optional[Union[float, str]] = None,
        cast_model_outputs: Optional[torch.dtype] = None,
        num_losses: Optional[int] = 1,
        verbosity: Optional[int] = 1,
        min_loss_scale: Optional[float] = None,
        max_loss_scale: Optional[float] = 2.0**24,
    ) -> tuple[Any, Any]:
        """NVIDIA apex's mixed precision for models and optimizers already wrapped:
        ``apex.amp.initialize`` with these arguments, then every backward() scales its loss and
        step_optimizer() steps apex's master parameters. As in Determined: deprecated in favour
        of torch's AMP, GPU slots only, and ``enabled=False`` returns them untouched."""
        if not enabled:
            return models, optimizers
        if self._scaler is not None and self._scaler.is_enabled():
            raise ApexError("Do not mix APEX with PyTorch AMP (context.wrap_scaler or use_amp was called).")
        warnings.warn(
            "PyTorchTrial support for NVIDIA/apex has been deprecated and will be removed in a future version. "
            "We recommend users to migrate to Torch AMP (`torch.cuda.amp`).",
            FutureWarning,
            stacklevel=2,
        )
        if self._apex is not None:
            raise ApexError("Please only call configure_apex_amp once.")
        if self.distributed.size > 1 and num_losses != 1:
            raise ApexError("With several slots, configure_apex_amp takes num_losses=1 only (as in Determined).")
        if self.distributed.size > 1 and self._aggregation_frequency > 1:
            raise ApexError("configure_apex_amp does not work with several slots and aggregation_frequency > 1.")
        amp = import_apex_amp()
        if not torch.cuda.is_available():
            raise ApexError("context.configure_apex_amp is supported only on GPU slots.")
        many = isinstance(models, list)
        bare = [self._bare_model(m) for m in _as_list(models)]
        log.info("Enabling mixed precision training with opt_level: %s.", opt_level)
        new_models, new_optimizers = amp.initialize(
            models=bare if many else bare[0],
            optimizers=optimizers,
            enabled=enabled,
            opt_level=opt_level,
            cast_model_type=cast_model_type,
            patch_torch_functions=patch_torch_functions,
            keep_batchnorm_fp32=keep_batchnorm_fp32,
            master_weights=master_weights,
            loss_scale=loss_scale,
            cast_model_outputs=cast_model_outputs,
            num_losses=num_losses,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            verbosity=verbosity if self.distributed.rank == 0 else 0,
        )
        self._apex = ApexAmp(amp, int(num_losses or 1))
        # apex's modules and optimizers replace those it was given (the same objects unless the
        # opt_level made new ones), so that the Trainer steps and checkpoints them.
        out = [self._rewrap(old, new) for old, new in zip(bare, _as_list(new_models), strict=True)]
        for old_opt, new_opt in zip(_as_list(optimizers), _as_list(new_optimizers), strict=True):
            self.optimizers = [new_opt if o is old_opt else o for o in self.optimizers]
        return (out if many else out[0]), new_optimizers

    def _bare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module wrap_model() was given, for what it returned (apex initializes the module
        itself, then DDP wraps it again)."""
        for i, w in enumerate(self._wrapped_models):
            if w is model:
                return self.models[i]
        if not any(m is model for m in self.models):
            raise ApexError("configure_apex_amp() takes the models that context.wrap_model() returned")
        return model

    def _rewrap(self, old: torch.nn.Module, new: torch.nn.Module) -> torch.nn.Module:
        """Put apex's module where ``old`` was; under DDP, a new wrapper around it (returned)."""
        i = next(i for i, m in enumerate(self.models) if m is old)
        self.models[i] = new
        if not self._use_ddp:
            return new
        ids = [self.device.index] if self.device.type == "cuda" else None
        self._wrapped_models[i] = _DistributedDataParallel(new, device_ids=ids)
        return self._wrapped_models[i]

    def _should_communicate_and_update(self) -> bool:
        return (self._current_batch_idx + 1) % self._aggregation_frequency == 0

    def backward(
        self,
        loss: torch.Tensor,
        gradient: Optional[torch.Tensor] = None,
        retain_graph: bool = False,
        create_graph: bool = False,
    ) -> None:
        """loss.backward(), through the wrapped GradScaler or apex's amp when there is one."""
        if self._apex is not None:
            args = {"gradient": gradient, "retain_graph": retain_graph, "create_graph": create_graph}
            return self._apex.backward(loss, self.optimizers, self._current_batch_idx, **args)
        if self._scaler is not None and self.experimental._auto_amp:
            loss = self._scaler.scale(loss)
        loss.backward(gradient=gradient, retain_graph=retain_graph, create_graph=create_graph)  # type: ignore[no-untyped-call]

    def step_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        clip_grads: Optional[Callable[[Iterable[torch.nn.Parameter]], None]] = None,
        auto_zero_grads: bool = True,
        scaler: Any = None,
    ) -> None:
        """Steps on every aggregation_frequency-th batch only (in between, gradients add up and
        are divided by the frequency when averaging); zeroes the gradients after a step."""
        if not any(o is optimizer for o in self.optimizers):
            raise ValueError("step_optimizer() got an optimizer that was not passed to context.wrap_optimizer()")
        # Between aggregation steps nothing is stepped or zeroed: gradients keep accumulating.
        if not self._should_communicate_and_update():
            return

        def params() -> list[torch.nn.Parameter]:
            if self._apex is not None:  # apex keeps fp32 master copies: those are stepped and clipped
                return self._apex.master_params(optimizer)
            return [p for g in optimizer.param_groups for p in g["params"]]

        average = self._per_optimizer_average.get(id(optimizer), self._average_aggregated)
        if self._aggregation_frequency > 1 and average:
            for p in params():
                if p.grad is not None:
                    p.grad.div_(self._aggregation_frequency)
        # The wrapped scaler is used unasked under use_amp() only; with wrap_scaler() the trial
        # passes it, unscales and updates it itself (Determined's rule: doing either twice breaks).
        auto = self.experimental._auto_amp and self._scaler is not None
        scaler = scaler if scaler is not None else (self._scaler if auto else None)
        if clip_grads is not None:
            if auto:
                self._scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            clip_grads(params())
        if scaler is not None:
            scaler.step(optimizer)
            # Under use_amp() the Trainer calls update() after the batch, only when a step went
            # through the scaler: update() without a step in between raises in torch.
            self._scaler_stepped = auto
        else:
            optimizer.step()
        if auto_zero_grads:
            optimizer.zero_grad()
        for sched in self.lr_schedulers:
            if sched.step_mode == LRScheduler.StepMode.STEP_EVERY_OPTIMIZER_STEP:
                sched.step_due()

    def to_device(self, data: Any) -> Any:
        """Tensors in ``data`` (nested dicts, lists, tuples) moved to this rank's device."""
        if self._cpu_only:
            return data
        if isinstance(data, torch.Tensor):
            return data.to(self.device)
        if isinstance(data, dict):
            return {k: self.to_device(v) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return type(data)(self.to_device(v) for v in data)
        return data

    def set_stop_requested(self, stop_requested: bool) -> None:
        # Only a flag: the Trainer reads it after the batch, then reports, checkpoints and stops
        # (Determined's early stop by the trial itself).
        self._stop_requested = bool(stop_requested)

    def get_stop_requested(self) -> bool:
        return self._stop_requested

    def is_chief(self) -> bool:
        return self.distributed.rank == 0

    # -- where training is (set by the Trainer before each train_batch) ------------------------
    def current_train_batch(self) -> int:
        """The index of the batch being trained, counted from the start of training."""
        return self._current_batch_idx

    def current_train_epoch(self) -> int:
        return self._current_batch_idx // self._epoch_len

    def is_epoch_start(self) -> bool:
        return self._current_batch_idx % self._epoch_len == 0

    def is_epoch_end(self) -> bool:
        return (self._current_batch_idx + 1) % self._epoch_len == 0

    def get_tensorboard_writer(self) -> Any:
        raise NotImplementedError(
            "context.get_tensorboard_writer() is not supported by detslurm: report metrics through the Trainer "
            "(train_batch / evaluate_batch return values) instead"
        )

    def set_enable_tensorboard_logging(self, enable_tensorboard_logging: bool) -> None:
        """Whether the chief's own TensorBoard files (written under get_tensorboard_path()) are
        uploaded to the trial's TensorBoard dir; the reported metrics' TensorBoard files are
        written by the controller from the stored metrics either way."""
        if not isinstance(enable_tensorboard_logging, bool):
            raise TypeError(
                f"set_enable_tensorboard_logging() takes a bool, not {type(enable_tensorboard_logging).__name__}"
            )
        self._enable_tensorboard_logging = enable_tensorboard_logging
        if self._core is not None:
            self._core.train._set_auto_upload(enable_tensorboard_logging)

    def get_enable_tensorboard_logging(self) -> bool:
        return self._enable_tensorboard_logging

    def set_profiler(self, *args: Any, **kwargs: Any) -> None:
        """Profile training with ``torch.profiler.profile(*args, **kwargs)``; its traces go to
        this rank's TensorBoard path (``on_trace_ready`` is set here), where the PyTorch profiler
        plugin of TensorBoard reads them. The Trainer starts it and steps it after every batch."""
        if "on_trace_ready" in kwargs:
            raise ValueError("set_profiler(): on_trace_ready is set by the Trainer (the TensorBoard path); drop it")
        handler = torch.profiler.tensorboard_trace_handler(str(self.get_tensorboard_path()))
        self.profiler = torch.profiler.profile(*args, on_trace_ready=handler, **kwargs)

    def get_tensorboard_path(self) -> Any:
        """Where this rank may write its own TensorBoard files (the Core API's path); the chief's
        are uploaded into the trial's TensorBoard dir, where `det tensorboard` shows them. The
        Trainer's reported metrics need nothing here: the controller writes them itself."""
        if self._core is None:
            raise NotImplementedError("context.get_tensorboard_path() needs a trial context (det.pytorch.init())")
        return self._core.train.get_tensorboard_path()


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


class CheckpointLoadContext(PyTorchTrialContext):
    """A context for instantiating a trial outside training, e.g. to load a checkpoint."""

    def __init__(self, hparams: Optional[dict[str, Any]] = None, exp_conf: Optional[dict[str, Any]] = None) -> None:
        # No core context and one rank: loading a checkpoint needs no cluster, no process group.
        super().__init__(None, hparams or {}, exp_conf or {}, DummyDistributedContext())
