"""Automatic mixed precision for a model's forward pass (``context.autocast_forward_pass`` and
``context.experimental.use_amp()``), and NVIDIA apex's amp under ``context.configure_apex_amp``.

The wrapper must stay the model in every other respect: user code reads its layers, saves its
state_dict and passes it to the optimizer. So it is an instance of a subclass of the model's own
class that holds no state of its own and hands every attribute to the model; only ``forward``
differs: it runs under ``torch.autocast`` and returns half-precision outputs as float32, so the
loss is computed outside the autocast region without the user wrapping it.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Optional

import torch

from detslurm.errors import DetSlurmError

log = logging.getLogger("detslurm.pytorch")

_HALF = (torch.float16, torch.bfloat16)


def to_float32(value: Any, warned: set[type]) -> Any:
    """``value`` with its half-precision tensors (nested in dicts, lists, tuples) as float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _HALF else value
    if isinstance(value, dict):
        return {k: to_float32(v, warned) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_float32(v, warned) for v in value)
    if type(value) not in warned:
        # Once per type: a model returning its own output class would log on every batch.
        warned.add(type(value))
        log.warning(
            "autocast_forward_pass: the model returned a %s; tensors inside it keep their half precision",
            type(value).__name__,
        )
    return value


def autocast_forward(model: torch.nn.Module, device_type: str) -> torch.nn.Module:
    """``model`` whose forward runs under ``torch.autocast(device_type)``."""
    warned: set[type] = set()

    # object.__setattr__ and friends are bypassed on purpose: the wrapper has no __dict__ entries,
    # so every attribute lookup falls through to __getattr__ and reaches the model itself.
    class AutocastForward(type(model)):  # type: ignore[misc]
        def __init__(self) -> None:
            pass  # no state of its own: nn.Module.__init__ would give it empty parameter dicts

        def __getattr__(self, name: str) -> Any:
            return getattr(model, name)

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(model, name, value)

        def __delattr__(self, name: str) -> None:
            delattr(model, name)

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device_type):
                out = model.forward(*args, **kwargs)
            return to_float32(out, warned)

    AutocastForward.__name__ = AutocastForward.__qualname__ = f"AutocastForward[{type(model).__name__}]"
    return AutocastForward()


class ApexError(DetSlurmError):
    """configure_apex_amp() refused: apex is missing, or the trial's setup cannot use it."""


APEX_MISSING = (
    "context.configure_apex_amp() needs NVIDIA apex (github.com/NVIDIA/apex, built with its CUDA "
    "extensions) in the trial's environment; or, as Determined itself recommends, use torch's AMP "
    "instead: context.experimental.use_amp(), or context.autocast_forward_pass(model) with "
    "context.wrap_scaler(torch.amp.GradScaler('cuda'))"
)


def import_apex_amp() -> Any:
    """apex.amp, or ApexError naming what to install and torch's own AMP."""
    try:
        return importlib.import_module("apex.amp")  # by name: apex is the user's, never a dependency
    except ImportError:
        raise ApexError(APEX_MISSING) from None


class ApexAmp:
    """NVIDIA apex's amp as Determined's context drives it once configure_apex_amp() ran: each
    backward scales its loss (``amp.scale_loss``), and the optimizer steps on (and clips) apex's
    master parameters. Determined allows one backward per batch under apex."""

    def __init__(self, amp: Any, num_losses: int) -> None:
        self.amp = amp
        self.num_losses = num_losses
        self._last_backward_batch: Optional[int] = None

    def backward(self, loss: torch.Tensor, optimizers: list[Any], batch_idx: int, **backward_args: Any) -> None:
        if self._last_backward_batch == batch_idx:
            raise ApexError(
                "context.backward(loss) may be called once per batch while using apex.amp (as in Determined)"
            )
        self._last_backward_batch = batch_idx
        # loss_id 0: Determined numbers losses by tensor, a new id for every batch's loss, which
        # apex refuses once past num_losses; one loss per batch is apex's single loss scale.
        with self.amp.scale_loss(loss, optimizers, loss_id=0) as scaled:
            scaled.backward(**backward_args)

    def master_params(self, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
        return list(self.amp.master_params(optimizer))
