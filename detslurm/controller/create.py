"""Creating an experiment: plan (validate + package, no side effects), then execute.

The plan is printable (``--dry-run``). Execution writes the experiment dir and the store rows
in one transaction: on any failure the transaction rolls back and the dir is removed, so a
failed submit leaves nothing half-made.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from detslurm import context as ctxmod
from detslurm.controller.apply import apply_actions
from detslurm.controller.controller import current_user, storage_base
from detslurm.expconf import ExperimentConfig, apply_overrides, parse_yaml, validate
from detslurm.protocol import ExpPaths, trial_env
from detslurm.searcher import Create, build
from detslurm.searcher.hparams import sample
from detslurm.settings import Settings
from detslurm.slurm.render import ArrayTask, Identity, SbatchRequest, plan_array, plan_trial_run
from detslurm.slurm.site import SiteConfig
from detslurm.store import Store
from detslurm.store.models import Experiment, ExperimentState


@dataclass(frozen=True)
class CreatePlan:
    config: ExperimentConfig
    original_yaml: str
    bundle: ctxmod.ContextBundle
    test_mode: bool
    paused: bool

    def describe(self) -> str:
        c = self.config.as_dict()
        lines = [
            f"experiment: {c['name']}",
            f"searcher: {c['searcher']['name']} (metric {c['searcher']['metric']})",
            f"entrypoint: {c['entrypoint']}",
            f"context: {self.bundle.root} ({len(self.bundle.entries)} entries, "
            f"{self.bundle.total_bytes / 1024:.1f} KiB, sha256 {self.bundle.sha256[:12]})",
        ]
        return "\n".join(lines)


def default_storage(settings: Settings) -> dict[str, Any]:
    return {"type": "shared_fs", "host_path": str(settings.checkpoint_dir)}


def test_mode_config(raw: dict[str, Any], seed: int) -> dict[str, Any]:
    """Determined's test mode: one trial, one batch, no restarts, hparams fixed to a sample."""
    out: dict[str, Any] = json.loads(json.dumps(raw))
    sc: dict[str, Any] = out["searcher"] if isinstance(out.get("searcher"), dict) else {}
    out["searcher"] = {
        "name": "single",
        "metric": sc.get("metric"),
        "smaller_is_better": sc.get("smaller_is_better", True),
        "max_length": {"batches": 1},
    }
    out["max_restarts"] = 0
    out["min_validation_period"] = {"batches": 1}
    out["scheduling_unit"] = 1
    out["description"] = f"[test-mode] {out.get('description') or ''}".strip()
    return out


def plan_create(
    settings: Settings,
    config_path: Path,
    context_dir: Path,
    overrides: Sequence[str] = (),
    test_mode: bool = False,
    paused: bool = False,
) -> CreatePlan:
    try:
        text = Path(config_path).read_text()
    except OSError as e:
        from detslurm.errors import ConfigError

        raise ConfigError([f"{config_path}: cannot read the experiment config: {e.strerror}"]) from None
    raw = apply_overrides(parse_yaml(text), overrides)
    cfg = validate(raw, default_storage(settings))
    if test_mode:
        fixed = sample(cfg.hyperparameters, random.Random(cfg.top.reproducibility.experiment_seed))
        raw = test_mode_config(raw, cfg.top.reproducibility.experiment_seed)
        raw["hyperparameters"] = fixed
        cfg = validate(raw, default_storage(settings))
    bundle = ctxmod.package(Path(context_dir))
    return CreatePlan(config=cfg, original_yaml=text, bundle=bundle, test_mode=test_mode, paused=paused)


def execute_create(store: Store, settings: Settings, plan: CreatePlan, executor: str) -> int:
    cfg = plan.config.as_dict()
    exp_dir: Path | None = None
    try:
        with store.tx() as s:
            exp = Experiment(
                name=cfg["name"],
                owner=current_user(),
                description=cfg.get("description"),
                config=cfg,
                original_config=plan.original_yaml,
                context_sha256=plan.bundle.sha256,
                exp_dir="",
                executor=executor,
                resource_pool=cfg["resources"]["resource_pool"],
                test_mode=plan.test_mode,
                state=(ExperimentState.PAUSED if plan.paused else ExperimentState.ACTIVE).value,
                progress=0.0,
                archived=False,
            )
            s.add(exp)
            s.flush()
            exp_dir = Path(settings.experiments_dir) / f"exp-{exp.id}"
            if exp_dir.exists():  # left by a create that crashed before its commit
                shutil.rmtree(exp_dir)
            exp_dir.mkdir(parents=True, mode=0o700)
            exp.exp_dir = str(exp_dir)
            layout = ExpPaths(exp_dir)
            ctxmod.write_tarball(plan.bundle, layout.context)
            layout.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
            searcher = build(cfg)
            apply_actions(s, exp, searcher, searcher.initial_trials())
            exp.searcher_state = searcher.state_dict()
            return int(exp.id)
    except BaseException:
        if exp_dir is not None:
            shutil.rmtree(exp_dir, ignore_errors=True)
        raise


def preview_sbatch(plan: CreatePlan, settings: Settings, site: SiteConfig) -> list[SbatchRequest]:
    """What the first submission would be (ids not known yet: the experiment shows as 0, its
    trials as 1, 2, ...): one job, or one job array for trials that share resources."""
    cfg = plan.config.as_dict()
    exp_dir = Path(settings.experiments_dir) / "exp-0"
    layout = ExpPaths(exp_dir)
    python = site.python or sys.executable
    tasks = []
    for i, act in enumerate(a for a in build(cfg).initial_trials() if isinstance(a, Create)):
        run_dir = layout.run_dir(i + 1, 1)
        env = trial_env(
            experiment_id=0,
            trial_id=i + 1,
            run_id=1,
            seed=act.seed,
            hparams=act.hparams,
            config=cfg,
            latest_checkpoint=None,
            steps_completed=0,
            run_dir=run_dir,
            trial_dir=layout.trial_dir(i + 1),
            exp_dir=exp_dir,
            checkpoint_base=storage_base(cfg),
            resources_type="slurm-job",
            slot_ids=[],
            container_addrs=[],
            user=current_user(),
        )
        tasks.append(ArrayTask(i + 1, str(run_dir), env))
    if len(tasks) == 1:
        return [
            plan_trial_run(
                config=cfg,
                site=site,
                ident=Identity(0, 1, 1),
                env=tasks[0].env,
                run_dir=tasks[0].run_dir,
                log_path=str(layout.run(1, 1).output_log),
                python=python,
            )
        ]
    return [
        plan_array(
            config=cfg,
            site=site,
            ident=Identity(0, 1, 1, array=True),
            tasks=tasks,
            links_dir=str(layout.array_links(1, 1)),
            log_name=layout.run(1, 1).output_log.name,
            python=python,
        )
    ]
