"""Determined's ``det.pytorch.deepspeed``: DeepSpeedTrial and its Trainer.

Importing it does not import DeepSpeed; wrapping an engine does."""

from detslurm.pytorch.deepspeed._context import DeepSpeedTrialContext, overwrite_deepspeed_config
from detslurm.pytorch.deepspeed._mpu import ModelParallelUnit, make_data_parallel_mpu, make_deepspeed_mpu
from detslurm.pytorch.deepspeed._trainer import Trainer, init
from detslurm.pytorch.deepspeed._trial import DeepSpeedTrial

__all__ = [
    "DeepSpeedTrial",
    "DeepSpeedTrialContext",
    "ModelParallelUnit",
    "Trainer",
    "init",
    "make_data_parallel_mpu",
    "make_deepspeed_mpu",
    "overwrite_deepspeed_config",
]
