"""``det.experimental.test_one_batch``: a trial class trained for one batch and validated on
one batch, in this process (Determined's quick check of a trial before submitting it)."""

from __future__ import annotations

import logging
from typing import Any, Optional

from detslurm.expconf.view import ConfigView

log = logging.getLogger("detslurm.pytorch")


def test_one_batch(trial_class: Any, config: Optional[dict[str, Any]] = None) -> Any:
    """Train ``trial_class`` (a PyTorchTrial or a DeepSpeedTrial) for one batch in test mode,
    with the hyperparameters of ``config["hyperparameters"]`` and ``config`` as its experiment
    config; nothing is returned, an error in the trial is raised."""
    import detslurm.pytorch.deepspeed as deepspeed
    from detslurm import pytorch

    # Determined's override: one batch is the scheduling unit.
    config = {**(config or {}), "scheduling_unit": 1}
    hparams = ConfigView(config).hyperparameters
    if isinstance(trial_class, type) and issubclass(trial_class, pytorch.PyTorchTrial):
        api: Any = pytorch
    elif isinstance(trial_class, type) and issubclass(trial_class, deepspeed.DeepSpeedTrial):
        api = deepspeed
    else:
        raise TypeError(f"test_one_batch() takes a PyTorchTrial or DeepSpeedTrial class, not {trial_class!r}")
    log.info("Running a minimal test experiment locally")
    with api.init(hparams=hparams, exp_conf=config, enable_tensorboard_logging=False) as context:
        trial = trial_class(context)
        api.Trainer(trial, context).fit(max_length=pytorch.Batch(1), test_mode=True)
    log.info("The test experiment passed.")
