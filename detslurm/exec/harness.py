"""``python -m detslurm.exec.harness module:TrialClass``: run a legacy PyTorchTrial on a trial.

What ``--trial`` and ``entrypoint: model_def:Class`` lead to. The experiment config supplies
what ``Trainer.fit()`` would otherwise be told: min_checkpoint_period, min_validation_period,
scheduling_unit (the reporting period), checkpoint_policy, perform_initial_validation and the
length (searcher.max_length; records and epochs through global_batch_size and the loader).

Under several slots the Trainer trains data-parallel with torch DDP, its one distributed path,
whichever launcher started the ranks: under ``horovod``/``autohorovod`` and ``deepspeed`` the
harness first derives torch.distributed's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) from the
ranks that launcher gave (``torch_env_for_trial``); the launchers supply a rendezvous port.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from detslurm import settings
from detslurm.core import get_cluster_info
from detslurm.errors import DetSlurmError
from detslurm.expconf.view import ConfigView


def load_trial_class(spec: str) -> Any:
    """``pkg.mod:Class`` or ``path/to/file.py:Class``, imported relative to the working dir."""
    module_name, _, qualname = spec.partition(":")
    if module_name.endswith(".py"):
        module_name = module_name[:-3].replace("/", ".")
    # The working dir is the trial's extracted context, where model_def.py lives; first on the
    # path so a same-named installed module cannot shadow the user's.
    sys.path.insert(0, os.getcwd())
    # A module of that name imported earlier (e.g. by a launcher) would otherwise be reused
    # instead of the context's file.
    sys.modules.pop(module_name, None)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the trial's own module failed to import something: its traceback says what
        raise ValueError(f"--trial {spec}: no module {module_name!r} in {os.getcwd()}") from None
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--trial {spec}: {module_name} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _true(value: str | None) -> bool:
    # Determined's launchers set these flags to "true"; ours and users' scripts may use "1".
    return (value or "").lower() in ("1", "true")


def _horovod_ranks(env: Mapping[str, str]) -> dict[str, int] | None:
    """Rank facts from Horovod's gloo variables, or Open MPI's under ``--mpi``."""
    prefix = "HOROVOD_" if "HOROVOD_RANK" in env else "OMPI_COMM_WORLD_" if "OMPI_COMM_WORLD_RANK" in env else None
    if prefix is None:
        return None
    rank, size, local_rank, local_size = (int(env[prefix + k]) for k in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE"))
    # Ranks fill nodes in order (both launchers place them that way), so the node is rank // local_size.
    return {
        "RANK": rank,
        "WORLD_SIZE": size,
        "LOCAL_RANK": local_rank,
        "LOCAL_WORLD_SIZE": local_size,
        "GROUP_RANK": rank // local_size,
        "GROUP_WORLD_SIZE": size // local_size,
    }


def torch_env_for_trial(env: Mapping[str, str]) -> dict[str, str]:
    """Pure: the variables to add so ``pytorch.init()`` sets up torch.distributed for this rank.

    Empty for one rank, or when torch_distributed already launched it. Raises ValueError when
    a launcher's variables are incomplete (a hand-made launch), naming what is missing.
    """
    # torch_distributed's launcher (torchrun) sets every variable itself.
    if _true(env.get("USE_TORCH_DISTRIBUTED")):
        return {}
    if _true(env.get("USE_DEEPSPEED")) and "WORLD_SIZE" in env:
        # DeepSpeed's launcher already sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT.
        names = {"LOCAL_WORLD_SIZE": "LOCAL_SIZE", "GROUP_RANK": "CROSS_RANK", "GROUP_WORLD_SIZE": "CROSS_SIZE"}
        missing = [src for src in names.values() if src not in env]
        if missing:
            raise ValueError(f"the deepspeed launcher did not set {', '.join(missing)}")
        out = {dst: env[src] for dst, src in names.items()}
        size = int(env["WORLD_SIZE"])
    elif _true(env.get("USE_HOROVOD")):
        ranks = _horovod_ranks(env)
        if ranks is None:
            raise ValueError("USE_HOROVOD is set but neither HOROVOD_RANK nor OMPI_COMM_WORLD_RANK is")
        size = ranks["WORLD_SIZE"]
        torch_port = settings.TORCH_PORT.raw(env)
        if size > 1 and not torch_port:
            raise ValueError(f"the horovod launcher did not set {settings.TORCH_PORT.name}")
        out = {k: str(v) for k, v in ranks.items()}
        # The chief's node hosts the c10d store; 127.0.0.1 only when there is one node and no chief
        # IP was rendered. The port is the one the launcher reserved, distinct from Horovod's own.
        out["MASTER_ADDR"] = env.get("DET_CHIEF_IP") or "127.0.0.1"
        out["MASTER_PORT"] = torch_port or ""
    else:
        return {}
    # One rank needs no process group: the Trainer runs plain, as Determined does for one slot.
    if size <= 1:
        return {}
    out["USE_TORCH_DISTRIBUTED"] = "true"
    return out


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
    try:
        # Set before pytorch.init(), which reads these variables to join the process group.
        os.environ.update(torch_env_for_trial(os.environ))
        trial_cls = load_trial_class(argv[0])
    except ValueError as e:
        print(f"detslurm harness: {e}", file=sys.stderr)
        return 2
    cfg = ConfigView(info.trial._config)
    # Records and epochs in the config's periods convert to batches through global_batch_size,
    # which Determined also reads from the hparams.
    gbs = info.trial.hparams.get("global_batch_size")

    def period(key: str) -> Any:
        length = cfg.length(key)
        return pytorch.TrainUnit.from_values(**(length.as_dict() if length else {}), global_batch_size=gbs)

    api: Any = pytorch
    init: Any = pytorch.init(aggregation_frequency=cfg.aggregation_frequency)
    if getattr(trial_cls, "_trial_type", None) == "DeepSpeedTrial":
        from detslurm.pytorch import deepspeed

        # The engine accumulates gradients itself (its gradient_accumulation_steps).
        api, init = deepspeed, deepspeed.init()
    # The one boundary for the trial's own setup errors that say what to do (a DetSlurmError,
    # e.g. configure_apex_amp without apex): one line in the trial's log, not a traceback.
    try:
        with init as ctx:
            trial = trial_cls(ctx)
            api.Trainer(trial, ctx).fit(
                checkpoint_period=period("min_checkpoint_period"),
                validation_period=period("min_validation_period"),
                # scheduling_unit is Determined's reporting period for legacy trials (default 100 batches).
                reporting_period=pytorch.Batch(cfg.scheduling_unit),
                checkpoint_policy=cfg.checkpoint_policy,
                # The checkpoint the controller chose to resume from (after a requeue, a pause or a restart);
                # None on a trial's first run.
                latest_checkpoint=info.latest_checkpoint,
                step_zero_validation=cfg.perform_initial_validation,
                test_mode=os.environ.get("DET_TEST_MODE") == "1",
            )
    except DetSlurmError as e:
        print(f"detslurm harness: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
