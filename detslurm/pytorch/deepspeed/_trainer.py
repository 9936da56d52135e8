"""The Trainer for a DeepSpeedTrial: the PyTorch Trainer's loop, periods, reports and
checkpoints, with DeepSpeed's units: a batch is ``gradient_accumulation_steps`` micro batches,
train_batch is handed the micro-batch iterator and checkpoints are the engines' own."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any, Optional

import torch

from detslurm import core
from detslurm.core import DistributedContext, PreemptMode, get_cluster_info
from detslurm.pytorch._data import DataLoader, Shard, ShardedLoader, evaluation_loader
from detslurm.pytorch._init import _seed
from detslurm.pytorch._state import STATE_FILE, rng_state
from detslurm.pytorch._trainer import Trainer as _PyTorchTrainer
from detslurm.pytorch._trainer import _detached
from detslurm.pytorch.deepspeed._context import DeepSpeedTrialContext
from detslurm.pytorch.deepspeed._trial import DeepSpeedTrial

log = logging.getLogger("detslurm.pytorch.deepspeed")


class Trainer(_PyTorchTrainer):
    def __init__(self, trial: DeepSpeedTrial, context: DeepSpeedTrialContext) -> None:
        super().__init__(trial, context)  # type: ignore[arg-type]
        self.trial: DeepSpeedTrial = trial  # type: ignore[assignment]
        self.context: DeepSpeedTrialContext = context
        self._micro_steps = 1  # micro batches in one pass over this rank's training data
        self._eval_takes_idx = "batch_idx" in inspect.signature(trial.evaluate_batch).parameters

    def _shard(self) -> Shard:
        # Data is split among the data-parallel replicas, which are not all ranks under model
        # or pipeline parallelism.
        mpu = self.context._mpu
        return Shard(rank=mpu.data_parallel_rank, size=mpu.data_parallel_world_size)

    def _micro_per_batch(self) -> int:
        if not self.context.models:
            raise RuntimeError("the DeepSpeedTrial wrapped no engine: call context.wrap_model_engine() in __init__")
        return self.context.get_num_micro_batches_per_slot()

    def _checked(self, loader: Any, what: str) -> Any:
        if not isinstance(loader, DataLoader) and not self.context._data_repro_checks_disabled:
            raise TypeError(
                f"{what}() returned a {type(loader).__name__}, not a det.pytorch.DataLoader: its order and its "
                "position after a resume would not be reproducible. Return a det.pytorch.DataLoader, or call "
                "context.disable_dataset_reproducibility_checks() to take that on yourself"
            )
        return loader

    def _training_source(self) -> tuple[Any, int]:
        source, micro_steps = super()._training_source()
        if not isinstance(source, ShardedLoader):
            self._checked(source, "build_training_data_loader")
        self._micro_steps = micro_steps
        return source, max(1, micro_steps // self._micro_per_batch())

    def _validation_source(self) -> Any:
        return self._checked(super()._validation_source(), "build_validation_data_loader")

    def _stream(self, source: Any, data_steps: int) -> Iterator[Any]:
        # Every train_batch call gets the same micro-batch iterator, positioned after the micro
        # batches of the batches already trained.
        start = self.batches_trained * self._micro_per_batch()
        return itertools.repeat(self._loader_steps(source, self._micro_steps, start))

    def _train_one(self, pending: list[dict[str, Any]], stream: Iterator[Any]) -> None:
        micro_batches = next(stream)
        ctx = self.context
        ctx._current_batch_idx = self.batches_trained
        calls = 1 if ctx.use_pipeline_parallel or ctx._manual_grad_accumulation else self._micro_per_batch()
        for _ in range(calls):
            out = self.trial.train_batch(micro_batches, self.epoch_idx, self.batches_trained)
            if ctx.profiler is not None:
                ctx.profiler.step()
            if not ctx._mpu.should_report_metrics:
                continue
            if isinstance(out, torch.Tensor):
                out = {"loss": out}
            if not isinstance(out, dict):
                raise TypeError(
                    f"train_batch() must return a dict of metrics or a loss tensor, not {type(out).__name__}"
                )
            pending.append({k: _detached(v) for k, v in out.items()})
        self.batches_trained += 1

    def _full_dataset_defined(self) -> bool:
        return type(self.trial).evaluate_full_dataset is not DeepSpeedTrial.evaluate_full_dataset

    def _evaluate_batches(self, test_mode: bool) -> dict[str, Any]:
        loader = evaluation_loader(self._val_source, self._shard(), self.context.get_trial_seed())
        # A pipeline engine draws its micro batches for one evaluate_batch call itself.
        per_call = self._micro_per_batch() if self.context.use_pipeline_parallel else 1
        micro_batches = iter(loader)
        evaluate: Any = self.trial.evaluate_batch

        def outputs() -> Iterator[Any]:
            for idx in range(len(loader) // per_call):
                out = evaluate(micro_batches, idx) if self._eval_takes_idx else evaluate(micro_batches)
                # Every rank runs the batch; only the ranks that report metrics contribute a row.
                if self.context._mpu.should_report_metrics:
                    yield out
                if test_mode:
                    break

        return self._evaluation_metrics(outputs())

    # -- checkpoints: the engines save themselves, on every rank ----------------------------
    def _checkpoint(self) -> None:
        if self._last_ckpt_at == self.batches_trained or self.core is None:
            return
        self._last_ckpt_at = self.batches_trained
        state = {"callbacks": {k: cb.state_dict() for k, cb in self.callbacks.items()}, "rng_state": rng_state()}
        for cb in self.callbacks.values():
            cb.on_checkpoint_save_start(state)
        sharded = self.context.distributed.size > 1
        with self.core.checkpoint.store_path(self._checkpoint_metadata(), shard=sharded) as (path, uuid):
            self.trial.save(self.context, path)
            if self.context.is_chief():
                torch.save(state, path / STATE_FILE)
                self._write_trial_files(path)
        if self.context.is_chief():
            self._checkpoint_done(uuid)

    def _load(self, storage_id: str) -> None:
        assert self.core is not None
        with self.core.checkpoint.restore_path(storage_id) as path:
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
            trial_state = self._read_trial_state(path)
            for cb in self.callbacks.values():
                cb.on_checkpoint_load_start(state)
            self.trial.load(self.context, path)
        self._resume_at(storage_id, state, trial_state)


def _deepspeed_distributed() -> Optional[DistributedContext]:
    """Joins DeepSpeed's process group when a launcher started this rank among others:
    determined.launch.deepspeed (DeepSpeed's variables), or the legacy harness under another
    launcher (torch.distributed's variables)."""
    env = os.environ
    from_deepspeed = env.get("USE_DEEPSPEED") == "1" and "CROSS_RANK" in env
    if not from_deepspeed and env.get("USE_TORCH_DISTRIBUTED", "").lower() not in ("1", "true"):
        return None
    if not env.get("DET_MANUAL_INIT_DISTRIBUTED"):
        import deepspeed

        # NCCL only works between GPUs; CPU-only nodes need gloo.
        deepspeed.init_distributed("nccl" if torch.cuda.is_available() else "gloo", auto_mpi_discovery=False)
    return DistributedContext.from_deepspeed() if from_deepspeed else DistributedContext.from_torch_distributed()


def _one_rank_group_env() -> None:
    """deepspeed.initialize joins a torch.distributed group even in one process: without a
    launcher's variables, it is a group of one on this host (a free port, not a fixed one that
    another process on the node may hold)."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in one.items():
        os.environ.setdefault(k, v)


@contextlib.contextmanager
def init(
    *,
    hparams: Optional[dict[str, Any]] = None,
    exp_conf: Optional[dict[str, Any]] = None,
    distributed: Optional[DistributedContext] = None,
    enable_tensorboard_logging: bool = True,
) -> Iterator[DeepSpeedTrialContext]:
    """The context for a DeepSpeedTrial's Trainer: hparams, config, seed and the position to
    resume from come from the trial on a cluster, or from the arguments off-cluster."""
    info = get_cluster_info()
    trial_seed: Optional[int] = None
    steps_completed = 0
    if info is not None:
        hparams = info.trial.hparams if hparams is None else hparams
        exp_conf = info.trial._config if exp_conf is None else exp_conf
        trial_seed = int(info.trial.trial_seed)
        steps_completed = int(info.trial._steps_completed)
        _seed(trial_seed)
        if distributed is None:
            distributed = _deepspeed_distributed()
    if distributed is None:
        _one_rank_group_env()
    with core.init(distributed=distributed, preempt_mode=PreemptMode.WorkersAskChief) as core_context:
        yield DeepSpeedTrialContext(
            core_context=core_context,
            trial_seed=trial_seed,
            hparams=hparams,
            slots_per_trial=core_context.distributed.size,
            num_gpus=torch.cuda.device_count(),
            exp_conf=exp_conf,
            steps_completed=steps_completed,
            enable_tensorboard_logging=enable_tensorboard_logging,
        )
