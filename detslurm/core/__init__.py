"""The Core API (in-job): metrics, checkpoints, preemption, searcher ops, distributed ranks.

Works on a trial (reading the DET_* env contract) and off-cluster (null-object twins), so the
same script runs on a laptop, in ``det e create --local`` and in a Slurm job.
"""

from detslurm.core._checkpoint import CheckpointContext, DownloadMode, merge_metadata
from detslurm.core._context import Context, TensorboardMode, init
from detslurm.core._distributed import DistributedContext, DummyDistributedContext
from detslurm.core._info import ClusterInfo, TrialInfo, get_cluster_info
from detslurm.core._preempt import DummyPreemptContext, PreemptContext, PreemptMode
from detslurm.core._searcher import SearcherContext, SearcherMode, SearcherOperation, Unit
from detslurm.core._train import EarlyExitReason, TrainContext

__all__ = [
    "CheckpointContext",
    "ClusterInfo",
    "Context",
    "DistributedContext",
    "DownloadMode",
    "DummyDistributedContext",
    "DummyPreemptContext",
    "EarlyExitReason",
    "PreemptContext",
    "PreemptMode",
    "SearcherContext",
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
