"""Checkpoint contents in Determined's layout, and ``load_trial_from_checkpoint_path``.

A checkpoint dir holds ``state_dict.pth`` (models_state_dict, optimizers_state_dict,
lr_schedulers_state_dict, callbacks, rng_state, scaler_state_dict when a scaler is wrapped),
``trial_state.pkl`` (batches/epochs trained, trial id: Determined's fields, no others),
``trainer_state.json`` (the best searcher metric so far), ``load_data.json`` (how to rebuild the
trial) and ``metadata.json`` (written by the Core API). ``state_dict.pth`` and ``trial_state.pkl``
are pickles: load checkpoints you (or your trials) wrote, never ones from strangers.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from detslurm.pytorch._context import CheckpointLoadContext, PyTorchTrialContext
from detslurm.pytorch._data import epoch_start_state, set_epoch_start_state

STATE_FILE = "state_dict.pth"
TRIAL_STATE_FILE = "trial_state.pkl"
TRAINER_STATE_FILE = "trainer_state.json"  # what detslurm's Trainer keeps beside Determined's fields
LOAD_DATA_FILE = "load_data.json"


def rng_state() -> dict[str, Any]:
    """Every RNG a trial may draw from, under Determined's key names."""
    state: dict[str, Any] = {"cpu_rng_state": torch.get_rng_state(), "random_rng_state": random.getstate()}
    try:
        import numpy as np

        state["np_rng_state"] = np.random.get_state()
    except ImportError:
        pass
    # Only when a GPU is visible: torch.cuda.get_rng_state would initialise CUDA (and fail)
    # on a CPU node.
    if torch.cuda.is_available():
        state["gpu_rng_state"] = torch.cuda.get_rng_state()
    # The shuffled det DataLoader's order for the epoch in progress (detslurm/pytorch/_data.py);
    # Determined reads only its own keys.
    state["detslurm_epoch_start"] = epoch_start_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    # The optional keys (numpy, GPU) depend on what was installed and visible when the
    # checkpoint was written; the CPU and Python RNGs are always there. The states go back to the
    # CPU first: torch only takes a CPU ByteTensor, and a checkpoint loaded with
    # map_location=<the GPU> (as the Trainer resumes on one) has moved them there.
    torch.set_rng_state(state["cpu_rng_state"].cpu())
    random.setstate(state["random_rng_state"])
    if "np_rng_state" in state:
        import numpy as np

        np.random.set_state(state["np_rng_state"])
    # A checkpoint saved on a GPU node may be loaded on a CPU one; its GPU RNG is then unused.
    if "gpu_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["gpu_rng_state"].cpu())
    set_epoch_start_state(state.get("detslurm_epoch_start") or {})


def trial_state_dict(ctx: PyTorchTrialContext, callbacks: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {
        "models_state_dict": [m.state_dict() for m in ctx.models],
        "optimizers_state_dict": [o.state_dict() for o in ctx.optimizers],
        "lr_schedulers_state_dict": [s.state_dict() for s in ctx.lr_schedulers],
        "callbacks": {k: cb.state_dict() for k, cb in callbacks.items()},
        "rng_state": rng_state(),
    }
    if ctx._scaler is not None:
        state["scaler_state_dict"] = ctx._scaler.state_dict()
    return state


def _check_counts(what: str, have: int, saved: int) -> None:
    if have != saved:
        raise ValueError(
            f"the checkpoint holds {saved} {what} but the trial wrapped {have}: "
            "wrap the same models/optimizers/schedulers, in the same order, as the run that saved it"
        )


def load_trial_state(ctx: PyTorchTrialContext, state: dict[str, Any]) -> None:
    """Models, optimizers, schedulers and scaler from ``state`` into what ``ctx`` wrapped."""
    pairs: tuple[tuple[str, list[Any], list[Any]], ...] = (
        ("models", ctx.models, state.get("models_state_dict", [])),
        ("optimizers", ctx.optimizers, state.get("optimizers_state_dict", [])),
        ("lr schedulers", ctx.lr_schedulers, state.get("lr_schedulers_state_dict", [])),
    )
    for what, objs, saved in pairs:
        # zip(strict=True) below would also fail, but without telling the user what to change.
        _check_counts(what, len(objs), len(saved))
        for obj, sd in zip(objs, saved, strict=True):
            if what == "models":
                # Determined's multi-slot checkpoints hold the DDP wrapper's keys ("module.x");
                # the models here are the unwrapped ones.
                torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")
            obj.load_state_dict(sd)
    if ctx._scaler is not None and "scaler_state_dict" in state:
        ctx._scaler.load_state_dict(state["scaler_state_dict"])


def load_data(trial: Any, ctx: PyTorchTrialContext) -> dict[str, Any]:
    cls = type(trial)
    return {
        # Determined's name of the trial API (PyTorchTrial or DeepSpeedTrial) for its loaders.
        "trial_type": getattr(cls, "_trial_type", "PyTorchTrial"),
        # Enough for load_trial_from_checkpoint_path to re-import the class from the checkpoint's
        # code/ copy; a class defined in __main__ cannot be found again that way (refused on load).
        "trial_cls_spec": f"{cls.__module__}:{cls.__qualname__}",
        "is_trainer": True,
        "hparams": ctx.get_hparams(),
        # Determined's loader reads this key (None when there is no config, as it writes).
        "experiment_config": ctx.get_experiment_config() or None,
    }


def _import_trial_class(spec: str, code_dir: Path) -> Any:
    module_name, _, qualname = spec.partition(":")
    if not module_name or not qualname or module_name == "__main__":
        raise ValueError(
            f"the checkpoint names its trial class {spec!r}, which cannot be imported: "
            "pass trial_class= to load_trial_from_checkpoint_path"
        )
    if code_dir.is_dir():
        # The checkpoint's own code/ first: the model must be rebuilt by the code that saved it,
        # not by whatever version of model_def.py is on the path now.
        sys.path.insert(0, str(code_dir))
    try:
        obj: Any = importlib.import_module(module_name)
    finally:
        if code_dir.is_dir():
            sys.path.remove(str(code_dir))
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def load_trial_from_checkpoint_path(
    path: str | os.PathLike[str],
    trial_class: Optional[type] = None,
    trial_kwargs: Optional[dict[str, Any]] = None,
    torch_load_kwargs: Optional[dict[str, Any]] = None,
    **kwargs: Any,
) -> Any:
    """A PyTorchTrial rebuilt from a checkpoint dir, with its models, optimizers and schedulers
    loaded; the trial gets a CheckpointLoadContext carrying the saved hyperparameters.

    Without ``trial_class`` the class is imported from the checkpoint's ``code/`` dir by the
    spec in load_data.json. ``state_dict.pth`` is unpickled: trusted checkpoints only.
    ``**kwargs`` is Determined's older spelling of ``torch_load_kwargs`` (deprecated there too)."""
    if kwargs:
        if torch_load_kwargs:
            raise ValueError(
                "load_trial_from_checkpoint_path(): pass torch.load's arguments once, in torch_load_kwargs"
            )
        warnings.warn(
            "load_trial_from_checkpoint_path(**kwargs) is deprecated: pass torch_load_kwargs={...}",
            FutureWarning,
            stacklevel=2,
        )
        torch_load_kwargs = kwargs
    root = Path(path)
    if not (root / STATE_FILE).is_file():
        raise FileNotFoundError(f"{root} is not a Trainer checkpoint: it has no {STATE_FILE}")
    meta: dict[str, Any] = {}
    if (root / LOAD_DATA_FILE).is_file():
        loaded = json.loads((root / LOAD_DATA_FILE).read_text())
        meta = loaded if isinstance(loaded, dict) else {}
    if trial_class is None:
        spec = meta.get("trial_cls_spec")
        if not isinstance(spec, str):
            raise ValueError(f"{root / LOAD_DATA_FILE} names no trial class: pass trial_class=")
        trial_class = _import_trial_class(spec, root / "code")
    hparams = meta.get("hparams")
    context = CheckpointLoadContext(hparams if isinstance(hparams, dict) else {})
    trial = trial_class(context, **(trial_kwargs or {}))
    # weights_only=False: the state holds optimizer and RNG objects that torch's safe loader
    # refuses (hence "trusted checkpoints only"). map_location lets a GPU checkpoint load on a CPU.
    load_kwargs = {"map_location": context.device, "weights_only": False, **(torch_load_kwargs or {})}
    state = torch.load(root / STATE_FILE, **load_kwargs)
    load_trial_state(context, state)
    return trial
