"""The doctor as one call: probe the site, probe every pool's nodes, judge it all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from detslurm import __version__
from detslurm.doctor import checks, facts, node_checks, probe
from detslurm.doctor.findings import Finding, Status
from detslurm.errors import ConfigError
from detslurm.settings import Settings
from detslurm.slurm.client import SlurmClient
from detslurm.slurm.site import Pool, SiteConfig


@dataclass(frozen=True)
class ProbeOptions:
    """What `det site doctor` asks of the probe jobs."""

    enabled: bool = True
    pools: tuple[str, ...] = ()  # empty: every pool
    image: str = ""  # a container image to test-run on the nodes
    timeout_s: float = 300.0


@dataclass(frozen=True)
class Diagnosis:
    facts: facts.SiteFacts
    findings: list[Finding]


def probe_pools(f: facts.SiteFacts, wanted: Sequence[str]) -> list[tuple[str, Pool]]:
    """The pools to probe: the site config's, or every partition as a pool when it has none
    (a GPU pool where sinfo shows GPUs). Names not among them are a ConfigError."""
    if f.site.pools:
        pools = dict(f.site.pools)
    else:
        # As `det resource-pool list` does on an undescribed site: each partition is a pool.
        pools = {p.name: Pool(partition=p.name, slot_type="gpu" if f.all_gpu(p.name) else "cpu") for p in f.partitions}
    unknown = sorted(set(wanted) - set(pools))
    if unknown:
        raise ConfigError(
            [f"--pool {name}: no such pool; pools: {', '.join(sorted(pools))}" for name in unknown],
            source="doctor options",
        )
    # A pool whose partition is missing or down already has its problem line; its probe would only wait.
    usable = {p.name: p for p in f.partitions if p.up and p.total_nodes > 0}
    out = []
    for name, pool in sorted(pools.items()):
        part = usable.get(pool.partition)
        if part is None or (wanted and name not in wanted):
            continue
        # The probe asks for at most probe.JOB_TIME_MIN; a partition with a shorter MaxTime
        # would refuse (or forever hold) a job asking for more.
        if part.max_time_s is not None and part.max_time_s // 60 < (pool.time_limit_min or probe.JOB_TIME_MIN):
            pool = pool.model_copy(update={"time_limit_min": max(1, part.max_time_s // 60)})
        out.append((name, pool))
    return out


def diagnose(
    client: SlurmClient,
    site: SiteConfig,
    site_path: Optional[Path],
    settings: Settings,
    options: ProbeOptions,
) -> Diagnosis:
    """Every finding about this site, in the table's order: site-level lines, then each pool's."""
    f = facts.gather(client, site, site_path, settings)
    findings = checks.site_findings(f)
    if not options.enabled:
        return Diagnosis(f, findings)
    pools = probe_pools(f, options.pools)
    # Both dirs a trial needs on its nodes: run dirs (events, control files) and checkpoints.
    dirs, failed = probe.make_probe_dirs([("experiments", f.experiments_dir), ("checkpoints", f.checkpoint_dir)])
    findings += [
        Finding(
            f"{name} dir",
            Status.PROBLEM,
            f"{base}: cannot create a probe dir on the login node ({why})",
            "detslurm cannot create experiments or checkpoints there either",
        )
        for name, base, why in failed
    ]
    try:
        results = probe.run_probes(
            client,
            site,
            pools,
            dirs,
            python=probe.default_python(site),
            image=options.image,
            timeout_s=options.timeout_s,
        )
    finally:
        # Tokens and reports are of no use after this run; leave the user's dirs as they were.
        probe.remove_probe_dirs(dirs)
    for result in results:
        findings += node_checks.pool_findings(result, __version__)
    return Diagnosis(f, findings)
