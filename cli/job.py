"""`det job`: Determined's job queue, on Slurm's queue."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
from sqlalchemy import select

from detslurm import queue as q
from detslurm.cli.app import App, pass_app
from detslurm.cli.render import dump_json, table
from detslurm.protocol import ControlRecord, RunPaths
from detslurm.slurm.client import SlurmClient, client_from_env
from detslurm.slurm.parse import QueuedJob, experiment_tag
from detslurm.slurm.states import SlurmState
from detslurm.store.models import Experiment, RunState, TrialRun


@click.group(name="job")
def job() -> None:
    """The job queue: list it, reprioritize, reorder, hold, move between pools."""


def _caller(client: SlurmClient) -> q.Caller:
    caps = client.capabilities()
    return q.Caller(user=client.user, admin=os.geteuid() == 0 or client.user == caps.slurm_user)


def _names(app: App, jobs: list[QueuedJob]) -> dict[str, str]:
    """Job name for our own trials: "<experiment name> (<id>) trial <t>"."""
    out: dict[str, str] = {}
    ids = {j.job_id: j.identity for j in jobs}
    wanted = {i[0] for i in ids.values() if i}
    if not wanted:
        return out
    with app.store.tx() as s:
        rows = s.execute(select(Experiment.id, Experiment.name, Experiment.exp_dir).where(Experiment.id.in_(wanted)))
        names = {i: (name, experiment_tag(d)) for i, name, d in rows}
    comments = {j.job_id: j.comment for j in jobs}
    for jid, i in ids.items():
        # The tag tells our experiment 1 from another store's (or another user's) experiment 1.
        if i and i[0] in names and comments[jid].endswith(f",tag={names[i[0]][1]}"):
            out[jid] = f"{names[i[0]][0]} ({i[0]}) trial {i[1]}"
    return out


def _rows(app: App, jobs: list[QueuedJob]) -> list[dict[str, Any]]:
    names = _names(app, jobs)
    order = sorted(jobs, key=lambda j: (j.partition, j.state != SlurmState.RUNNING, -j.priority, j.submit_time))
    rows: list[dict[str, Any]] = []
    pos: dict[str, int] = {}
    for j in order:
        n = pos.setdefault(j.partition, 0)
        pos[j.partition] = n + 1
        needed = j.gpus or j.num_cpus
        ours = j.identity is not None
        rows.append(
            {
                "#": n,
                "id": j.job_id,
                "type": "TYPE_EXPERIMENT" if ours else "TYPE_EXTERNAL",
                "name": names.get(j.job_id, j.name),
                "priority": q.priority_for(j.nice) if ours else None,
                "slurm_priority": j.priority,
                "nice": j.nice,
                "submitted": j.submit_time.replace("T", " "),
                "slots": f"{needed if j.state == SlurmState.RUNNING else 0}/{needed}",
                "state": "STATE_SCHEDULED" if j.state == SlurmState.RUNNING else "STATE_QUEUED",
                "user": j.user,
                "partition": j.partition,
                "reason": "" if j.state == SlurmState.RUNNING or j.reason == "None" else j.reason,
            }
        )
    return rows


@job.command("list")
@click.option("-p", "--resource-pool", default=None, help="Only this pool's jobs.")
@click.option("--json", "as_json", is_flag=True)
@pass_app
def list_(app: App, resource_pool: str | None, as_json: bool) -> None:
    """Show the queue: your trials, and other users' jobs as TYPE_EXTERNAL (one squeue call)."""
    client = client_from_env()
    jobs = [j for j in client.squeue(all_users=True) if not j.state.is_terminal]
    if resource_pool is not None:
        partition = app.site().pool(resource_pool)[1].partition
        jobs = [j for j in jobs if j.partition == partition]
    rows = _rows(app, jobs)
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
                r["reason"],
            ]
            for r in rows
        ],
    )


job.add_command(list_, "ls")


def _apply(app: App, client: SlurmClient, ops: list[q.Op | q.PoolMove], dry_run: bool) -> None:
    for op in ops:
        click.echo(("would run: " if dry_run else "") + op.describe())
    if dry_run:
        return
    q.execute(client, [o for o in ops if isinstance(o, q.Op)])
    for move in (o for o in ops if isinstance(o, q.PoolMove)):
        _move_experiment(app, move)


def _move_experiment(app: App, move: q.PoolMove) -> None:
    with app.store.tx() as s:
        exp = s.get(Experiment, move.experiment_id)
        if exp is None:
            raise q.QueueError(f"experiment {move.experiment_id} is not in your detslurm store")
        cfg = json.loads(json.dumps(exp.config))
        cfg["resources"]["resource_pool"] = move.pool
        exp.config = cfg
        exp.resource_pool = move.pool
        running = [Path(r.run_dir) for t in exp.trials for r in t.runs if r.state == RunState.RUNNING.value]
    for run_dir in running:
        ControlRecord(preempt=True, reason="pool_move").write(RunPaths.from_run_dir(run_dir).control)


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
    client = client_from_env()
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
    client = client_from_env()
    caller, caps = _caller(client), client.capabilities()
    for job_id, op, value in q.parse_batch(updates):
        queue = client.squeue(all_users=True)
        kw: dict[str, Any] = {
            op.replace("-", "_"): int(value) if op == "priority" and value.lstrip("-").isdigit() else value
        }
        if op == "priority" and not isinstance(kw["priority"], int):
            raise q.QueueError(f"{job_id}.priority={value}: priority must be an integer")
        _apply(app, client, q.plan_update(queue, job_id, caller, caps, app.site(), **kw), dry_run)


__all__ = ["job", "TrialRun"]
