"""``pytorch.init()``: the Trainer API's entry point, on a trial and off-cluster alike."""

from __future__ import annotations

import contextlib
import gc
import os
import random
from collections.abc import Iterator
from typing import Any, Optional

import torch

from detslurm import core
from detslurm.core import DistributedContext, PreemptMode, get_cluster_info
from detslurm.pytorch._context import PyTorchTrialContext


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        # numpy accepts only 32-bit seeds; the trial seed may be larger.
        np.random.seed(seed % (2**32))
    except ImportError:
        pass


@contextlib.contextmanager
def init(
    *,
    hparams: Optional[dict[str, Any]] = None,
    exp_conf: Optional[dict[str, Any]] = None,
    distributed: Optional[DistributedContext] = None,
    aggregation_frequency: int = 1,
    enable_tensorboard_logging: bool = True,
) -> Iterator[PyTorchTrialContext]:
    """The trial context for a Trainer (Determined's ``pytorch.init()``): hparams and config from
    the trial, or the arguments off-cluster; joins torch.distributed when a launcher asked for it."""
    info = get_cluster_info()
    we_started_pg = False
    if info is not None:
        hparams = info.trial.hparams if hparams is None else hparams
        exp_conf = info.trial._config if exp_conf is None else exp_conf
        # Seeded from the trial's own seed (DET_TRIAL_SEED), as Determined does, so a rerun of the
        # same trial draws the same numbers. Off-cluster nothing is seeded.
        _seed(info.trial.trial_seed)
    if distributed is None and os.environ.get("USE_TORCH_DISTRIBUTED", "").lower() in ("1", "true"):
        import torch.distributed as dist

        # The user may have set up the process group already (or a launcher did): then it is theirs
        # to destroy, and we only wrap it.
        if not dist.is_initialized():
            # NCCL only works between GPUs; CPU-only trials (and the test cluster) need gloo.
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            we_started_pg = True
        distributed = DistributedContext.from_torch_distributed()
    # WorkersAskChief: only the chief polls for preemption and broadcasts the answer, so every
    # rank stops at the same batch (a rank stopping alone would hang the others in a collective).
    with core.init(distributed=distributed, preempt_mode=PreemptMode.WorkersAskChief) as core_context:
        ctx = PyTorchTrialContext(
            core_context, hparams or {}, exp_conf or {}, core_context.distributed, aggregation_frequency
        )
        ctx.set_enable_tensorboard_logging(enable_tensorboard_logging)
        try:
            yield ctx
        finally:
            if we_started_pg:
                import torch.distributed as dist

                # Release everything holding the process group before destroying it (the
                # torch 2.13 + gloo exit crash otherwise hits 20-40 % of runs).
                dist.barrier()
                ctx.models.clear()
                ctx.optimizers.clear()
                gc.collect()
                dist.destroy_process_group()
