"""sbatch rendering, plan then execute: ``plan_trial_run`` builds an :class:`SbatchRequest`
(pure: no I/O, no Slurm calls) whose ``render()`` is what ``--dry-run`` prints.

sbatch options go on sbatch's command line as an argv list (never through a shell, never as
``#SBATCH`` lines a newline could extend); every value in the script body is shell-quoted
(contract 7).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import jinja2

from detslurm.errors import ConfigError
from detslurm.slurm.parse import trial_comment
from detslurm.slurm.site import SiteConfig

_ENV = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True,
                          trim_blocks=True, lstrip_blocks=True)
_ENV.filters["q"] = lambda v: shlex.quote(str(v))


def _template(name: str) -> jinja2.Template:
    text = resources.files("detslurm.templates").joinpath(name).read_text()
    return _ENV.from_string(text)


@dataclass(frozen=True)
class SbatchRequest:
    name: str
    args: list[str]
    script: str
    env: dict[str, str] = field(default_factory=dict, compare=False)

    def render(self) -> str:
        return f"$ sbatch --parsable {shlex.join(self.args)} <<'SCRIPT'\n{self.script}SCRIPT\n"


@dataclass(frozen=True)
class Identity:
    experiment_id: int
    trial_id: int
    run_id: int
    tag: str = ""

    @property
    def job_name(self) -> str:
        return f"det-e{self.experiment_id}-t{self.trial_id}-r{self.run_id}"

    @property
    def comment(self) -> str:
        return trial_comment(self.experiment_id, self.trial_id, self.run_id, self.tag)


def resource_args(config: dict[str, Any], site: SiteConfig) -> tuple[list[str], int]:
    """Partition, nodes and slots for a trial; returns (args, nodes)."""
    res, slurm = config["resources"], config["slurm"]
    pool_name, pool = site.pool(res.get("resource_pool", ""))
    slots = int(res["slots_per_trial"])
    spn = int(slurm.get("slots_per_node") or pool.slots_per_node)
    nodes = max(1, math.ceil(slots / spn)) if slots else 1
    per_node = spn if nodes > 1 else max(slots, 1)
    args = [f"--partition={pool.partition}"] if pool.partition else []
    args += [f"--nodes={nodes}", "--ntasks-per-node=1"]
    if pool.slot_type == "gpu" and slots > 0:
        gtype = slurm.get("gpu_type")
        args.append(f"--gres={pool.gres_name}:{gtype}:{per_node}" if gtype else f"--gres={pool.gres_name}:{per_node}")
    elif slots > 0:
        args.append(f"--cpus-per-task={per_node}")
    if pool.account:
        args.append(f"--account={pool.account}")
    if pool.qos:
        args.append(f"--qos={pool.qos}")
    if pool.time_limit_min:
        args.append(f"--time={pool.time_limit_min}")
    args += pool.extra_sbatch_args
    del pool_name
    return args, nodes


def plan_trial_run(*, config: dict[str, Any], site: SiteConfig, ident: Identity, env: dict[str, str],
                   run_dir: str, log_path: str, python: str) -> SbatchRequest:
    res_args, nodes = resource_args(config, site)
    sig = site.signal.upper().removeprefix("SIG")
    args = [
        f"--job-name={ident.job_name}", f"--comment={ident.comment}", *res_args,
        # sbatch expands %j, %u, ... in file names: a literal % must be doubled.
        f"--output={log_path.replace('%', '%%')}", "--open-mode=append", f"--chdir={run_dir}",
        # detslurm resubmits from the latest checkpoint itself (counting restarts once).
        "--no-requeue",
        f"--signal=B:{sig}@{site.signal_lead_s}",
        *config["slurm"].get("sbatch_args", []),
    ]
    for a in args:
        if any(c in a for c in "\n\r\0"):
            raise ConfigError([f"sbatch argument {a!r} contains a control character"])
    script = _template("trial.sbatch.j2").render(
        ident=ident, env=sorted(env.items()), setup=site.setup, run_dir=run_dir, python=python, nodes=nodes,
        signal=sig, node_tmpdir=site.node_tmpdir,
    )
    return SbatchRequest(name=ident.job_name, args=args, script=script, env=env)
