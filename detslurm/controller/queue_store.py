"""Where `det job update` keeps a trial's queue edits, and the trial's shape in a pool.

A priority or pool given to one trial's job must also reach its experiment, or the trial's next
submission (a restart, a resume) goes back to the old ones. The experiment is in the caller's
store, except when root changes another user's trial: with per-user stores (the default) it is
in the owner's store, which root does not open as root (a store, its directory and its rows are
the owner's to name; root following them would write where the owner points it). Root's `det`
starts a child process as the owner instead (:class:`AsOwner`): it opens the store the owner's
own `det` would open (the owner's home, config file and defaults; a store the owner names only
in their shell's environment cannot be found) and makes the change with the owner's rights. The
child answers with one JSON line, read as untrusted input.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from detslurm import queue as q
from detslurm.errors import DetSlurmError, StateError
from detslurm.identity import Scope, os_user
from detslurm.slurm.parse import comment_tag, experiment_tag
from detslurm.util import printable

if TYPE_CHECKING:
    from detslurm.audit import AuditLog
    from detslurm.expconf import ExperimentConfig
    from detslurm.slurm.client import SlurmClient
    from detslurm.slurm.parse import QueuedJob
    from detslurm.slurm.site import SiteConfig
    from detslurm.store import Store

# The child's whole answer; a store's answer is a few kB (one experiment's config).
_MAX_ANSWER = 4 << 20
_CHILD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Found:
    """The experiment a job's comment names, as one store holds it."""

    where: str  # the store in words
    config: dict[str, Any] | None  # its stored config; None when not found
    missing: str = ""  # why it is not found ("" when it is)


class Keeping(Protocol):
    """One store's side of a queue edit: find the experiment, then keep the change there."""

    def find(self, exp_id: int, tag: str) -> Found: ...

    def move(self, exp_id: int, pool: str, tag: str) -> None: ...

    def replace(self, exp_id: int, pool: str, tag: str, job_id: str) -> None: ...

    def save_priority(self, exp_id: int, priority: int, tag: str) -> None: ...


class InStore:
    """The caller's own store (root's --all-users reaches other owners' rows of a shared one)."""

    def __init__(self, store: Store, scope: Scope, client: SlurmClient, where: str = "your store") -> None:
        self.store, self.scope, self.client, self.where = store, scope, client, where

    def find(self, exp_id: int, tag: str) -> Found:
        from detslurm.store.models import Experiment

        with self.store.read() as s:
            exp = s.get(Experiment, exp_id)
            if exp is None or not self.scope.sees(exp.owner):
                return Found(self.where, None, f"{self.where} has no experiment {exp_id}")
            if tag != experiment_tag(exp.exp_dir):
                why = (
                    f"experiment {exp_id} of {self.where} did not submit this job: it was submitted from another store"
                )
                return Found(self.where, None, why)
            return Found(self.where, dict(exp.config))

    def move(self, exp_id: int, pool: str, tag: str) -> None:
        from detslurm.controller import ops

        ops.move_to_pool(self.store, exp_id, pool, tag=tag, scope=self.scope)

    def replace(self, exp_id: int, pool: str, tag: str, job_id: str) -> None:
        from detslurm.controller import ops

        def cancel(jobs: Sequence[str]) -> None:
            self.client.scancel(jobs, pending_only=True)

        ops.replace_queued_job(self.store, exp_id, pool, job_id, tag=tag, cancel_pending=cancel, scope=self.scope)

    def save_priority(self, exp_id: int, priority: int, tag: str) -> None:
        from detslurm.controller import edit

        if not edit.save_priority(self.store, exp_id, priority, tag=tag, scope=self.scope):
            raise StateError(f"experiment {exp_id} of {self.where} did not submit this job")


class AsOwner:
    """Another user's store, reached by a child process that runs as that user (module doc)."""

    def __init__(self, owner: str, audit: AuditLog | None = None) -> None:
        self.owner = owner
        self.where = f"{owner}'s store"
        self.audit = audit

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.audit is None or request["op"] == "find":
            return self._child(request)
        # A change to another user's experiment, and the scancel its replacement makes as them,
        # are root's actions too: recorded before, then with their outcome (detslurm/audit.py).
        self.audit.write("as_owner", owner=self.owner, request=request)
        try:
            answer = self._child(request)
        except StateError as e:
            self.audit.write("as_owner_result", owner=self.owner, request=request, error=str(e))
            raise
        self.audit.write("as_owner_result", owner=self.owner, request=request, error=None)
        return answer

    def _child(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            pw = pwd.getpwnam(self.owner)
        except KeyError:
            raise StateError(f"{self.owner} has no account on this machine") from None
        # Only what the owner's own login would have: their home, and where Slurm is (the cluster,
        # not the user's choice). Nothing of root's environment (its DETSLURM_* dirs) leaks in.
        env = {"HOME": pw.pw_dir, "USER": self.owner, "LOGNAME": self.owner, "PATH": os.environ.get("PATH", "")}
        if "SLURM_CONF" in os.environ:
            env["SLURM_CONF"] = os.environ["SLURM_CONF"]
        try:
            done = subprocess.run(
                # -I: neither the owner's PYTHON* variables nor a module in the working dir run.
                [sys.executable, "-I", "-m", "detslurm.controller.queue_store"],
                input=json.dumps(request),
                capture_output=True,
                text=True,
                timeout=_CHILD_TIMEOUT_S,
                env=env,
                cwd="/",
                # A session of its own, with no controlling terminal: the owner may ptrace their
                # own process, and one holding root's terminal could type into root's shell
                # (TIOCSTI) or write to it.
                start_new_session=True,
                # Not root's umask: what it creates in the owner's store (a journal, a WAL) is
                # the owner's alone, whatever root's shell had set.
                umask=0o077,
                user=pw.pw_uid,
                group=pw.pw_gid,
                extra_groups=os.getgrouplist(self.owner, pw.pw_gid),
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise StateError(f"cannot open {self.where} as {self.owner}: {e}") from None
        try:
            answer = json.loads(done.stdout[:_MAX_ANSWER].strip().splitlines()[-1])
            assert isinstance(answer, dict)
        except (ValueError, IndexError, AssertionError, RecursionError):
            said = printable((done.stderr.strip().splitlines() or ["no answer"])[-1][:500])
            raise StateError(f"cannot open {self.where} as {self.owner}: {said}") from None
        # The owner's words (their paths, their store's messages) are shown on root's terminal.
        self.where = _one_line(answer.get("where", self.where), 500)
        if answer.get("error"):
            raise StateError(_one_line(answer["error"], 2000))
        return answer

    def find(self, exp_id: int, tag: str) -> Found:
        try:
            a = self._ask({"op": "find", "experiment_id": exp_id, "tag": tag})
        except StateError as e:
            return Found(self.where, None, str(e))
        config = a.get("config")
        missing = _one_line(a.get("missing", ""), 2000)
        return Found(self.where, config if isinstance(config, dict) else None, missing)

    def move(self, exp_id: int, pool: str, tag: str) -> None:
        self._ask({"op": "move", "experiment_id": exp_id, "tag": tag, "pool": pool})

    def replace(self, exp_id: int, pool: str, tag: str, job_id: str) -> None:
        self._ask({"op": "replace", "experiment_id": exp_id, "tag": tag, "pool": pool, "job_id": job_id})

    def save_priority(self, exp_id: int, priority: int, tag: str) -> None:
        self._ask({"op": "priority", "experiment_id": exp_id, "tag": tag, "priority": priority})


def _one_line(text: object, limit: int) -> str:
    """Text from the owner's child, cut to ``limit`` and safe on root's terminal."""
    return printable(str(text)[:limit]).replace("\n", " ")


@dataclass(frozen=True)
class Trial:
    """A job's experiment, found: where its edits are kept, and its stored config (for its shapes)."""

    keeper: q.Keeper
    keeping: Keeping
    stored: dict[str, Any] | None

    def config(self) -> ExperimentConfig | None:
        """The stored config, validated again (a row is anyone's with the database's password)."""
        if self.stored is None:
            return None
        from detslurm.expconf import from_stored

        where = f"<experiment {self.keeper.experiment_id} of {self.keeper.where}>"
        return from_stored(self.stored, where)


def trial_of(
    job: QueuedJob,
    caller_user: str,
    *,
    store: Store,
    scope: Scope,
    client: SlurmClient,
    audit: AuditLog | None = None,
) -> Trial | None:
    """The experiment ``job`` is a trial of (None for a job that is no detslurm trial): in the
    caller's store for the caller's own jobs (and for another owner's rows of a shared store
    under root's --all-users), else in the owner's store through :class:`AsOwner` (whose
    changes go to root's ``audit`` log)."""
    ids = job.identity
    if ids is None:
        return None
    exp_id, tag = ids[0], comment_tag(job.comment)
    own = InStore(store, scope, client, "your store")
    keepings: list[Keeping] = [own]
    if job.user != caller_user:
        if scope.owner is not None:
            # Another user's experiment is theirs to change: root says so explicitly.
            why = f"it is {job.user}'s; changing another user's experiment takes det --all-users"
            return Trial(q.Keeper(exp_id, tag, f"{job.user}'s store", why), own, None)
        # A shared store holds the owner's rows (root's --all-users sees them); else the owner's own.
        keepings.append(AsOwner(job.user, audit))
    missing: list[str] = []
    for keeping in keepings:
        found = keeping.find(exp_id, tag)
        if found.config is not None:
            return Trial(q.Keeper(exp_id, tag, found.where), keeping, found.config)
        missing.append(found.missing)
    return Trial(q.Keeper(exp_id, tag, "", "; ".join(missing)), keepings[-1], None)


# -- shapes -------------------------------------------------------------------------------------


def _in_pool(config: ExperimentConfig, pool: str | None, **slurm: Any) -> ExperimentConfig:
    """``config`` as it would be stored after a move to ``pool`` (validated again), with the
    ``slurm`` section's keys given here replaced."""
    from detslurm.expconf import from_stored
    from detslurm.expconf.view import merge_config

    patch: dict[str, Any] = {"resources": {"resource_pool": pool}}
    if slurm:
        patch["slurm"] = slurm
    return from_stored(merge_config(config.as_dict(), patch), "<moved config>")


def trial_shape(
    config: ExperimentConfig, site: SiteConfig, pool: str | None, *, owners_limits: bool = True
) -> tuple[q.Shape, list[str]]:
    """What a fresh submission of a trial of ``config`` asks for in ``pool`` (the resource plan
    sbatch gets), and why it could never run there (the create's refusal check: sizes, limits).

    ``owners_limits=False`` (root changing another user's job): the account, QOS and time are
    only those the site's pool sets, never the ones in the owner's sbatch_args. The stored config
    is the owner's to write, and root's ``scontrol update`` is not held to the owner's rights
    (an administrator may raise a time limit or set any QOS): the owner's own values were
    judged by Slurm with the owner's rights when they submitted, and are left as they are."""
    from detslurm.slurm.refusals import job_shape, site_limit_refusals
    from detslurm.slurm.render import image_for, resource_plan

    moved = _in_pool(config, pool)
    res = resource_plan(moved, site)  # an unknown pool fails here
    shape = job_shape(moved, site, res)
    if not owners_limits:
        shape = job_shape(_in_pool(config, pool, sbatch_args=[]), site, res)
    _, p = site.pool(pool or "")
    image = ""
    if site.runs_containers:
        from detslurm.slurm.containers import Gpu

        gpu = (Gpu.AMD if site.container.gpu_vendor == "amd" else Gpu.NVIDIA) if res.gpu else Gpu.NONE
        image = image_for(moved, gpu) or ""
    gres = next((a.removeprefix("--gres=") for a in res.args if a.startswith("--gres=")), "")
    cpus = next((int(a.removeprefix("--cpus-per-task=")) for a in res.args if a.startswith("--cpus-per-task=")), 1)
    return (
        q.Shape(
            partition=p.partition,
            gpu_pool=p.slot_type == "gpu",
            nodes=res.nodes,
            gres=gres,
            cpus_per_task=cpus,
            account=shape.account.value if shape.account else "",
            qos=shape.qos.value if shape.qos else "",
            time=shape.time.value if shape.time else "",
            extra=tuple(p.extra_sbatch_args),
            image=image,
        ),
        [str(r) for r in site_limit_refusals(moved, site)],
    )


def pool_shape(site: SiteConfig, pool: str) -> q.Shape:
    """What ``pool`` itself sets, for a job that is no detslurm trial (its shape is its own)."""
    _, p = site.pool(pool)
    time = str(p.time_limit_min) if p.time_limit_min else ""
    return q.Shape(p.partition, p.slot_type == "gpu", account=p.account or "", qos=p.qos or "", time=time)


def never_runs(config: ExperimentConfig, site: SiteConfig, pool: str, client: SlurmClient) -> list[str]:
    """Why a trial of ``config`` could never run in ``pool`` on this cluster ([] when it may):
    the create's checks of the shape against the partitions and their nodes."""
    from detslurm.slurm.refusals import check_shape, job_shape
    from detslurm.slurm.render import resource_plan

    moved = _in_pool(config, pool)
    shape = job_shape(moved, site, resource_plan(moved, site))
    return [str(r) for r in check_shape(shape, client.partitions(), client.nodes())]


# -- the child ----------------------------------------------------------------------------------


def _serve(request: Mapping[str, Any]) -> dict[str, Any]:
    """One request, as the owner, on the store the owner's `det` opens."""
    from detslurm import settings
    from detslurm.settings import _mask_url
    from detslurm.slurm.client import client_from_env
    from detslurm.store import open_store

    url = settings.load().db_url
    where = f"{os_user()}'s store ({_mask_url(url).removeprefix('sqlite:///')})"
    keeping = InStore(open_store(url), Scope.mine(), client_from_env(), where)
    exp_id, tag, op = int(request["experiment_id"]), str(request["tag"]), request["op"]
    if op == "find":
        found = keeping.find(exp_id, tag)
        return {"where": where, "config": found.config, "missing": found.missing}
    if op == "move":
        keeping.move(exp_id, str(request["pool"]), tag)
    elif op == "replace":
        keeping.replace(exp_id, str(request["pool"]), tag, str(request["job_id"]))
    elif op == "priority":
        keeping.save_priority(exp_id, int(request["priority"]), tag)
    else:
        raise StateError(f"unknown request {op!r}")
    return {"where": where}


def main() -> int:
    try:
        answer = _serve(json.loads(sys.stdin.read(1 << 16)))
    except (DetSlurmError, ValueError, KeyError, TypeError) as e:
        answer = {"error": str(e)}
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
