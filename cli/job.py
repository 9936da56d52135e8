"""`det job`: Determined's job queue, on Slurm's queue."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import click

from detslurm import queue as q
from detslurm.cli.app import App, pass_app
from detslurm.cli.lazy import lazy_module
from detslurm.cli.render import dump_json, table
from detslurm.slurm.reasons import describe_reason
from detslurm.slurm.states import SlurmState

# Loaded on first use (cli/lazy.py): `det job list` answers from the read layer (store.reads)
# and must not pay for the ORM or the controller.
if TYPE_CHECKING:
    from detslurm.controller import edit
    from detslurm.controller import ops as ops_mod
else:
    edit = lazy_module("detslurm.controller.edit")
    ops_mod = lazy_module("detslurm.controller.ops")

if TYPE_CHECKING:
    from detslurm.slurm.client import SlurmClient
    from detslurm.slurm.parse import QueuedJob


@click.group(name="job")
def job() -> None:
    """The job queue: list it, reprioritize, reorder, hold, move between pools."""


def _caller(client: SlurmClient) -> q.Caller:
    # Admin: root, or the SlurmUser slurmctld runs as. client.user is the OS's name for our uid
    # (never $USER, which whoever starts `det` can set).
    caps = client.capabilities()
    return q.Caller(user=client.user, admin=os.geteuid() == 0 or client.user == caps.slurm_user)


def _names(app: App, jobs: list[QueuedJob]) -> tuple[dict[str, str], dict[str, str]]:
    """Our trials' names for their jobs, and those of detached runs (another user's experiment
    names are not shown)."""
    owner = app.scope.owner
    wanted = {j.identity[0] for j in jobs if j.identity}
    names = q.trial_job_names(jobs, app.reads.experiment_names(wanted, owner)) if wanted else {}
    detached = q.detached_job_names(app.reads.detached_runs([j.job_id for j in jobs], owner)) if jobs else {}
    return names, detached


def _rows(app: App, jobs: list[QueuedJob]) -> list[dict[str, Any]]:
    names, detached = _names(app, jobs)
    names.update(detached)
    # Determined lists a pool's queue running jobs first, then pending ones in scheduling
    # order; Slurm's order is priority, then submit time for ties.
    order = sorted(jobs, key=lambda j: (j.partition, j.state != SlurmState.RUNNING, -j.priority, j.submit_time))
    rows: list[dict[str, Any]] = []
    pos: dict[str, int] = {}
    for j in order:
        n = pos.setdefault(j.partition, 0)
        pos[j.partition] = n + 1
        # A job's slots are its GPUs when it asks for any, else its CPUs (as a pool's slot type).
        needed = j.gpus or j.num_cpus
        ours = j.identity is not None
        # squeue prints the literal "None" for a job that is not waiting on anything.
        reason = "" if j.state == SlurmState.RUNNING or j.reason == "None" else j.reason
        rows.append(
            {
                "#": n,
                "id": j.job_id,
                # Any user's detslurm trial carries an identity tag in its comment: TYPE_EXPERIMENT, as
                # Determined shows every user's experiments. Jobs without one (other tools', plain
                # sbatch) are TYPE_EXTERNAL, as Determined shows jobs its master does not manage.
                # Detached jobs are the user's own sbatch scripts that detslurm records (core_v2).
                "type": "TYPE_EXPERIMENT" if ours or j.job_id in detached else "TYPE_EXTERNAL",
                "name": names.get(j.job_id, j.name),
                # Only our jobs' nice values were set on Determined's 1..99 scale; mapping a foreign nice
                # would show a priority nobody chose.
                "priority": q.priority_for(j.nice) if ours else None,
                "slurm_priority": j.priority,
                "nice": j.nice,
                "submitted": j.submit_time.replace("T", " "),
                "slots": f"{needed if j.state == SlurmState.RUNNING else 0}/{needed}",
                "state": "STATE_SCHEDULED" if j.state == SlurmState.RUNNING else "STATE_QUEUED",
                "user": j.user,
                "partition": j.partition,
                "reason": reason,
                # The same code in words, with the code beside them ("waiting for free nodes (Resources)").
                "reason_text": describe_reason(reason) if reason else "",
            }
        )
    return rows


def queue_rows(app: App, resource_pool: str | None) -> list[dict[str, Any]]:
    """The queue as `det job list --json` prints it (also the dashboard's job queue)."""
    client = app.client
    # All users: a job's place in the queue depends on everyone's jobs, not only ours.
    jobs = [j for j in client.squeue(all_users=True) if not j.state.is_terminal]
    if resource_pool is not None:
        # An unknown pool name is an error from the site config, not an empty list.
        partition = app.site().pool(resource_pool)[1].partition
        jobs = [j for j in jobs if j.partition == partition]
    return _rows(app, jobs)


@job.command("list")
@click.option("-p", "--resource-pool", default=None, help="Only this pool's jobs.")
@click.option("--json", "as_json", is_flag=True)
@pass_app
def list_(app: App, resource_pool: str | None, as_json: bool) -> None:
    """Show the queue (one squeue call): every user's detslurm trials as TYPE_EXPERIMENT, jobs
    detslurm did not submit as TYPE_EXTERNAL."""
    rows = queue_rows(app, resource_pool)
    if as_json:
        dump_json(rows)
        return
    table(
        [
            "#",
            "ID",
            "Type",
            "Job Name",
            "Priority",
            "Slurm Priority",
            "Submitted",
            "Slots (acquired/needed)",
            "Status",
            "User",
            "Pool",
            "Pending Reason",
        ],
        [
            [
                r["#"],
                r["id"],
                r["type"],
                r["name"],
                "" if r["priority"] is None else r["priority"],
                r["slurm_priority"],
                r["submitted"],
                r["slots"],
                r["state"],
                r["user"],
                r["partition"],
                r["reason_text"],
            ]
            for r in rows
        ],
    )


job.add_command(list_, "ls")


def _apply(app: App, client: SlurmClient, ops: list[q.Op | q.PoolMove | q.SavePriority], dry_run: bool) -> None:
    for op in ops:
        click.echo(("would run: " if dry_run else "") + op.describe())
    if dry_run:
        return
    # scontrol changes go first; pool moves are store changes the daemon acts on later
    # (checkpoint, then resubmit in the new partition), not Slurm calls.
    q.execute(client, [o for o in ops if isinstance(o, q.Op)])
    for move in (o for o in ops if isinstance(o, q.PoolMove)):
        ops_mod.move_to_pool(app.store, move.experiment_id, move.pool, tag=move.tag, scope=app.scope)
    for save in (o for o in ops if isinstance(o, q.SavePriority)):
        # Another store's trial (tag mismatch) keeps only the scontrol change above.
        edit.save_priority(app.store, save.experiment_id, save.priority, tag=save.tag, scope=app.scope)


@job.command("update")
@click.argument("job_id")
@click.option("-p", "--priority", type=int, default=None, help="1..99, smaller is higher (Determined's scale).")
@click.option("--ahead-of", default=None, metavar="JOB_ID")
@click.option("--behind-of", default=None, metavar="JOB_ID")
@click.option("--resource-pool", default=None)
@click.option("--hold", is_flag=True)
@click.option("--release", is_flag=True)
@click.option("--dry-run", is_flag=True, help="Print the scontrol calls; change nothing.")
@pass_app
def update(
    app: App,
    job_id: str,
    priority: int | None,
    ahead_of: str | None,
    behind_of: str | None,
    resource_pool: str | None,
    hold: bool,
    release: bool,
    dry_run: bool,
) -> None:
    """Change one job in the queue."""
    client = app.client
    queue = client.squeue(all_users=True)
    ops = q.plan_update(
        queue,
        job_id,
        _caller(client),
        client.capabilities(),
        app.site(),
        priority=priority,
        ahead_of=ahead_of,
        behind_of=behind_of,
        resource_pool=resource_pool,
        hold=hold,
        release=release,
    )
    _apply(app, client, ops, dry_run)
    if not ops:
        click.echo(f"job {job_id}: nothing to change")


@job.command("update-batch")
@click.argument("updates", nargs=-1, required=True)
@click.option("--dry-run", is_flag=True)
@pass_app
def update_batch(app: App, updates: tuple[str, ...], dry_run: bool) -> None:
    """Several updates: ID.priority=N ID.resource-pool=P ID.ahead-of=ID2 ..."""
    client = app.client
    caller, caps = _caller(client), client.capabilities()
    # The queue is read again for each update: an earlier --ahead-of or priority change in
    # the same batch moves the jobs a later one is planned against.
    for job_id, op, value in q.parse_batch(updates):
        queue = client.squeue(all_users=True)
        kw: dict[str, Any] = {
            op.replace("-", "_"): int(value) if op == "priority" and value.lstrip("-").isdigit() else value
        }
        if op == "priority" and not isinstance(kw["priority"], int):
            raise q.QueueError(f"{job_id}.priority={value}: priority must be an integer")
        _apply(app, client, q.plan_update(queue, job_id, caller, caps, app.site(), **kw), dry_run)
