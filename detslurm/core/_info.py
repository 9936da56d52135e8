"""Cluster info for in-job code: the trial env contract, read once per process.

The contract itself (``trial_env`` and its reader ``from_env``) lives in
:mod:`detslurm.protocol.env`; :func:`get_cluster_info` returns ``None`` off-cluster.
"""

from __future__ import annotations

import os

from detslurm.protocol.env import ClusterInfo, RendezvousInfo, ResourcesInfo, RunInfo, TrialInfo, from_env

__all__ = ["ClusterInfo", "RendezvousInfo", "ResourcesInfo", "RunInfo", "TrialInfo", "get_cluster_info"]

_cached: dict[str, RunInfo | None] = {}


def get_cluster_info() -> RunInfo | None:
    """The running trial's info, or ``None`` off-cluster. Read once per process."""
    # Keyed by the ids rather than cached once: tests (and a launcher that starts several
    # trials in one process) change the environment, and stale info would mix trials up.
    key = os.environ.get("DET_ALLOCATION_ID", "") + os.environ.get("DET_TRIAL_ID", "")
    if key not in _cached:
        _cached.clear()
        _cached[key] = from_env(os.environ)
    return _cached[key]
