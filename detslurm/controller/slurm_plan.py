"""The plan of a submission to Slurm, and the check that Slurm could ever run it.

``plan_many`` is the whole plan of a submission: ``det e create --dry-run`` prints exactly
what it returns, and ``SlurmExecutor.submit_many`` (controller/slurm_executor.py) executes
exactly that. ``refusals`` is the create's check of the planned jobs against the cluster.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from detslurm.controller.executor import RunSpec
from detslurm.controller.step_executor import container_paths
from detslurm.expconf import ExperimentConfig
from detslurm.protocol import ExpPaths
from detslurm.queue import DEFAULT_PRIORITY
from detslurm.slurm.client import SlurmClient, SlurmCommandError, SlurmUnavailable
from detslurm.slurm.parse import NodeInfo, SlurmParseError, experiment_tag
from detslurm.slurm.refusals import (
    CONFIG,
    NODES_NOT_AVAILABLE,
    Refusal,
    RefusalKind,
    check_shape,
    job_shape,
    nodes_away,
)
from detslurm.slurm.render import (
    ArrayTask,
    ContainerPaths,
    Identity,
    ResourcePlan,
    SbatchRequest,
    plan_array,
    plan_trial_run,
    resource_plan,
)
from detslurm.slurm.site import SiteConfig

# Bytes of per-task exports one array script may carry (Slurm refuses scripts over its
# max_script_size, 4 MB by default); a bigger group is split into more arrays.
ARRAY_SCRIPT_BUDGET = 1 << 20
SLURM_DEFAULT_MAX_ARRAY_SIZE = 1001  # slurm.conf's default MaxArraySize


@dataclass(frozen=True)
class Submission:
    """One sbatch call of the plan: the request, and the runs it starts (one, or an array's
    tasks; task ``t`` runs ``specs[i]`` with ``t = trial_id - base``)."""

    request: SbatchRequest
    specs: tuple[RunSpec, ...]
    resources: ResourcePlan  # what the request asks of the cluster (the refusal check reads it)
    links_dir: Optional[Path] = None  # arrays: where each task's log link goes

    def job_ids(self, array_id: str) -> list[str]:
        if self.links_dir is None:
            return [array_id]
        base = self.specs[0].identity[1]
        return [f"{array_id}_{s.identity[1] - base}" for s in self.specs]


class SlurmPlanner:
    """Trial runs planned as sbatch calls on one site (SlurmExecutor submits them), and the
    check that the cluster could ever run the planned jobs."""

    def __init__(
        self,
        client: SlurmClient,
        site: SiteConfig,
        offline: bool = False,
        planned: Optional[tuple[ExperimentConfig, ResourcePlan]] = None,
    ) -> None:
        self.client = client
        self.site = site
        # A config whose resource plan its create computed already (controller/placement.py).
        self.planned = planned
        # Planning only, maybe with no Slurm in reach (a dry run on a laptop): Slurm's own
        # default limits stand in for the site's.
        self.offline = offline
        # Why refusals() checked nothing (offline, Slurm out of reach), for the dry run to say.
        self.unchecked: Optional[str] = None
        # Nodes that were down or drained when sbatch --test-only could not place a job: its
        # "no" was set aside, since sbatch queues such a job until they come back.
        self.nodes_away: list[str] = []

    # -- plan (pure) ------------------------------------------------------------------------
    def resources(self, config: ExperimentConfig) -> ResourcePlan:
        """The resource plan of ``config`` on this site: the one its create computed, if this
        planner was given it, else computed now. Raises ConfigError for an unknown pool."""
        if self.planned is not None and self.planned[0] is config:
            return self.planned[1]
        return resource_plan(config, self.site)

    def plan_many(self, specs: Sequence[RunSpec]) -> list[Submission]:
        """Runs of one experiment with the same run number and resources share an sbatch as a
        job array; the rest go one job each. The runs of a group share one resource plan."""
        groups: dict[str, list[RunSpec]] = {}
        for spec in specs:
            cfg = spec.config
            shared = [spec.identity[0], spec.identity[2], cfg.resources.model_dump(), cfg.slurm.model_dump()]
            groups.setdefault(json.dumps(shared, sort_keys=True, default=str), []).append(spec)
        subs: list[Submission] = []
        for group in groups.values():
            res = self.resources(group[0].config)
            for chunk in self._chunks(sorted(group, key=lambda s: s.identity[1])):
                subs.append(self._plan_array(chunk, res) if len(chunk) > 1 else self._plan_one(chunk[0], res))
        return subs

    def _plan_one(self, spec: RunSpec, res: ResourcePlan) -> Submission:
        ident = Identity(*spec.identity, tag=experiment_tag(str(spec.exp_dir)))
        req = plan_trial_run(
            config=spec.config,
            site=self.site,
            res=res,
            ident=ident,
            env=spec.env,
            run_dir=str(spec.run_dir),
            log_path=str(spec.log_path),
            python=self.site.python or sys.executable,
            container=self._container_paths(spec),
            may_raise_priority=self._may_raise_priority(spec.config),
        )
        return Submission(req, (spec,), res)

    def _plan_array(self, specs: Sequence[RunSpec], res: ResourcePlan) -> Submission:
        first = specs[0]
        ident = Identity(*first.identity, tag=experiment_tag(str(first.exp_dir)), array=True)
        links = ExpPaths(first.exp_dir).array_links(ident.trial_id, ident.run_id)
        tasks = [ArrayTask(s.identity[1], str(s.run_dir), s.env) for s in specs]
        req = plan_array(
            config=first.config,
            site=self.site,
            res=res,
            ident=ident,
            tasks=tasks,
            links_dir=str(links),
            log_name=first.log_path.name,
            python=self.site.python or sys.executable,
            container=self._container_paths(first),
            may_raise_priority=self._may_raise_priority(first.config),
        )
        return Submission(req, tuple(specs), res, links)

    def _container_paths(self, spec: RunSpec) -> Optional[ContainerPaths]:
        return container_paths(spec.config, spec.exp_dir, self.site)

    def _may_raise_priority(self, config: ExperimentConfig) -> bool:
        # Asked only for a priority above the default (a negative nice), so an ordinary config
        # costs no Slurm call; offline (a dry run) there is no Slurm to ask, and the plan shows
        # what an ordinary user gets.
        priority = config.resources.priority
        if priority is None or priority >= DEFAULT_PRIORITY or self.offline:
            return False
        return self.client.may_raise_priority()

    def _chunks(self, order: list[RunSpec]) -> list[list[RunSpec]]:
        """Split specs (sorted by trial) so that task ids stay below MaxArraySize and scripts
        stay small."""
        limit = max(1, self._max_array_size() - 1)
        chunks: list[list[RunSpec]] = []
        size = 0
        for spec in order:
            cost = sum(len(k) + len(v) for k, v in spec.env.items()) // 4  # most of it is shared
            base = chunks[-1][0].identity[1] if chunks else 0
            if not chunks or spec.identity[1] - base >= limit or size + cost > ARRAY_SCRIPT_BUDGET:
                chunks.append([])
                size = 0
            chunks[-1].append(spec)
            size += cost
        return chunks

    def _max_array_size(self) -> int:
        try:
            return self.client.capabilities().max_array_size
        except (SlurmCommandError, SlurmUnavailable):
            if not self.offline:
                raise
            return SLURM_DEFAULT_MAX_ARRAY_SIZE

    # -- refuse what can never run ----------------------------------------------------------
    def refusals(self, subs: Sequence[Submission]) -> list[Refusal]:
        """Why the planned jobs could never run here ([] when they may): the shape checked
        against the partitions and nodes (two queries), then ``sbatch --test-only`` once per
        distinct job shape. A 256-trial grid is one shape: the trials differ only in identity,
        paths and environment, none of which slurmctld's admission depends on, so one test
        answers for all of them. Offline (a dry run with no Slurm in reach) nothing is checked."""
        try:
            partitions, nodes = self.client.partitions(), self._nodes()
        except (SlurmCommandError, SlurmUnavailable) as e:
            if not self.offline:
                raise
            self.unchecked = str(e)
            return []
        out: list[Refusal] = []
        tested: set[tuple[str, ...]] = set()
        for sub in subs:
            key = _shape_key(sub.request.args)
            if key in tested:
                continue
            tested.add(key)
            shape = job_shape(sub.specs[0].config, self.site, sub.resources)
            found = check_shape(shape, partitions, nodes)
            away = nodes_away(shape, partitions, nodes)
            out += [r for r in self._ask_sbatch(sub, found, away) if r not in out]  # shapes may share one
        return out

    def _nodes(self) -> list[NodeInfo]:
        """The nodes for the size checks, or none where ``sinfo --json`` is missing (a Slurm
        built without its JSON plugins): sbatch --test-only then judges the size alone."""
        try:
            return self.client.nodes()
        except SlurmParseError:
            return []
        except SlurmCommandError as e:
            if e.unreachable:
                raise
            return []

    def _ask_sbatch(self, sub: Submission, found: list[Refusal], away: list[str]) -> list[Refusal]:
        """sbatch's verdict where our own check found nothing (its message for a request that
        is too big, "Requested node configuration is not available", says less than ours), or
        only a partition we could not see: scontrol hides Hidden partitions, which sbatch
        still takes, so our "no such partition" stands only if sbatch refuses too. That same
        message, while nodes of the partition are down or drained (``away``), is no refusal:
        our size check passed, and the job only waits for them."""
        if any(r.kind is not RefusalKind.NO_PARTITION for r in found):
            return found
        message = self.client.sbatch_test_only(sub.request.args, sub.request.script)
        if message is None:
            return []
        if away and not found and NODES_NOT_AVAILABLE in message:
            self.nodes_away = sorted(set(self.nodes_away) | set(away))
            return []
        if found:
            return found  # our message names the site config's pool; sbatch's would not
        config = sub.specs[0].config
        where = f"{CONFIG}.slurm.sbatch_args" if config.slurm.sbatch_args else f"{CONFIG}.resources"
        return [Refusal(RefusalKind.SBATCH, where, f"sbatch --test-only refused the job: {message}")]


# Options that name one job (identity, logs, dirs, array indices), not what it asks of the cluster.
_PER_JOB = ("--job-name=", "--comment=", "--output=", "--chdir=", "--array=")


def _shape_key(args: Sequence[str]) -> tuple[str, ...]:
    """What slurmctld's admission of a job depends on: its options minus the per-job ones."""
    return tuple(a for a in args if not a.startswith(_PER_JOB))
