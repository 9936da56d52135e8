"""`det job`: Determined's job queue, on Slurm's queue."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import click

from detslurm import queue as q
from detslurm.cli.app import App, pass_app
from detslurm.cli.lazy import lazy_module
from detslurm.cli.render import dump_json, table
from detslurm.errors import ConfigError, DetSlurmError
from detslurm.slurm.reasons import describe_reason
from detslurm.slurm.states import SlurmState

# Loaded on first use (cli/lazy.py): `det job list` answers from the read layer (store.reads)
# and must not pay for the ORM or the controller.
if TYPE_CHECKING:
    from detslurm.controller import queue_store as qs
else:
    qs = lazy_module("detslurm.controller.queue_store")

if TYPE_CHECKING:
    from detslurm.slurm.client import SlurmClient
    from detslurm.slurm.parse import Capabilities, QueuedJob


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


def _shapes(
    app: App, job: QueuedJob, pool: str, trial: qs.Trial | None, caller: q.Caller
) -> tuple[q.Shape | None, q.Shape]:
    """The job's shape in its pool and in ``pool`` (see queue.plan_pool); refuses a pool its
    trial could never run in, as the create would. Another user's job takes the account, QOS
    and time of the site's pools only (queue_store.trial_shape says why)."""
    site = app.site()
    config = trial.config() if trial is not None else None
    if config is None:
        return None, qs.pool_shape(site, pool)  # an unknown pool fails here
    owners = job.user == caller.user
    dst, locked = qs.trial_shape(config, site, pool, owners_limits=owners)
    never = locked or qs.never_runs(config, site, pool, app.client)
    if never:
        raise q.QueueError(
            f"job {job.job_id} was not moved: its trial could never run in pool {pool}: {'; '.join(never)}"
        )
    try:
        src = qs.trial_shape(config, site, config.resources.resource_pool, owners_limits=owners)[0]
    except ConfigError:
        src = None  # its pool is gone from the site config: nothing to compare with
    return src, dst


Planned = list[q.Op | q.PoolMove | q.Replace | q.SavePriority | q.NotKept]


def _plan(
    app: App, queue: list[QueuedJob], job_id: str, caller: q.Caller, caps: Capabilities, **change: Any
) -> tuple[Planned, qs.Trial | None]:
    """The queue edit's operations, with the trial's experiment they are kept in (if any)."""
    client = app.client
    job = q.find_job(queue, job_id, caller)
    if os.geteuid() == 0 and job.user != caller.user:
        app.start_audit()  # root's change to another user's job is recorded (docs/admin/audit.md)
    pool = change.pop("resource_pool", None)
    trial = None
    if pool is not None or change.get("priority") is not None:
        trial = qs.trial_of(job, caller.user, store=app.store, scope=app.scope, client=client, audit=app.audit)
    target = None
    if pool is not None:
        shown = client.show_job(job.job_id) if job.state == SlurmState.PENDING else {}
        target = (pool, _shapes(app, job, pool, trial, caller), shown)
    keeper = trial.keeper if trial else None
    return q.plan_update(queue, job_id, caller, caps, keeper=keeper, pool=target, **change), trial


def _apply(app: App, planned: tuple[Planned, qs.Trial | None], dry_run: bool) -> None:
    ops, trial = planned
    for op in ops:
        click.echo(("would run: " if dry_run else "") + op.describe())
    if dry_run:
        return
    client = app.client
    for op in ops:
        if isinstance(op, q.NotKept):
            click.echo(f"Warning: {op.text}", err=True)
        elif isinstance(op, q.Op):
            _scontrol(client, op, ops, trial)
        else:
            assert trial is not None, "store changes are planned for trials only"
            _keep(trial.keeping, op)


def _scontrol(client: SlurmClient, op: q.Op, ops: Planned, trial: qs.Trial | None) -> None:
    """One scontrol call. A pool move Slurm refuses part way (it applies the fields it takes and
    refuses the rest) is made whole: a trial's job is replaced instead, any other job's state is
    reported field by field."""
    from detslurm.slurm.client import SlurmCommandError

    try:
        q.execute(client, [op])
    except SlurmCommandError as e:
        move = next((o for o in ops if isinstance(o, q.PoolMove)), None)
        if move is None or trial is None:
            if op.verb == "release" and "permission denied" in e.stderr.lower():
                raise q.QueueError(f"{e.stderr}: job {op.job_id} may be held by an administrator") from None
            raise q.QueueError(f"Slurm refused: {e.stderr}{_now(client, op)}") from None
        click.echo(f"Slurm refused the update in place ({e.stderr}); replacing the job instead", err=True)
        _keep(trial.keeping, q.Replace(op.job_id, move.experiment_id, move.pool, "", move.tag, move.where))
        ops.remove(move)  # done by the replacement


def _now(client: SlurmClient, op: q.Op) -> str:
    """What the job has now of the fields a failed update asked for."""
    if not op.fields:
        return ""
    shown = client.show_job(op.job_id)
    asked = {"CPUsPerTask": "CPUs/Task"}
    now = " ".join(f"{k}={shown.get(asked.get(k, k), '?')}" for k, _ in op.fields)
    return f"; job {op.job_id} now has {now}"


def _keep(keeping: qs.Keeping, op: q.PoolMove | q.Replace | q.SavePriority) -> None:
    """Keep a change in the trial's experiment; if that fails, say exactly what did change."""
    try:
        if isinstance(op, q.Replace):
            keeping.replace(op.experiment_id, op.pool, op.tag, op.job_id)
        elif isinstance(op, q.PoolMove):
            keeping.move(op.experiment_id, op.pool, op.tag)
        else:
            keeping.save_priority(op.experiment_id, op.priority, op.tag)
    except DetSlurmError as e:
        if isinstance(op, q.Replace):
            raise q.QueueError(f"job {op.job_id} was not moved: {e}; nothing changed") from None
        what = f"pool {op.pool}" if isinstance(op, q.PoolMove) else f"priority {op.priority}"
        raise q.QueueError(
            f"the job's Slurm change above was made, but experiment {op.experiment_id} ({op.where}) did not keep "
            f"{what}: {e}; its later submissions do not have it (run the update again)"
        ) from None


@job.command("update")
@click.argument("job_id")
@click.option("-p", "--priority", type=int, default=None, help="1..99, smaller is higher (Determined's scale).")
@click.option("--ahead-of", default=None, metavar="JOB_ID")
@click.option("--behind-of", default=None, metavar="JOB_ID")
@click.option("--resource-pool", default=None, help="Move to this pool, with its resources (docs/user/queue.md).")
@click.option("--hold", is_flag=True)
@click.option("--release", is_flag=True)
@click.option("--dry-run", is_flag=True, help="Print the scontrol calls and store changes; change nothing.")
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
    planned = _plan(
        app,
        client.squeue(all_users=True),
        job_id,
        _caller(client),
        client.capabilities(),
        priority=priority,
        ahead_of=ahead_of,
        behind_of=behind_of,
        resource_pool=resource_pool,
        hold=hold,
        release=release,
    )
    _apply(app, planned, dry_run)
    if not planned[0]:
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
        _apply(app, _plan(app, queue, job_id, caller, caps, **kw), dry_run)
