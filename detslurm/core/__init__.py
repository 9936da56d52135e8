"""The Core API (in-job): metrics, checkpoints, preemption, searcher ops, distributed ranks.

Works on a trial (reading the DET_* env contract) and off-cluster (the ``Dummy*`` twins, which
user code may also build by hand for its unit tests), so the same script runs on a laptop, in
``det e create --local`` and in a Slurm job.
"""

from detslurm.core._checkpoint import CheckpointContext, DownloadMode, DummyCheckpointContext, merge_metadata
from detslurm.core._context import Context, TensorboardMode, init
from detslurm.core._distributed import DistributedContext, DummyDistributedContext
from detslurm.core._experimental import DummyExperimentalCoreContext, ExperimentalCoreContext
from detslurm.core._info import ClusterInfo, TrialInfo, get_cluster_info
from detslurm.core._preempt import DummyPreemptContext, PreemptContext, PreemptMode
from detslurm.core._profiler import DummyProfilerContext, ProfilerContext
from detslurm.core._searcher import (
    DummySearcherContext,
    DummySearcherOperation,
    SearcherContext,
    SearcherContextMissing,
    SearcherMode,
    SearcherOperation,
    Unit,
)
from detslurm.core._train import DummyTrainContext, EarlyExitReason, TrainContext

__all__ = [
    "CheckpointContext",
    "ClusterInfo",
    "Context",
    "DistributedContext",
    "DownloadMode",
    "DummyCheckpointContext",
    "DummyDistributedContext",
    "DummyExperimentalCoreContext",
    "DummyPreemptContext",
    "DummyProfilerContext",
    "DummySearcherContext",
    "DummySearcherOperation",
    "DummyTrainContext",
    "EarlyExitReason",
    "ExperimentalCoreContext",
    "PreemptContext",
    "PreemptMode",
    "ProfilerContext",
    "SearcherContext",
    "SearcherContextMissing",
    "SearcherMode",
    "SearcherOperation",
    "TensorboardMode",
    "TrainContext",
    "TrialInfo",
    "Unit",
    "get_cluster_info",
    "init",
    "merge_metadata",
]
