"""Which ranks of a model-parallel layout feed data and report metrics (Determined's MPU)."""

from __future__ import annotations

import dataclasses
from typing import Any

from detslurm.core import DistributedContext


@dataclasses.dataclass
class ModelParallelUnit:
    """The data-parallel position of this rank, and whether it builds data loaders and reports
    metrics (in pipeline parallelism only the first and last stages touch data)."""

    data_parallel_rank: int
    data_parallel_world_size: int
    should_report_metrics: bool
    should_build_data_loader: bool


def make_data_parallel_mpu(dist_context: DistributedContext) -> ModelParallelUnit:
    """Plain data parallelism: every rank is a replica that reads data and reports."""
    return ModelParallelUnit(
        data_parallel_rank=dist_context.get_rank(),
        data_parallel_world_size=dist_context.get_size(),
        should_report_metrics=True,
        should_build_data_loader=True,
    )


def make_deepspeed_mpu(topology: Any) -> ModelParallelUnit:
    """The unit for a DeepSpeed PipelineParallelGrid (``engine.mpu`` of a PipelineEngine)."""
    stage = topology.get_pipe_parallel_rank()
    first, last = stage == 0, stage == topology.get_pipe_parallel_world_size() - 1
    return ModelParallelUnit(
        data_parallel_rank=topology.get_data_parallel_rank(),
        data_parallel_world_size=topology.get_data_parallel_world_size(),
        should_report_metrics=True,
        should_build_data_loader=topology.get_slice_parallel_rank() == 0 and (first or last),
    )
