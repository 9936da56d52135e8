"""Seed 003, steps 2-4: the same script trains locally, under torchrun, and on a cluster."""

import logging
import os

import determined as det
import torch.distributed as dist
from determined import core, pytorch
from model_def import MyPyTorchTrial


def main() -> None:
    info = det.get_cluster_info()
    local = info is None
    if local and "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(backend="gloo")
        os.environ["USE_TORCH_DISTRIBUTED"] = "true"
        distributed_context = core.DistributedContext.from_torch_distributed(chief_ip="localhost")
    else:
        distributed_context = None
    hparams = {"global_batch_size": 32, "lr": 0.5} if local else info.trial.hparams
    with det.pytorch.init(hparams=hparams, distributed=distributed_context) as train_context:
        trial = MyPyTorchTrial(train_context, hparams)
        trainer = det.pytorch.Trainer(trial, train_context)
        trainer.fit(
            max_length=pytorch.Epoch(1) if local else None,
            checkpoint_period=pytorch.Batch(10),
            validation_period=pytorch.Batch(10),
            latest_checkpoint=None if local else info.latest_checkpoint,
            test_mode=os.environ.get("DET_TEST_MODE") == "1",
        )
    if distributed_context is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    main()
