"""`det resource-pool` (alias `det rp`): resource pools are Slurm partitions."""

from __future__ import annotations

from collections import Counter
from typing import Any

import click

from detslurm.cli.app import App, pass_app
from detslurm.cli.render import dump_json, table


@click.group(name="resource-pool")
def resource_pool() -> None:
    """Resource pools (Slurm partitions, described in the site config)."""


def pool_rows(app: App) -> list[dict[str, Any]]:
    """Every pool as `det rp list --json` prints it (also the dashboard's pools page)."""
    site = app.site()
    # One sinfo for all pools: per-pool calls would multiply the load on slurmctld.
    nodes = app.client.nodes()
    # Without pools in the site config every partition sinfo reports is a pool of its own,
    # so the command is still useful on a site nobody has described.
    names = sorted(site.pools) or sorted({p for n in nodes for p in n.partitions})
    rows: list[dict[str, Any]] = []
    for name in names:
        pool = site.pools.get(name)
        partition = pool.partition if pool else name
        # An undescribed partition has no known slot type; counting CPUs is always possible.
        slot_type = pool.slot_type if pool else "cpu"
        # A node may sit in several partitions, so it is counted in each pool it serves.
        members = [n for n in nodes if partition in n.partitions]
        # Slots mean GPUs on a GPU pool and CPUs otherwise, as slots_per_trial does when rendered.
        used = sum(n.gpus_used if slot_type == "gpu" else n.alloc_cpus for n in members)
        total = sum(n.gpus if slot_type == "gpu" else n.cpus for n in members)
        states = Counter(n.state.lower() for n in members)
        rows.append(
            {
                "name": name,
                "partition": partition,
                "slot_type": slot_type,
                "nodes": len(members),
                "slots_used": used,
                "slots_total": total,
                "default": name == site.default_pool,
                "state": ", ".join(f"{c} {s}" for s, c in sorted(states.items())) or "no nodes",
                "description": pool.description if pool else "",
            }
        )
    return rows


@resource_pool.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_app
def list_(app: App, as_json: bool) -> None:
    """List pools with their nodes, slots (used/total) and node states, from one sinfo call."""
    rows = pool_rows(app)
    if as_json:
        dump_json(rows)
        return
    table(
        ["Pool", "Partition", "Slot Type", "Nodes", "Slots (used/total)", "State", "Default", "Description"],
        [
            [
                r["name"],
                r["partition"],
                r["slot_type"],
                r["nodes"],
                f"{r['slots_used']}/{r['slots_total']}",
                r["state"],
                "yes" if r["default"] else "",
                r["description"],
            ]
            for r in rows
        ],
    )
