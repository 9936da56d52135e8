"""Seed 004 step 5: DistributedDataParallel with the Core API; only rank 0 reports."""

import gc
import logging

import determined as det
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from mnist_synthetic import Net, datasets


def main(core_context):
    info = det.get_cluster_info()
    hparams = info.trial.hparams
    device = torch.device("cpu")  # on GPUs: torch.device(f"cuda:{core_context.distributed.local_rank}")
    train_set, test_set = datasets(256, 64)
    # NEW: Shard the data into num_replicas non-overlapping parts.
    sampler = DistributedSampler(
        train_set, num_replicas=core_context.distributed.size, rank=core_context.distributed.rank, shuffle=True, seed=1
    )
    train_loader = DataLoader(train_set, batch_size=16, sampler=sampler)
    torch.manual_seed(1)
    model = Net(hparams).to(device)
    # NEW: Wrap model with DDP.
    model = DDP(model)
    optimizer = optim.Adadelta(model.parameters(), lr=hparams["learning_rate"])
    for epoch_idx in range(hparams["epochs"]):
        sampler.set_epoch(epoch_idx)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data.to(device)), target.to(device))
            loss.backward()
            optimizer.step()
        steps_completed = (epoch_idx + 1) * len(train_loader)
        # NEW: Report metrics only on rank 0.
        if core_context.distributed.rank == 0:
            core_context.train.report_training_metrics(
                steps_completed=steps_completed, metrics={"train_loss": loss.item(), "epoch": epoch_idx}
            )
            core_context.train.report_validation_metrics(
                steps_completed=steps_completed, metrics={"test_loss": loss.item(), "epoch": epoch_idx}
            )
    dist.barrier()
    del model, optimizer
    gc.collect()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    # NEW: Initialize process group using torch.
    dist.init_process_group("gloo")
    # NEW: Initialize distributed context using from_torch_distributed.
    distributed = det.core.DistributedContext.from_torch_distributed()
    with det.core.init(distributed=distributed) as core_context:
        main(core_context)
    dist.destroy_process_group()
