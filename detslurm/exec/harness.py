"""``python -m detslurm.exec.harness module:TrialClass``: run a legacy PyTorchTrial on a trial.

What ``--trial`` and ``entrypoint: model_def:Class`` lead to. The experiment config supplies
what ``Trainer.fit()`` would otherwise be told: min_checkpoint_period, min_validation_period,
scheduling_unit (the reporting period), checkpoint_policy, perform_initial_validation and the
length (searcher.max_length; records and epochs through global_batch_size and the loader).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

from detslurm.core import get_cluster_info


def load_trial_class(spec: str) -> Any:
    """``pkg.mod:Class`` or ``path/to/file.py:Class``, imported relative to the working dir."""
    module_name, _, qualname = spec.partition(":")
    if module_name.endswith(".py"):
        module_name = module_name[:-3].replace("/", ".")
    sys.path.insert(0, os.getcwd())
    sys.modules.pop(module_name, None)
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv: list[str]) -> int:
    from detslurm import pytorch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: [%(process)s] %(name)s: %(message)s")
    if len(argv) != 1 or ":" not in argv[0]:
        print("usage: python -m detslurm.exec.harness module:TrialClass", file=sys.stderr)
        return 2
    info = get_cluster_info()
    if info is None:
        print("detslurm harness: not running as a trial (no DET_TRIAL_ID); use Trainer.fit() locally", file=sys.stderr)
        return 2
    trial_cls = load_trial_class(argv[0])
    cfg = info.trial._config
    gbs = info.trial.hparams.get("global_batch_size")

    def period(key: str) -> Any:
        return pytorch.TrainUnit.from_values(**cfg.get(key, {}), global_batch_size=gbs)

    agg = int((cfg.get("optimizations") or {}).get("aggregation_frequency", 1))
    with pytorch.init(aggregation_frequency=agg) as ctx:
        trial = trial_cls(ctx)
        pytorch.Trainer(trial, ctx).fit(
            checkpoint_period=period("min_checkpoint_period"),
            validation_period=period("min_validation_period"),
            reporting_period=pytorch.Batch(int(cfg.get("scheduling_unit", 100))),
            checkpoint_policy=cfg.get("checkpoint_policy", "best"),
            latest_checkpoint=info.latest_checkpoint,
            step_zero_validation=bool(cfg.get("perform_initial_validation", False)),
            test_mode=os.environ.get("DET_TEST_MODE") == "1",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
