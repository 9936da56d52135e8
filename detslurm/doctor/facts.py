"""What the login node can learn about the site, probed once through the Slurm client.

Everything here is read from Slurm's own answers (``scontrol show config``, ``scontrol show
partition``, ``sinfo``, ``sacctmgr``) and from the user's settings and site config; the checks
that judge it are pure functions over :class:`SiteFacts` (tests build them from captured output).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from detslurm.slurm.client import SlurmClient, SlurmCommandError
from detslurm.slurm.parse import Capabilities, PartitionNodes, SlurmParseError
from detslurm.slurm.partitions import AssocLimit, PartitionInfo
from detslurm.slurm.site import SiteConfig


@dataclass(frozen=True)
class SiteFacts:
    """The inputs of the site-level checks."""

    caps: Capabilities
    partitions: list[PartitionInfo]
    # sinfo's per-partition lines (one per node state): where the GRES of each partition show.
    sinfo: list[PartitionNodes]
    site: SiteConfig
    site_path: Optional[Path]  # None: no site config was found (every partition is a pool)
    experiments_dir: Path
    checkpoint_dir: Path
    user_poll_interval_s: float
    # None without accounting (no associations to ask about).
    assoc: Optional[list[AssocLimit]] = None
    # Why the associations could not be read, when accounting exists but sacctmgr failed.
    assoc_error: str = ""

    def partition(self, name: str) -> Optional[PartitionInfo]:
        return next((p for p in self.partitions if p.name == name), None)

    def gres(self, partition: str) -> str:
        """The partition's GRES as sinfo prints them (``gpu:2``), "" when it has none."""
        return ",".join(sorted({n.gres for n in self.sinfo if n.partition == partition and n.gres}))

    def gpus_per_node(self, partition: str) -> int:
        return max((n.gpus_per_node for n in self.sinfo if n.partition == partition), default=0)

    def gpu_nodes(self, partition: str) -> int:
        """How many of the partition's nodes have GPUs (sinfo prints nodes with other GRES on
        lines of their own, so a partition of mixed nodes shows as such)."""
        return sum(n.nodes for n in self.sinfo if n.partition == partition and n.gpus_per_node > 0)

    def all_gpu(self, partition: str) -> bool:
        """Every node of the partition has GPUs: the partition is a pool of GPU slots."""
        p = self.partition(partition)
        return p is not None and p.total_nodes > 0 and self.gpu_nodes(partition) >= p.total_nodes


def gather(
    client: SlurmClient,
    site: SiteConfig,
    site_path: Optional[Path],
    experiments_dir: Path,
    checkpoint_dir: Path,
    user_poll_interval_s: float,
) -> SiteFacts:
    """Four or five Slurm calls: config, partitions, sinfo, and the user's associations."""
    caps = client.capabilities()
    assoc: Optional[list[AssocLimit]] = None
    assoc_error = ""
    if caps.accounting:
        # sacctmgr talks to slurmdbd, which may be down while slurmctld works: say so, go on.
        try:
            assoc = client.assoc_limits()
        except (SlurmCommandError, SlurmParseError) as e:
            assoc_error = str(e)
    return SiteFacts(
        caps=caps,
        partitions=client.partitions(),
        sinfo=client.sinfo(),
        site=site,
        site_path=site_path,
        experiments_dir=experiments_dir,
        checkpoint_dir=checkpoint_dir,
        user_poll_interval_s=user_poll_interval_s,
        assoc=assoc,
        assoc_error=assoc_error,
    )
