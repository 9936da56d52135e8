"""`det config`: the effective settings and where each came from.

Determined's `det master config` shows its master's configuration; detslurm has no master, and
the nearest thing is the settings every `det` and the daemon resolve (detslurm/settings.py), so
this is a top-level command. `det -m ssh://login config` shows a login node's.
"""

from __future__ import annotations

import click

from detslurm import settings
from detslurm.cli.render import dump_json, table


@click.command(name="config")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (also each setting's type, default and meaning).")
def config(as_json: bool) -> None:
    """Show every setting's effective value and where it came from.

    The source is the environment, the user config file or the default (docs/admin/settings.md)."""
    rows = settings.effective()
    if as_json:
        dump_json([r.as_json() for r in rows])
        return
    table(
        ["Setting", "Value", "Source", "Config Key", "Read By"],
        [[r.var.name, r.value, r.source.value, r.var.key or "", r.var.side.value] for r in rows],
    )
