"""`det site`: the site doctor and a starter site config, for HPC admins and users.

Thin: the doctor lives in detslurm/doctor; errors reach the one boundary in cli/main.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import click
from tabulate import tabulate

from detslurm.cli.app import App, pass_app
from detslurm.cli.render import dump_json

if TYPE_CHECKING:
    from detslurm.doctor.findings import Finding

# Wrapped widths of the subject, detail and action columns: with the status column and presto's
# separators the table fits in 100 columns (tests/unit/slurm/test_site_limits.py).
_SUBJECT_WIDTH = 16
_DETAIL_WIDTH = 37
_ACTION_WIDTH = 27


@click.group(name="site")
def site() -> None:
    """Site doctor and starter site config: what this Slurm offers detslurm."""


@site.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="One JSON document (stable schema) instead of the table.")
@click.option("--no-probe", is_flag=True, help="Only what the login node can tell: submit no probe jobs.")
@click.option("-p", "--pool", "pools", multiple=True, help="Probe only this pool (repeatable).")
@click.option("--image", default="", help="A container image to test-run on each pool's nodes.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Seconds to wait for probes.",
)
@pass_app
def doctor(app: App, as_json: bool, no_probe: bool, pools: tuple[str, ...], image: str, timeout_s: float) -> None:
    """Check Slurm, the site config and every pool's nodes; exit 1 when there is a problem."""
    from detslurm.doctor.findings import Status, report_json, worst
    from detslurm.doctor.run import ProbeOptions, diagnose

    site_config = app.site()
    # The files actually read (the admin's first); the findings name the one behind each limit.
    site_path = site_config.files[0] if site_config.files else None
    options = ProbeOptions(enabled=not no_probe, pools=pools, image=image, timeout_s=timeout_s)
    result = diagnose(app.client, site_config, site_path, app.settings, options)
    caps = result.facts.caps
    if as_json:
        dump_json(report_json(result.findings, caps.cluster_name, caps.version))
    else:
        click.echo(findings_table(result.findings))
    # Warnings keep exit code 0, so CI and cron jobs fail only on what breaks trials.
    if worst(result.findings) is Status.PROBLEM:
        raise click.exceptions.Exit(1)


def findings_table(findings: Sequence[Finding]) -> str:
    """The doctor's findings as the table it prints (at most 100 columns wide)."""
    rows = [[f.status.value, f.subject, f.detail, f.action] for f in findings]
    return str(
        tabulate(
            rows,
            headers=["Status", "Subject", "Found", "detslurm will / you should"],
            tablefmt="presto",
            maxcolwidths=[None, _SUBJECT_WIDTH, _DETAIL_WIDTH, _ACTION_WIDTH],
        )
    )


@site.command("init")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write it (default: ~/.config/detslurm/site.yaml; the admin's: /etc/detslurm/site.yaml).",
)
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
@click.option("--print", "to_stdout", is_flag=True, help="Print the config instead of writing it.")
@click.option(
    "--example",
    is_flag=True,
    help="The commented template of every key (site-configs/generic.yaml) instead of one from Slurm.",
)
@pass_app
def init(app: App, output: Optional[Path], force: bool, to_stdout: bool, example: bool) -> None:
    """Write a starter site config from what Slurm reports (partitions become pools), mode 0644."""
    import platformdirs

    from detslurm.doctor import starter

    text = example_text() if example else _from_slurm(app)
    if to_stdout or (example and output is None):
        click.echo(text, nl=False)
        return
    path = output or Path(platformdirs.user_config_dir("detslurm")) / "site.yaml"
    starter.write_starter(text, path, force)
    click.echo(f"Wrote {path} (mode 0644: every user reads it).")
    click.echo(_next_steps(path))


def example_text() -> str:
    """site-configs/generic.yaml as the package ships it."""
    from importlib.resources import files

    return files("detslurm.site_configs").joinpath("generic.yaml").read_text(encoding="utf-8")


def _from_slurm(app: App) -> str:
    from detslurm.doctor import starter
    from detslurm.doctor.facts import gather
    from detslurm.slurm.site import SiteConfig

    # Described from Slurm alone: an existing site config must not shape its own replacement.
    return starter.starter_yaml(gather(app.client, SiteConfig(), None, app.settings))


def _next_steps(path: Path) -> str:
    from detslurm.slurm.site import ADMIN_SITE_CONFIG

    check = (
        "Check it with `det site doctor` (any user; add --no-probe to submit no probe jobs): it names the "
        "files it read, the file behind each limit, and each pool's partition and nodes, and exits 1 on a problem."
    )
    if path.absolute() == ADMIN_SITE_CONFIG:
        return (
            f"This is the admin's site file: its limits (poll_interval_s, limits:) hold for every user, whatever "
            f"their own site file or environment says. Keep it root's and writable by no one else. {check}"
        )
    return (
        f"detslurm reads {ADMIN_SITE_CONFIG} (the admin's limits), then $DETSLURM_SITE_CONFIG or "
        f"~/.config/detslurm/site.yaml. {check}"
    )


@site.command("postgres-rls")
@click.argument("users", nargs=-1, required=True)
@click.option("--dry-run", is_flag=True, help="Print the SQL and roll it back: change nothing.")
@pass_app
def postgres_rls(app: App, users: tuple[str, ...], dry_run: bool) -> None:
    """Give each of USERS (Unix login names) a role of their own on the shared PostgreSQL store,
    with row-level security: each then reads and changes only their own rows, whatever client
    they use. Run it as the store's admin (DETSLURM_DB_URL naming the role that owns the
    tables), after every upgrade of detslurm too."""
    from detslurm.store import rls

    store = app.store  # opened with the admin's URL: the schema is created or migrated first
    with store.engine.connect() as conn:
        tx = conn.begin()
        result = rls.install(conn, users)
        if dry_run:
            tx.rollback()
            click.echo(";\n".join(result.statements) + ";")
            return
        tx.commit()
    theirs = rls.role_url(store.url, "USER")
    click.echo(f"Row-level security on {len(result.tables)} tables of {store.display_url}; roles: {', '.join(users)}.")
    click.echo(
        f"Each user connects as their own role: DETSLURM_DB_URL={theirs}, with a "
        "password of their own in ~/.pgpass (mode 0600), or peer, GSSAPI or certificate authentication in "
        "pg_hba.conf. A role that trust authentication lets anyone take protects nothing."
    )
