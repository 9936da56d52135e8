"""Benchmark workload: DDP init, one training step; rank 0 records when that step is done."""

import gc
import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
loss = model(torch.randn(8, 4)).pow(2).mean()
loss.backward()
if dist.get_rank() == 0:
    with open(os.path.join(os.environ["BENCH_OUT"], "first_step"), "w") as f:
        f.write(repr(time.time()))
dist.barrier()
del model, loss
gc.collect()
dist.destroy_process_group()
sys.exit(0)
