"""What the login node can learn about the site, probed once through the Slurm client.

Everything here is read from Slurm's own answers (``scontrol show config``, ``scontrol show
partition``, ``sinfo``, ``sacctmgr``) and from the user's settings and site config; the checks
that judge it are pure functions over :class:`SiteFacts` (tests build them from captured output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from detslurm import settings as settings_mod
from detslurm.settings import Settings
from detslurm.slurm.client import SlurmClient, SlurmCommandError
from detslurm.slurm.parse import Capabilities, PartitionNodes, SlurmParseError
from detslurm.slurm.partitions import AssocLimit, PartitionInfo
from detslurm.slurm.site import SiteConfig
from detslurm.store.fs import network_fs_of


@dataclass(frozen=True)
class StoreFacts:
    """Where the user's store is: the doctor warns about SQLite on a network filesystem."""

    kind: str  # "sqlite", "postgresql", or the URL's scheme
    sqlite_path: Optional[Path]  # the SQLite file (never a URL: a password must not be shown)
    network_fs: Optional[str]  # e.g. "nfs4" when the SQLite file's dir is on one


def store_facts(db_url: str, mountinfo: Optional[str] = None) -> StoreFacts:
    """What kind of store ``db_url`` names and, for SQLite, which filesystem holds it."""
    scheme = db_url.partition(":")[0].split("+")[0].lower()
    if scheme != "sqlite":
        return StoreFacts(scheme, None, None)
    # sqlite:///relative or sqlite:////absolute: the path follows the third slash.
    path = Path(db_url.partition(":///")[2] or ":memory:")
    return StoreFacts("sqlite", path, network_fs_of(path, mountinfo))


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
    user_poll_interval_s: Optional[float]  # None: the user set none (environment or config file)
    # None without accounting (no associations to ask about).
    assoc: Optional[list[AssocLimit]] = None
    # Why the associations could not be read, when accounting exists but sacctmgr failed.
    assoc_error: str = ""
    store: StoreFacts = field(default_factory=lambda: StoreFacts("sqlite", None, None))

    def partition(self, name: str) -> Optional[PartitionInfo]:
        return next((p for p in self.partitions if p.name == name), None)

    def gres(self, partition: str) -> str:
        """The partition's GRES as sinfo prints them (``gpu:2``), "" when it has none."""
        # sinfo prints one line per node state and GRES: the set of distinct values describes it.
        return ",".join(sorted({n.gres for n in self.sinfo if n.partition == partition and n.gres}))

    def node_states(self, partition: str) -> list[tuple[str, int, str]]:
        """The partition's nodes by state, as sinfo groups them: (state, how many, node list)."""
        out: dict[tuple[str, str], int] = {}
        for n in self.sinfo:
            if n.partition == partition:
                out[(n.state, n.nodelist)] = out.get((n.state, n.nodelist), 0) + n.nodes
        return [(state, count, nodes) for (state, nodes), count in sorted(out.items())]

    def cpus_per_node(self, partition: str) -> int:
        """The most CPUs one node of the partition has (sinfo's lines total their nodes' CPUs)."""
        return max((n.cpus_total // n.nodes for n in self.sinfo if n.partition == partition and n.nodes), default=0)

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


def gather(client: SlurmClient, site: SiteConfig, site_path: Optional[Path], settings: Settings) -> SiteFacts:
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
        experiments_dir=settings.experiments_dir,
        checkpoint_dir=settings.checkpoint_dir,
        user_poll_interval_s=_user_poll_interval_s(),
        assoc=assoc,
        assoc_error=assoc_error,
        store=store_facts(settings.db_url),
    )


def _user_poll_interval_s() -> Optional[float]:
    """The poll interval the user set (environment or user config file), None where none is."""
    given, _ = settings_mod.pick(settings_mod.POLL_INTERVAL_S, settings_mod.read_user_config())
    return None if given is None else float(given)
