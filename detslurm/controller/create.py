"""Creating an experiment, from the config file to the first submission: :func:`create` is the
one owner of `det e create` (and `det e fork`); the CLI parses its arguments and shows its lines.

In order, each once: validate and package (:func:`plan_create`, no side effects), place the
plan where the trials run (a ``Place`` of controller/placement.py: its check computes the
resource plan), refuse what could never run, show the dry run or write the store, then submit.
The refusal check, the dry run and every submission plan from the config's stored form
(``stored_config``), as the daemon does later, so that the dry run shows exactly what each
submission gets; validation gives the config in that form, so reading it back returns the
config the create validated rather than validating it again, and the first submission plans
with the resource plan the check made. Execution writes the experiment dir and the store rows
in one transaction: on any failure the transaction rolls back and the dir is removed, so a
failed submit leaves nothing half-made.
"""

from __future__ import annotations

import json
import random
import secrets
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import yaml
from sqlalchemy.orm import Session

from detslurm import context as ctxmod
from detslurm.controller import in_allocation as in_allocation_mod
from detslurm.controller.apply import apply_actions
from detslurm.controller.controller import Controller, current_user
from detslurm.controller.executor import Executor, RunSpec
from detslurm.controller.submit import plan_runs
from detslurm.expconf import ExperimentConfig, apply_overrides, merge_config, parse_yaml, validate
from detslurm.identity import Scope
from detslurm.protocol import ExpPaths
from detslurm.searcher import build
from detslurm.searcher.base import Action, Create
from detslurm.searcher.hparams import sample
from detslurm.settings import Settings
from detslurm.store import Store
from detslurm.store.models import Experiment, ExperimentState
from detslurm.util import format_size

if TYPE_CHECKING:
    from detslurm.controller.placement import Place
    from detslurm.slurm.render import ResourcePlan


@dataclass(frozen=True)
class CreatePlan:
    """A validated config and a packaged context: everything a create needs, before any side effect."""

    config: ExperimentConfig
    original_yaml: str
    bundle: ctxmod.ContextBundle
    test_mode: bool
    paused: bool
    # Set by `det e fork`: the experiment this one was made from (Determined's parent id).
    parent_id: int | None = None

    def describe(self) -> str:
        """The plan in words, as shell comments (the dry run's output stays a runnable script)."""
        cfg = self.config
        lines = [
            f"experiment: {cfg.name}",
            f"searcher: {cfg.searcher.name} (metric {cfg.searcher.metric})",
            f"entrypoint: {cfg.entrypoint}",
            f"context: {self.bundle.root} ({len(self.bundle.entries)} entries, "
            f"{format_size(self.bundle.total_bytes)}, sha256 {self.bundle.sha256[:12]})",
        ]
        return "\n".join(f"# {line}" for line in lines)


@dataclass(frozen=True)
class Placement:
    """A create's plan placed where its trials run (``Place.check``): what its refusal check,
    its dry run and its first submission are given."""

    plan: CreatePlan
    # The settings of the config the place does not apply, one line each.
    warnings: tuple[str, ...] = ()
    # On Slurm, the config's resource plan on the site (None where trials are local processes).
    resources: ResourcePlan | None = None


def default_storage(settings: Settings) -> dict[str, Any]:
    """Checkpoint storage for a config that names none: shared_fs under the user's checkpoint_dir."""
    return {"type": "shared_fs", "host_path": str(settings.checkpoint_dir)}


def test_mode_config(raw: dict[str, Any], seed: int) -> dict[str, Any]:
    """Determined's test mode: one trial, one batch, no restarts, hparams fixed to a sample."""
    out: dict[str, Any] = json.loads(json.dumps(raw))
    sc: dict[str, Any] = out["searcher"] if isinstance(out.get("searcher"), dict) else {}
    # The fields Determined's test mode sets (its _make_test_experiment_config): a single searcher
    # trained for one batch, validated after it, and never restarted.
    out["searcher"] = {
        "name": "single",
        "metric": sc.get("metric"),
        "smaller_is_better": sc.get("smaller_is_better", True),
        "max_length": {"batches": 1},
    }
    out["max_restarts"] = 0
    out["min_validation_period"] = {"batches": 1}
    out["scheduling_unit"] = 1
    # The same prefix Determined uses, so test experiments are recognisable in ``det experiment list``.
    out["description"] = f"[test-mode] {out.get('description') or ''}".strip()
    return out


def plan_create(
    settings: Settings,
    config_path: Path,
    context_dir: Path,
    overrides: Sequence[str] = (),
    test_mode: bool = False,
    paused: bool = False,
    allocation: str | None = None,
) -> CreatePlan:
    """Read, override, validate and package an experiment: the printable plan, with no side effects.
    ``allocation``: the job of the Slurm allocation `det` runs in (SLURM_JOB_ID), where the
    trials run as job steps if the config's ``slurm.in_allocation`` asks."""
    try:
        text = Path(config_path).read_text()
    except OSError as e:
        from detslurm.errors import ConfigError

        raise ConfigError([f"{config_path}: cannot read the experiment config: {e.strerror}"]) from None
    raw = in_allocation_mod.bind(apply_overrides(parse_yaml(text), overrides), allocation)
    cfg = validate(raw, default_storage(settings))
    if test_mode:
        # Sampled from the experiment seed, so a repeated test run with a fixed seed tries the same values.
        fixed = sample(cfg.hyperparameters, random.Random(cfg.top.reproducibility.experiment_seed))
        raw = test_mode_config(raw, cfg.top.reproducibility.experiment_seed)
        raw["hyperparameters"] = fixed
        # Validated again: the test config is what is stored and run, so it passes the same checks.
        cfg = validate(raw, default_storage(settings))
    # Packaged now, on the login node: a trial later sees the context as it was at submit time,
    # however the user's directory changes while the experiment runs.
    bundle = ctxmod.package(Path(context_dir))
    return CreatePlan(config=cfg, original_yaml=text, bundle=bundle, test_mode=test_mode, paused=paused)


def _insert(
    s: Session, settings: Settings, plan: CreatePlan, executor_kind: str, first: int | None = None
) -> Experiment:
    """The experiment's rows and its first trials (no files); with ``first``, only the first
    ``first`` of those trials (the refusal check's sample, rolled back)."""
    cfg = plan.config
    exp = Experiment(
        name=cfg.name,
        owner=current_user(),
        description=cfg.top.description,
        config=cfg.as_dict(),
        original_config=plan.original_yaml,
        context_sha256=plan.bundle.sha256,
        exp_dir="",
        executor=executor_kind,
        resource_pool=cfg.resources.resource_pool,
        test_mode=plan.test_mode,
        state=(ExperimentState.PAUSED if plan.paused else ExperimentState.ACTIVE).value,
        progress=0.0,
        archived=False,
        parent_id=plan.parent_id,
    )
    s.add(exp)
    # Flush for the id: the experiment dir is named after it.
    s.flush()
    # A random part makes the dir (and the job tag derived from it) unique to this experiment:
    # two stores sharing an experiments dir (another db_url, a reset store) both have an
    # experiment 1, and must never write into, adopt or delete each other's.
    exp.exp_dir = str(Path(settings.experiments_dir) / f"exp-{exp.id}-{secrets.token_hex(4)}")
    searcher = build(cfg)
    actions = searcher.initial_trials()
    if first is not None:
        # The searcher drew every trial (ids, hparams and seeds in the same order as for the real
        # create); only the first ones, and what concerns them, are recorded.
        actions = _first_trials(actions, first)
    apply_actions(s, exp, searcher, actions)
    # The searcher state is saved with the trials it created, so the daemon resumes right after them.
    exp.searcher_state = searcher.state_dict()
    return exp


def _first_trials(actions: list[Action], n: int) -> list[Action]:
    """The actions that create the first ``n`` trials or concern them, and those that concern no
    trial, in their order."""
    keep = [a.request_id for a in actions if isinstance(a, Create)][:n]
    return [a for a in actions if getattr(a, "request_id", None) in keep or not hasattr(a, "request_id")]


def execute_create(store: Store, settings: Settings, plan: CreatePlan, executor: str) -> int:
    """Create the experiment: rows and dir in one transaction; on any failure neither stays."""
    made: Path | None = None
    try:
        with store.tx() as s:
            exp = _insert(s, settings, plan, executor)
            exp_dir = Path(exp.exp_dir)
            exp_dir.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            exp_dir.mkdir(mode=0o700)  # exclusive: an existing dir is never reused or removed
            made = exp_dir
            layout = ExpPaths(exp_dir)
            ctxmod.write_tarball(plan.bundle, layout.context)
            # The validated config with defaults, next to the context: the experiment dir alone says what ran.
            layout.config.write_text(yaml.safe_dump(exp.config, sort_keys=False))
            return int(exp.id)
    # BaseException: a Ctrl-C during the tarball write must not leave a dir without rows either.
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise


def plan_fork(
    settings: Settings,
    store: Store,
    exp_id: int,
    scope: Scope,
    overrides: Sequence[str],
    staging: Path,
    patch: Mapping[str, Any] | None = None,
    allocation: str | None = None,
) -> CreatePlan:
    """`det e fork`: a new experiment from an existing one's config (with ``overrides``) and the
    very context it ran with, unpacked into ``staging`` (a temporary dir the caller removes)."""
    from detslurm.views import get_experiment

    with store.read() as s:
        parent = get_experiment(s, exp_id, scope)
        config, original = parent.config, parent.original_config
        tarball = ExpPaths(Path(parent.exp_dir)).context
    # The stored config already has the parent's --config overrides and defaults in it; the fork's
    # own overrides go on top and the result is validated like any new config.
    raw = apply_overrides(merge_config(config, patch or {}), overrides)
    # The parent's held job may have ended: an in-allocation fork runs in the one `det` runs in.
    cfg = validate(in_allocation_mod.bind(raw, allocation, fresh=True), default_storage(settings))
    # Unpacked with the same safety checks as on a compute node, then packaged again: the fork's
    # context has the parent's sha256, and the parent's dir is never shared with the child.
    ctxmod.extract_as_packaged(tarball, staging)
    bundle = ctxmod.package(staging)
    return CreatePlan(
        config=cfg, original_yaml=original, bundle=bundle, test_mode=False, paused=False, parent_id=exp_id
    )


class _DryRun(Exception):
    """Raised inside the dry run's transaction to roll it back."""


# The refusal check's sample (see ``dry_run``): two runs keep the job-array form of the real
# submission (one run would be planned as a single job, with other options).
SHAPE_SAMPLE = 2


def dry_run(
    store: Store, settings: Settings, plan: CreatePlan, executor: Executor, *, sample: bool = False
) -> list[RunSpec]:
    """What creating the experiment would submit first, computed by the code that submits
    (the same rows, the same run plans), inside a transaction that is then rolled back. On
    SQLite the ids shown are the ones a create right after would get.

    ``sample``: only the first ``SHAPE_SAMPLE`` runs, for the refusal check. Every first run of
    a new experiment has run number 1 and the experiment's one config, so they are all one job
    shape (the executor groups them into the same array): the first ones are planned exactly as
    the submission will plan them, and admission is the same for the rest. Planning all 256
    runs of a grid to check one shape cost 0.8 s of ``det e create``.
    """
    specs: list[RunSpec] = []
    try:
        with store.tx() as s:
            exp = _insert(s, settings, plan, executor.kind, SHAPE_SAMPLE if sample else None)
            if exp.state == ExperimentState.ACTIVE and sample:
                # Controller.plan_submission's call, with the sample's size for capacity: whether
                # Slurm admits the shape does not depend on the room the user has right now.
                runs = plan_runs(s, exp, SHAPE_SAMPLE, executor.kind, executor.resources_type())
                specs = [spec for _, spec in runs]
            elif exp.state == ExperimentState.ACTIVE:
                specs = [spec for _, spec in Controller(store, executor).plan_submission(s, exp)]
            # Roll back: the dry run must leave no rows, though it ran the real code path to get its answer.
            raise _DryRun
    except _DryRun:
        pass
    return specs


class Echo(Protocol):
    """Where the create's lines go (click.echo in the CLI)."""

    def __call__(self, message: str, *, nl: bool = True, err: bool = False) -> object: ...


def create(
    store: Store, settings: Settings, place: Place, plan: CreatePlan, echo: Echo, *, dry_run: bool = False
) -> int | None:
    """Create the experiment ``plan`` describes where ``place`` runs its trials, and submit its
    first runs: the new experiment's id, or None after a dry run (which leaves nothing behind).

    Every check runs before anything exists, and a dry run fails on exactly what the real
    create would fail on."""
    placed = place.check(plan)
    # A request the cluster can never satisfy (more nodes than the pool has, over MaxTime, an
    # option sbatch rejects) is refused with its numbers here, by the dry run too: otherwise it
    # would sit PENDING forever with nothing said.
    for note in place.refuse_impossible(store, settings, placed, offline=dry_run):
        echo(note, err=True)
    for line in placed.warnings:
        echo(f"Warning: {line}", err=True)
    if dry_run:
        echo(plan.describe())
        echo(place.show(store, settings, placed), nl=False)
        echo("# dry run: nothing was created or submitted")
        return None
    # An unreachable scheduler must fail here: a created experiment that cannot be submitted
    # would sit ACTIVE with nothing running.
    place.require_reachable()
    exp_id = execute_create(store, settings, plan, executor=place.kind)
    forked = f" (forked from experiment {plan.parent_id})" if plan.parent_id is not None else ""
    echo(f"Created experiment {exp_id}{forked}")
    # Queued before `det e create` returns, even if the daemon that takes over is slow to start
    # (a paused experiment's jobs wait for `det e activate`).
    place.submit(placed)
    return exp_id
