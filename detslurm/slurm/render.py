"""sbatch rendering, plan then execute: ``plan_trial_run`` builds an :class:`SbatchRequest`
(pure: no I/O, no Slurm calls) whose ``render()`` is what ``--dry-run`` prints.

sbatch options go on sbatch's command line as an argv list (never through a shell, never as
``#SBATCH`` lines a newline could extend); every value in the script body is shell-quoted
(contract 7).
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources

import jinja2

from detslurm import settings
from detslurm.errors import ConfigError
from detslurm.expconf import ExperimentConfig
from detslurm.protocol import BATCH_EXIT_PRINTF, IMAGE_EXIT_PRINTF, IN_CONTAINER_ENV, NODE_TMPDIR_ENV
from detslurm.protocol.paths import EXIT_RECORD, SIGNALS, STEP_PID, STEP_RC
from detslurm.slurm.containers import (
    LIB_IN_CONTAINER,
    Bind,
    ContainerCommand,
    ContainerSpec,
    Gpu,
    Runtime,
    container_command,
)
from detslurm.slurm.parse import trial_comment
from detslurm.slurm.site import SiteConfig

# StrictUndefined: a misspelt template variable fails at render time on the login node instead of
# becoming an empty string in a script that then runs wrong on a compute node. No autoescape:
# this is shell, so every value goes through the ``q`` (shlex.quote) filter instead.
_ENV = jinja2.Environment(
    undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True
)
_ENV.filters["q"] = lambda v: shlex.quote(str(v))
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _template(name: str) -> jinja2.Template:
    # Read as package data, so an installed wheel and a source checkout render the same template.
    text = resources.files("detslurm.templates").joinpath(name).read_text()
    return _ENV.from_string(text)


@dataclass(frozen=True)
class SbatchRequest:
    """What plan_trial_run/plan_array return: sbatch's argv options, the script, and its environment."""

    name: str
    args: list[str]
    script: str
    env: dict[str, str] = field(default_factory=dict, compare=False)

    def render(self) -> str:
        """A runnable shell command: sbatch's command line with the script as a here-document."""
        return f"sbatch --parsable {shlex.join(self.args)} <<'SCRIPT'\n{self.script}SCRIPT\n"


@dataclass(frozen=True)
class Identity:
    """A trial run's identity in Slurm; for an array, ``trial_id`` is the trial of task 0."""

    experiment_id: int
    trial_id: int
    run_id: int
    tag: str = ""
    array: bool = False

    @property
    def job_name(self) -> str:
        # Readable in squeue; the "+" marks an array whose task T runs trial trial_id + T. Controllers
        # identify jobs by the --comment (below), which also carries the experiment-dir tag.
        return f"det-e{self.experiment_id}-t{self.trial_id}{'+' if self.array else ''}-r{self.run_id}"

    @property
    def comment(self) -> str:
        # Contract 4: a controller killed between sbatch and its commit finds the job again by this
        # comment (squeue) instead of submitting the run twice.
        return trial_comment(self.experiment_id, self.trial_id, self.run_id, self.tag, self.array)


@dataclass(frozen=True)
class ArrayTask:
    """One trial run of a job array: task ``trial_id - base`` runs it."""

    trial_id: int
    run_dir: str
    env: dict[str, str]


@dataclass(frozen=True)
class ResourcePlan:
    """Where and on what a trial runs, from the config and the site (:func:`resource_plan`):
    the sbatch resource options and the node count the script's srun needs. Computed once and
    passed along: by a create for its checks, its dry run and its first submission; by the
    executor once per group of runs it submits together."""

    args: tuple[str, ...]
    nodes: int
    slots: int
    per_node: int = 1  # slots each node gets (the refusal check compares it with the nodes)
    gpu: bool = False


@dataclass(frozen=True)
class ContainerPaths:
    """Host paths a container trial needs: its experiment dir (run dirs, events, the context)
    and the in-job library (slurm/container_lib.py) made under it."""

    exp_dir: str
    lib_dir: str


def image_for(config: ExperimentConfig, gpu: Gpu) -> str | None:
    """``environment.image``: a string, or Determined's map by device kind (cpu/cuda/rocm)."""
    image = config.environment.image
    if image is None or isinstance(image, str):
        return image or None
    kind = {Gpu.NONE: "cpu", Gpu.NVIDIA: "cuda", Gpu.AMD: "rocm"}[gpu]
    if kind not in image:
        raise ConfigError([f"<config>.environment.image: no {kind!r} image for this {kind} resource pool"])
    return image[kind]


def registry_env(config: ExperimentConfig, site: SiteConfig) -> dict[str, str]:
    """``environment.registry_auth`` as the variables Apptainer/Singularity read when pulling
    from a Docker registry (exported in the script like environment_variables, never put on a
    command line other users could read in ``ps``). Other runtimes: {} (see container_warnings)."""
    auth = config.environment.registry_auth or {}
    prefix = {Runtime.APPTAINER: "APPTAINER", Runtime.SINGULARITY: "SINGULARITY"}.get(site.container_runtime)
    if not config.environment.image or prefix is None or not auth.get("username"):
        return {}
    return {
        f"{prefix}_DOCKER_USERNAME": str(auth["username"]),
        f"{prefix}_DOCKER_PASSWORD": str(auth.get("password", "")),
    }


def container_warnings(config: ExperimentConfig, site: SiteConfig) -> list[str]:
    """Container settings of the config this site's runtime does not apply, one line each."""
    env, runtime = config.environment, site.container_runtime
    if not env.image or runtime == Runtime.NONE:
        return []
    out: list[str] = []
    if env.registry_auth and runtime not in (Runtime.APPTAINER, Runtime.SINGULARITY):
        login = "podman login on the nodes" if runtime == Runtime.PODMAN else "enroot's credentials file"
        out.append(f"environment.registry_auth is not used with {runtime.value}: use {login}")
    ignored = [
        name
        for name, value in (
            ("environment.add_capabilities", env.add_capabilities),
            ("environment.drop_capabilities", env.drop_capabilities),
            ("environment.ports", env.ports),
            ("environment.proxy_ports", env.proxy_ports),
            ("environment.pod_spec", env.pod_spec),
            ("resources.shm_size", config.resources.shm_size),
            ("resources.devices", config.resources.devices),
        )
        if value
    ]
    if ignored:
        out.append(f"{', '.join(ignored)}: not applied to {runtime.value} containers")
    return out


def container_spec(
    config: ExperimentConfig, site: SiteConfig, res: ResourcePlan, env_names: list[str], paths: ContainerPaths
) -> ContainerSpec | None:
    """The container a trial runs in, or None (no image, or the site runs none)."""
    runtime = site.container_runtime
    opts = site.container
    gpu = (Gpu.AMD if opts.gpu_vendor == "amd" else Gpu.NVIDIA) if res.gpu else Gpu.NONE
    image = image_for(config, gpu)
    if image is None or runtime == Runtime.NONE:
        return None
    binds = [Bind(b.host_path, b.container_path, b.read_only) for b in config.top.bind_mounts]
    covered = [b.container.rstrip("/") + "/" for b in binds]
    # Same paths inside as outside: every DET_* path the trial gets stays valid. The experiment
    # dir is always ours (mounted after the user's, so it wins); for the checkpoint storage a
    # user's bind mount that provides its path (as directory storage's container_path needs) wins.
    binds.append(Bind(paths.exp_dir, paths.exp_dir))
    storage = config.storage_base
    if not any((storage.rstrip("/") + "/").startswith(c) for c in covered):
        binds.append(Bind(storage, storage))
    binds.append(Bind(paths.lib_dir, LIB_IN_CONTAINER, read_only=True))
    return ContainerSpec(
        runtime=runtime,
        image=image,
        binds=tuple(binds),
        env_names=tuple(sorted(env_names)),
        env_set=(("PYTHONPATH", LIB_IN_CONTAINER), (IN_CONTAINER_ENV, runtime.value)),
        gpu=gpu,
        force_pull=config.environment.force_pull_image,
        executable=opts.executable or "",
        global_options=tuple(opts.global_options),
        run_options=tuple(opts.run_options),
        python=opts.python,
    )


def resource_plan(config: ExperimentConfig, site: SiteConfig) -> ResourcePlan:
    """Partition, nodes and slots for a trial. Raises ConfigError for an unknown pool."""
    res, slurm = config.resources, config.slurm
    _, pool = site.pool(res.resource_pool)
    slots = res.slots_per_trial
    spn = slurm.slots_per_node or pool.slots_per_node
    # 0 slots (a CPU-only trial) still needs one node.
    nodes = max(1, math.ceil(slots / spn)) if slots else 1
    # Several nodes are filled whole; one node gets exactly the slots asked for.
    per_node = spn if nodes > 1 else max(slots, 1)
    args = [f"--partition={pool.partition}"] if pool.partition else []
    # One task per node: our launcher starts the per-GPU worker ranks itself, as Determined's
    # launchers do inside one container per node.
    args += [f"--nodes={nodes}", "--ntasks-per-node=1"]
    gpu = pool.slot_type == "gpu" and slots > 0
    if gpu:
        gres = f"{pool.gres_name}:{slurm.gpu_type}:{per_node}" if slurm.gpu_type else f"{pool.gres_name}:{per_node}"
        args.append(f"--gres={gres}")
    elif slots > 0:
        args.append(f"--cpus-per-task={per_node}")
    if pool.account:
        args.append(f"--account={pool.account}")
    if pool.qos:
        args.append(f"--qos={pool.qos}")
    if pool.time_limit_min:
        args.append(f"--time={pool.time_limit_min}")
    # Site arguments come after ours so a site can override them (sbatch keeps the last value).
    args += pool.extra_sbatch_args
    return ResourcePlan(tuple(args), nodes, slots, per_node, gpu)


def priority_args(config: ExperimentConfig, may_raise: bool) -> list[str]:
    """``--nice`` for ``resources.priority`` (Determined's 1..99, smaller is higher; 42 is the
    default and nice 0). sbatch lets every user give a positive nice (a lower priority) but only
    operators and admins a negative one, so an ordinary user's priority above the default is
    submitted at nice 0 (the best they may have) rather than refused by sbatch."""
    from detslurm.queue import nice_for  # the one mapping, shared with `det job update`

    if config.resources.priority is None:
        return []
    nice = nice_for(config.resources.priority)
    return [f"--nice={nice if may_raise else max(0, nice)}"]


def _job_args(
    config: ExperimentConfig,
    site: SiteConfig,
    res: ResourcePlan,
    ident: Identity,
    output: str,
    chdir: str,
    may_raise: bool = False,
) -> list[str]:
    sig = site.signal.upper().removeprefix("SIG")
    args = [
        f"--job-name={ident.job_name}",
        f"--comment={ident.comment}",
        *res.args,
        # sbatch expands %j, %u, ... in file names: a literal % must be doubled.
        f"--output={output}",
        "--open-mode=append",
        f"--chdir={chdir}",
        # Slurm may requeue the job (an admin's `scontrol requeue`, preemption on a PreemptMode=REQUEUE
        # partition, a node failure): the stopped start checkpoints as for any stop, and the daemon
        # then cancels the requeued job and resubmits the trial from its checkpoint as a new run
        # (controller/slurm_executor.py). With --no-requeue, slurmctld refuses `scontrol requeue`.
        "--requeue",
        # B: sends the warning only to the batch shell, which forwards it to the step (see the
        # template), signal_lead_s seconds before the time limit so the trial can checkpoint.
        f"--signal=B:{sig}@{site.signal_lead_s}",
        # Set at every submission, so a priority given with `det job update` (saved in the config)
        # or in the config itself holds for restarts and resumes too.
        *priority_args(config, may_raise),
        # User arguments last; expconf/sbatch_args.py has already refused every option detslurm
        # sets or computes, so they cannot override the identity, logs or signal above.
        *config.slurm.sbatch_args,
    ]
    for a in args:
        if any(c in a for c in "\n\r\0"):
            raise ConfigError([f"sbatch argument {a!r} contains a control character"])
    return args


def _check_env(env: dict[str, str]) -> None:
    """Variable names are written into the script unquoted (``export NAME=...``): re-checked
    here, because the config they come from may have been edited since validation."""
    bad = [k for k in env if not _ENV_NAME.fullmatch(k)]
    if bad:
        raise ConfigError([f"environment variable name {k!r} is not a valid shell variable name" for k in bad])


def _step_lines(
    res: ResourcePlan, python: str, container: ContainerCommand | None, step: Sequence[str] | None = None
) -> tuple[str, str]:
    """(the prepare line or "", the line that starts one launcher per node). ``step``: srun's
    options that make the run a job step of a job the user holds (:func:`plan_step`); every
    line then runs through srun with them."""
    srun = ["srun", *step] if step is not None else ["srun", f"--nodes={res.nodes}", "--ntasks-per-node=1"]
    if container is None:
        argv = [python, "-m", "detslurm.exec.launch"]
        on_step = step is not None or res.nodes > 1
        return "", shlex.join([*srun, "--kill-on-bad-exit=1", *argv] if on_step else argv)
    argv = [*container.prefix, container.python, "-m", "detslurm.exec.launch"]
    on_step = step is not None or res.nodes > 1 or container.always_srun
    prepare = ""
    if container.prepare:
        # Every node needs the image (its own image store, or its own SIF cache): prepare on all.
        prepare = shlex.join([*srun, *container.prepare] if on_step else list(container.prepare))
    if on_step:
        return prepare, shlex.join([*srun, "--kill-on-bad-exit=1", *container.srun_options, *argv])
    return prepare, shlex.join(argv)


def _script(
    site: SiteConfig,
    res: ResourcePlan,
    ident: Identity,
    env: dict[str, str],
    run_dir: str,
    python: str,
    tasks: list[tuple[int, list[tuple[str, str]]]] | None = None,
    container: ContainerCommand | None = None,
    step: StepPlace | None = None,
) -> str:
    _check_env(env)
    for _, task_env in tasks or []:
        _check_env(dict(task_env))
    prepare, launch = _step_lines(res, python, container, step.args if step else None)
    if step is not None:
        # Not a batch script: the shell runs where the daemon does, outside any job, so no
        # signal of Slurm's reaches it and srun stays its child (the first branch of the template).
        on_srun, job_ref = False, step.job_id
    else:
        on_srun = launch.startswith("srun ")
        job_ref = "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" if tasks else "${SLURM_JOB_ID}"
    return _template("trial.sbatch.j2").render(
        ident=ident,
        env=sorted(env.items()),
        setup=site.setup,
        run_dir=run_dir,
        nodes=res.nodes,
        prepare=prepare,
        launch=launch,
        on_srun=on_srun,
        job_ref=job_ref,
        runtime=site.container_runtime.value if container else "",
        signal=site.signal.upper().removeprefix("SIG"),
        node_tmpdir=site.node_tmpdir or "",
        node_tmpdir_env=NODE_TMPDIR_ENV,
        preempt_signal_env=settings.PREEMPT_SIGNAL.name,
        tasks=tasks or [],
        # The run-dir files the batch shell writes: named and formatted by the protocol module.
        exit_record=EXIT_RECORD,
        exit_printf=BATCH_EXIT_PRINTF,
        image_exit_printf=IMAGE_EXIT_PRINTF,
        signals=SIGNALS,
        step_pid=STEP_PID,
        step_rc=STEP_RC,
    )


def _container(
    config: ExperimentConfig,
    site: SiteConfig,
    res: ResourcePlan,
    env_names: list[str],
    paths: ContainerPaths | None,
) -> ContainerCommand | None:
    spec = container_spec(config, site, res, env_names, paths) if paths is not None else None
    return container_command(spec) if spec is not None else None


def plan_trial_run(
    *,
    config: ExperimentConfig,
    site: SiteConfig,
    res: ResourcePlan,
    ident: Identity,
    env: dict[str, str],
    run_dir: str,
    log_path: str,
    python: str,
    container: ContainerPaths | None = None,
    may_raise_priority: bool = False,
) -> SbatchRequest:
    """One sbatch for one trial run, with ``res``, the resource plan of ``config`` on ``site``.
    ``container`` names the host paths a container trial needs; without it (or without
    environment.image) the trial runs with ``python``."""
    args = _job_args(config, site, res, ident, log_path.replace("%", "%%"), run_dir, may_raise_priority)
    cmd = _container(config, site, res, list(env), container)
    if cmd is not None:
        env = {**env, **registry_env(config, site)}
    script = _script(site, res, ident, env, run_dir, python, container=cmd)
    return SbatchRequest(name=ident.job_name, args=args, script=script, env=env)


@dataclass(frozen=True)
class StepPlace:
    """Where a run goes as a job step of a job the user holds: the job, and srun's options
    that place the step on its nodes (controller/step_executor.py)."""

    job_id: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class StepRequest:
    """What :func:`plan_step` returns: the srun options and the script that runs the step."""

    name: str
    args: list[str]
    script: str

    def render(self) -> str:
        """A runnable shell command: the script the daemon runs, as a here-document."""
        return f"bash <<'SCRIPT'\n{self.script}SCRIPT\n"


def plan_step(
    *,
    config: ExperimentConfig,
    site: SiteConfig,
    res: ResourcePlan,
    ident: Identity,
    env: dict[str, str],
    run_dir: str,
    python: str,
    job_id: str,
    placement: Sequence[str],
    container: ContainerPaths | None = None,
) -> StepRequest:
    """One trial run as a job step of held job ``job_id``, on the nodes and with the GPUs and
    CPUs ``placement`` gives (srun options). The script is the batch script's, run by the daemon
    outside the job: the same exports, setup, exit record and signal forwarding, with srun
    starting the launchers in the held job."""
    for a in placement:
        if any(c in a for c in "\n\r\0"):
            raise ConfigError([f"srun argument {a!r} contains a control character"])
    args = [
        f"--jobid={job_id}",
        # The step's name in `squeue --steps` and sacct; the run's identity is its run dir.
        f"--job-name={ident.job_name}",
        f"--nodes={res.nodes}",
        "--ntasks-per-node=1",
        *placement,
        # Only what the step asks for, so that steps share the job's nodes.
        "--exact",
    ]
    cmd = _container(config, site, res, list(env), container)
    if cmd is not None:
        env = {**env, **registry_env(config, site)}
    script = _script(site, res, ident, env, run_dir, python, container=cmd, step=StepPlace(job_id, tuple(args)))
    return StepRequest(name=ident.job_name, args=args, script=script)


def plan_array(
    *,
    config: ExperimentConfig,
    site: SiteConfig,
    res: ResourcePlan,
    ident: Identity,
    tasks: list[ArrayTask],
    links_dir: str,
    log_name: str,
    python: str,
    container: ContainerPaths | None = None,
    may_raise_priority: bool = False,
) -> SbatchRequest:
    """One sbatch for many trial runs that share resources ``res`` (a job array).

    Task ``t`` runs trial ``ident.trial_id + t``. Each task finds its own run dir through the
    symlink ``links_dir/t`` (so Slurm writes its log to the run's usual place) and gets only its
    own variables; what every task shares is exported once. resources.max_slots becomes the
    array's throttle (``%N``): Slurm then runs at most N of its tasks at a time.
    """
    base = ident.trial_id
    throttle = array_throttle(config.resources.max_slots, res.slots)
    # Exported once for all tasks; only what differs goes into the script's per-task case arms,
    # which keeps a many-trial script small.
    common = dict(set.intersection(*(set(t.env.items()) for t in tasks)))
    per_task = [(t.trial_id - base, sorted((k, v) for k, v in t.env.items() if common.get(k) != v)) for t in tasks]
    spec = index_ranges([i for i, _ in per_task]) + (f"%{throttle}" if throttle > 0 else "")
    # %a is the array task id: Slurm opens each task's log through links_dir/<task>, a symlink to that
    # trial's run dir, since one --output pattern cannot name the run dirs themselves.
    output = f"{links_dir.replace('%', '%%')}/%a/{log_name.replace('%', '%%')}"
    args = [*_job_args(config, site, res, ident, output, links_dir, may_raise_priority), f"--array={spec}"]
    names = sorted({k for t in tasks for k in t.env})
    cmd = _container(config, site, res, names, container)
    if cmd is not None:
        common = {**common, **registry_env(config, site)}
    script = _script(site, res, ident, common, "", python, per_task, cmd)
    return SbatchRequest(name=ident.job_name, args=args, script=script, env=common)


def array_throttle(max_slots: int | None, slots_per_task: int) -> int:
    """How many tasks of an array may run at once under ``resources.max_slots`` (0: no limit).
    max_slots caps the slots the whole experiment holds and each task takes slots_per_task, so
    this many tasks fit (at least one, or the array would never start)."""
    return max(1, max_slots // max(1, slots_per_task)) if max_slots else 0


def index_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (sbatch --array syntax)."""
    out: list[tuple[int, int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)
