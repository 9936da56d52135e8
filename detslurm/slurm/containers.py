"""Container runtimes: the argv that runs a trial's launcher inside ``environment.image``.

Pure: from a :class:`ContainerSpec` (runtime, image, binds, variables, GPU kind, site options)
:func:`container_command` builds what the sbatch script runs on every node: a *prepare* command
(fetch the image, or check it can start) and the *prefix* put before ``python3 -m
detslurm.exec.launch``. Nothing here runs anything; render.py writes the result into the script,
so the dry run shows it.

The launcher and the in-job side of detslurm are not installed in the image: a copy of the
pure-Python package and its light dependencies (container_lib.py) is bind-mounted read-only at
:data:`LIB_IN_CONTAINER` and put on ``PYTHONPATH``. Frameworks (torch, ...) come from the image.

Runtimes:

- ``podman``: ``podman run --rm --init --network=host ...``. ``--init`` puts a tiny init as PID 1
  that passes signals on (a Python PID 1 would ignore a SIGTERM it has no handler for yet), and
  podman's default ``--sig-proxy`` forwards the SIGTERM Slurm sends ``podman run`` into the
  container, so preemption checkpoints; ``podman run`` exits with the container's code. On GPU
  pools it gets one CDI device per GPU Slurm allocated (see ``_GPU_DEVICES``).
- ``apptainer`` / ``singularity``: ``exec`` with ``--nv``/``--rocm`` on GPU pools; a name that is
  not a path or a URI is a Docker image (``docker://``). The host environment passes through.
- ``pyxis`` (alias ``enroot``): the image goes on srun (``--container-image``,
  ``--container-mounts``); enroot's hooks expose the allocated GPUs.
- ``none``: no container (the nodes' own Python).
"""

from __future__ import annotations

import enum
import re
import shlex
from dataclasses import dataclass

from detslurm import settings

# Where the in-job library is mounted inside every container (read-only).
LIB_IN_CONTAINER = "/opt/detslurm/lib"
# Variables passed into a Podman container by prefix (podman's ``--env 'P*'`` form): the trial's
# DET_* identity, detslurm's own settings, and Slurm's view of the job (ranks, node list).
ENV_PREFIXES = ("DET_", settings.PREFIX, "SLURM_")
# And by name: what Slurm and the GPU stacks set for the job that the prefixes do not cover.
ENV_NAMES = (
    "SLURMD_NODENAME",
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "PYTHONUNBUFFERED",
)
_URI = re.compile(r"^[a-z][a-z0-9+.-]*://")


class Runtime(enum.Enum):
    """The site's container runtime (site config ``container_runtime``)."""

    NONE = "none"
    PODMAN = "podman"
    APPTAINER = "apptainer"
    SINGULARITY = "singularity"
    PYXIS = "pyxis"
    # enroot on Slurm is driven through its SPANK plugin, pyxis: the same srun options.
    ENROOT = "enroot"

    @property
    def on_srun(self) -> bool:
        """The runtime is an srun plugin: the trial must run as an srun step even on one node."""
        return self in (Runtime.PYXIS, Runtime.ENROOT)


class Gpu(enum.Enum):
    """Which GPUs a container must see: none (CPU pools), NVIDIA (CUDA) or AMD (ROCm)."""

    NONE = "none"
    NVIDIA = "nvidia"
    AMD = "amd"


@dataclass(frozen=True)
class Bind:
    """A host path made visible inside the container."""

    host: str
    container: str
    read_only: bool = False


@dataclass(frozen=True)
class ContainerSpec:
    """Everything a runtime's command line depends on. ``env_names`` are passed through by name
    (values stay in the job's environment, never on a command line other users can read in
    ``ps``); ``env_set`` are fixed, non-secret values."""

    runtime: Runtime
    image: str
    binds: tuple[Bind, ...] = ()
    env_names: tuple[str, ...] = ()
    env_set: tuple[tuple[str, str], ...] = ()
    gpu: Gpu = Gpu.NONE
    force_pull: bool = False
    executable: str = ""  # the runtime's binary; default: its name
    global_options: tuple[str, ...] = ()  # between the binary and its subcommand (podman --runtime runc)
    run_options: tuple[str, ...] = ()  # after run/exec (podman --ulimit ...)
    python: str = "python3"  # the interpreter inside the image


@dataclass(frozen=True)
class ContainerCommand:
    """What the sbatch script runs. ``prepare`` (may be empty) runs once on every node before the
    trial and fails when the image cannot be had; ``srun_options`` go on the trial's srun;
    ``prefix`` goes before the launcher's ``python -m ...``."""

    prepare: tuple[str, ...]
    srun_options: tuple[str, ...]
    prefix: tuple[str, ...]
    python: str
    always_srun: bool = False


def container_command(spec: ContainerSpec) -> ContainerCommand:
    """The runtime's command lines for ``spec``. Raises ValueError for ``Runtime.NONE``."""
    if spec.runtime == Runtime.PODMAN:
        return _podman(spec)
    if spec.runtime in (Runtime.APPTAINER, Runtime.SINGULARITY):
        return _apptainer(spec)
    if spec.runtime.on_srun:
        return _pyxis(spec)
    raise ValueError(f"container runtime {spec.runtime.value!r} runs no container")


def _podman(spec: ContainerSpec) -> ContainerCommand:
    base = [spec.executable or "podman", *spec.global_options]
    image = spec.image
    # Fetch before the run, so that a missing or unpullable image is told apart from a trial
    # that fails (podman's own exit code, 125, is also a code any program may exit with).
    if spec.force_pull:
        fetch = shlex.join([*base, "pull", image])
    else:
        fetch = f"{shlex.join([*base, 'image', 'exists', image])} || {shlex.join([*base, 'pull', image])}"
    run = [*base, "run", "--rm", "--init", "--pull=never"]
    # The host network: ranks on different nodes rendezvous over the nodes' own addresses (the
    # chief publishes a port bound on its node), which a private network namespace would hide;
    # on the test cluster all "nodes" are 127.0.10.x addresses of one host.
    run.append("--network=host")
    for b in spec.binds:
        run += ["-v", f"{b.host}:{b.container}" + (":ro" if b.read_only else "")]
    run += [f"--env={p}*" for p in ENV_PREFIXES]
    # By name: what no prefix covers (the user's environment_variables, GPU variables). NVIDIA
    # containers get their own CUDA_VISIBLE_DEVICES (below), not the host's.
    skip = ("CUDA_VISIBLE_DEVICES",) if spec.gpu == Gpu.NVIDIA else ()
    names = _unique(ENV_NAMES + spec.env_names)
    run += [f"--env={n}" for n in names if not n.startswith(ENV_PREFIXES) and n not in skip]
    run += [f"--env={k}={v}" for k, v in spec.env_set]
    if spec.gpu == Gpu.AMD:
        run += ["--device=/dev/kfd", "--device=/dev/dri", "--group-add=keep-groups"]
    # The site's options last, so a site may override ours (podman keeps the last value).
    tail = [*spec.run_options, image]
    if spec.gpu == Gpu.NVIDIA:
        return ContainerCommand(("sh", "-c", fetch), (), _with_allocated_gpus(run, tail), spec.python)
    return ContainerCommand(("sh", "-c", fetch), (), (*run, *tail), spec.python)


# Shell run on each node (POSIX sh) for Podman on GPU pools: one CDI device per GPU Slurm
# allocated to this step or job (host indices), and CUDA_VISIBLE_DEVICES numbering them from 0
# as the container sees them. Exposing all of the node's GPUs and passing Slurm's variable on
# would pick the wrong ones where Slurm renumbers GPUs (ConstrainDevices): the container runs
# outside the job's device cgroup.
_GPU_DEVICES = (
    'd=""; c=""; i=0; '
    'for g in $(echo "${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}}" | tr , " "); do '
    'd="$d --device=nvidia.com/gpu=$g"; c="$c${c:+,}$i"; i=$((i+1)); done; '
)


def _with_allocated_gpus(run: list[str], tail: list[str]) -> tuple[str, ...]:
    """``sh -c 'exec podman run ... $d --env=CUDA_VISIBLE_DEVICES=$c IMAGE "$@"' sh`` : the
    launcher's argv follows as the script's arguments."""
    script = f'{_GPU_DEVICES}exec {shlex.join(run)} $d "--env=CUDA_VISIBLE_DEVICES=$c" {shlex.join(tail)} "$@"'
    return ("sh", "-c", script, "sh")


def apptainer_image(image: str) -> str:
    """A Determined image name (``repo/name:tag``) is a Docker image; paths and URIs stay."""
    if image.startswith(("/", "./", "../")) or image.endswith((".sif", ".simg", ".img")) or _URI.match(image):
        return image
    return f"docker://{image}"


def _apptainer(spec: ContainerSpec) -> ContainerCommand:
    exe = spec.executable or spec.runtime.value
    image = apptainer_image(spec.image)
    # Fetch the image again instead of using the cached SIF.
    fetch_opts = ["--disable-cache"] if spec.force_pull else []
    opts = list(fetch_opts)
    if spec.gpu == Gpu.NVIDIA:
        opts.append("--nv")
    elif spec.gpu == Gpu.AMD:
        opts.append("--rocm")
    if spec.binds:
        opts.append(
            "--bind=" + ",".join(f"{b.host}:{b.container}" + (":ro" if b.read_only else "") for b in spec.binds)
        )
    # The host environment passes into the container by default (SLURM_*, DET_*, the user's
    # variables); only the fixed values are set here.
    opts += [f"--env={k}={v}" for k, v in spec.env_set]
    run = (exe, *spec.global_options, "exec", *opts, *spec.run_options, image)
    # Starting the image's Python once per node fetches (and converts) the image, and fails
    # with the runtime's own message when the image cannot be had or has no python3.
    fetch = (exe, *spec.global_options, "exec", *fetch_opts, image, spec.python, "-c", "")
    return ContainerCommand(fetch, (), run, spec.python)


def pyxis_image(image: str) -> str:
    """enroot names a registry with ``#`` (``nvcr.io#nvidia/pytorch:24.01-py3``): a Docker-style
    name whose first part is a host (has a dot or a port, or is localhost) is rewritten."""
    image = image.removeprefix("docker://")
    host, sep, rest = image.partition("/")
    if "#" in image or not sep or not ("." in host or ":" in host or host == "localhost"):
        return image
    return f"{host}#{rest}"


def _pyxis(spec: ContainerSpec) -> ContainerCommand:
    srun = [f"--container-image={pyxis_image(spec.image)}"]
    if spec.binds:
        srun.append(
            "--container-mounts="
            + ",".join(f"{b.host}:{b.container}" + (":ro" if b.read_only else "") for b in spec.binds)
        )
    # The job's environment passes into the container; fixed values go on the srun's own env.
    srun += [*spec.run_options]
    prefix = ("env", *(f"{k}={v}" for k, v in spec.env_set)) if spec.env_set else ()
    # No prepare step: pyxis imports the image as the step starts, on every node; an image it
    # cannot import fails that step (and is counted as a failed run, spending a restart).
    return ContainerCommand((), tuple(srun), prefix, spec.python, always_srun=True)


def _unique(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))
