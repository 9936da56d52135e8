"""Container runtimes by rendering: golden command lines and sbatch scripts for Podman,
Apptainer, Singularity and pyxis/enroot; the in-job library; the image-failure exit cause.

Podman also runs for real in tests/cluster/test_containers_cluster.py; the others only render here
(no Apptainer, Singularity or enroot package exists for the test machines' Debian 12).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from detslurm.controller.executor import ExitCause, JobState
from detslurm.controller.slurm_status import ended as _ended
from detslurm.core import DummyDistributedContext
from detslurm.core._preempt import PreemptContext
from detslurm.errors import ConfigError
from detslurm.expconf import ExperimentConfig, validate
from detslurm.protocol import IMAGE_EXIT_PRINTF, exit_outcome, trial_env
from detslurm.slurm import container_lib
from detslurm.slurm.containers import (
    Bind,
    ContainerSpec,
    Gpu,
    Runtime,
    apptainer_image,
    container_command,
    pyxis_image,
)
from detslurm.slurm.render import ContainerPaths, Identity, plan_trial_run, resource_plan
from detslurm.slurm.site import SiteConfig

GOLDEN = Path(__file__).parents[2] / "golden" / "containers"
EXP = "/shared/exps/exp-1-abcd"
LIB = f"{EXP}/container-lib/0123456789abcdef"
STORAGE = {"type": "shared_fs", "host_path": "/shared/ckpt"}
POOLS = {
    "cpu": {"partition": "cpu", "slots_per_node": 2},
    "gpu": {"partition": "gpu", "slot_type": "gpu", "slots_per_node": 4},
}


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DETSLURM_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"golden file {path.name} is missing: run with DETSLURM_UPDATE_GOLDEN=1 once, review it"
    assert text == path.read_text()


def _spec(runtime: Runtime, **over: Any) -> ContainerSpec:
    base: dict[str, Any] = {
        "runtime": runtime,
        "image": "determinedai/pytorch-ngc:0.38.0",
        "binds": (Bind(EXP, EXP), Bind("/data", "/mnt/data", read_only=True), Bind(LIB, "/opt/detslurm/lib", True)),
        "env_names": ("DET_TRIAL_ID", "NCCL_DEBUG"),
        "env_set": (("PYTHONPATH", "/opt/detslurm/lib"),),
    }
    base.update(over)
    return ContainerSpec(**base)


COMMANDS = {
    "podman": _spec(Runtime.PODMAN, global_options=("--runtime", "runc"), run_options=("--ulimit", "nofile=1024:1024")),
    "podman-gpu-force-pull": _spec(Runtime.PODMAN, gpu=Gpu.NVIDIA, force_pull=True),
    "podman-rocm": _spec(Runtime.PODMAN, gpu=Gpu.AMD),
    "apptainer-gpu": _spec(Runtime.APPTAINER, gpu=Gpu.NVIDIA),
    "apptainer-rocm-sif": _spec(Runtime.APPTAINER, gpu=Gpu.AMD, image="/shared/images/torch.sif"),
    "singularity-force-pull": _spec(
        Runtime.SINGULARITY, force_pull=True, executable="/opt/singularity/bin/singularity"
    ),
    "pyxis": _spec(Runtime.PYXIS, run_options=("--container-remap-root",)),
    "enroot": _spec(Runtime.ENROOT, gpu=Gpu.NVIDIA, image="nvcr.io/nvidia/pytorch:24.01-py3"),
}


def test_command_lines_golden() -> None:
    out: list[str] = []
    for name, spec in COMMANDS.items():
        cmd = container_command(spec)
        out += [
            f"## {name}",
            f"prepare: {' '.join(map(_q, cmd.prepare))}",
            f"srun options: {' '.join(map(_q, cmd.srun_options))}",
            f"prefix: {' '.join(map(_q, cmd.prefix))} {cmd.python} -m detslurm.exec.launch",
            f"always srun: {cmd.always_srun}",
            "",
        ]
    _golden("command-lines.txt", "\n".join(out))


def _q(word: str) -> str:
    import shlex

    return shlex.quote(word)


def test_no_container_for_runtime_none() -> None:
    with pytest.raises(ValueError, match="'none' runs no container"):
        container_command(_spec(Runtime.NONE))


@pytest.mark.parametrize(
    "image,uri",
    [
        ("determinedai/pytorch-ngc:0.38.0", "docker://determinedai/pytorch-ngc:0.38.0"),
        ("ubuntu", "docker://ubuntu"),
        ("/shared/images/x.sif", "/shared/images/x.sif"),
        ("images/x.sif", "images/x.sif"),
        ("docker://nvcr.io/nvidia/pytorch:24.01-py3", "docker://nvcr.io/nvidia/pytorch:24.01-py3"),
        ("oras://ghcr.io/me/img:1", "oras://ghcr.io/me/img:1"),
        ("library://sylabs/default/alpine", "library://sylabs/default/alpine"),
    ],
)
def test_apptainer_image_names(image: str, uri: str) -> None:
    assert apptainer_image(image) == uri


@pytest.mark.parametrize(
    "image,name",
    [
        ("nvcr.io/nvidia/pytorch:24.01-py3", "nvcr.io#nvidia/pytorch:24.01-py3"),
        ("docker://registry.example.org:5000/me/img:1", "registry.example.org:5000#me/img:1"),
        ("localhost/img:1", "localhost#img:1"),
        ("determinedai/pytorch-ngc:0.38.0", "determinedai/pytorch-ngc:0.38.0"),
        ("ubuntu:22.04", "ubuntu:22.04"),
        ("nvcr.io#nvidia/pytorch:24.01-py3", "nvcr.io#nvidia/pytorch:24.01-py3"),
        ("/shared/images/torch.sqsh", "/shared/images/torch.sqsh"),
    ],
)
def test_pyxis_image_names(image: str, name: str) -> None:
    assert pyxis_image(image) == name


def _config(**over: Any) -> ExperimentConfig:
    raw: dict[str, Any] = {
        "name": "golden",
        "entrypoint": "python3 train.py",
        "searcher": {"name": "single", "metric": "loss"},
        "reproducibility": {"experiment_seed": 1},
        "hyperparameters": {"lr": 0.1},
        "environment": {
            "image": "determinedai/pytorch-ngc:0.38.0",
            "environment_variables": ["NCCL_DEBUG=INFO"],
        },
        "bind_mounts": [{"host_path": "/data", "container_path": "/mnt/data", "read_only": True}],
    }
    raw.update(over)
    return validate(raw, STORAGE)


def _site(runtime: str, **container: Any) -> SiteConfig:
    return SiteConfig.model_validate(
        {"default_pool": "cpu", "pools": POOLS, "container_runtime": runtime, "container": container}
    )


def _render(cfg: ExperimentConfig, site: SiteConfig, container: bool = True) -> str:
    run_dir = f"{EXP}/trials/2/runs/3"
    env = trial_env(
        experiment_id=1,
        trial_id=2,
        run_id=3,
        seed=42,
        hparams={"lr": 0.1},
        config={"name": "golden"},
        latest_checkpoint=None,
        steps_completed=0,
        run_dir=Path(run_dir),
        trial_dir=Path(f"{EXP}/trials/2"),
        exp_dir=Path(EXP),
        checkpoint_base=cfg.storage_base,
        resources_type="slurm-job",
        slot_ids=[0],
        container_addrs=["127.0.0.1"],
        user="alice",
    )
    env.update(cfg.environment.variables())
    req = plan_trial_run(
        config=cfg,
        site=site,
        res=resource_plan(cfg, site),
        ident=Identity(1, 2, 3, tag="abcd"),
        env=env,
        run_dir=run_dir,
        log_path=f"{run_dir}/output.log",
        python="/opt/venv/bin/python",
        container=ContainerPaths(EXP, LIB) if container else None,
    )
    assert subprocess.run(["bash", "-n"], input=req.script, text=True).returncode == 0
    return req.render()


PODMAN = {
    "global_options": ["--runtime", "runc", "--cgroup-manager=cgroupfs"],
    "run_options": ["--ulimit", "nofile=1024:1024"],
}
SCRIPTS = {
    "podman-1node": ("podman", PODMAN, {}),
    "podman-2nodes": ("podman", PODMAN, {"resources": {"slots_per_trial": 4}}),
    "podman-gpu-2nodes": ("podman", PODMAN, {"resources": {"slots_per_trial": 8, "resource_pool": "gpu"}}),
    "apptainer-gpu-2nodes": ("apptainer", {}, {"resources": {"slots_per_trial": 8, "resource_pool": "gpu"}}),
    "singularity-1node": ("singularity", {"executable": "/opt/singularity/bin/singularity"}, {}),
    "pyxis-1node-gpu": ("pyxis", {}, {"resources": {"slots_per_trial": 2, "resource_pool": "gpu"}}),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_sbatch_scripts_golden(name: str) -> None:
    runtime, container, over = SCRIPTS[name]
    _golden(f"{name}.sbatch", _render(_config(**over), _site(runtime, **container)))


def test_no_image_or_no_runtime_renders_no_container() -> None:
    no_image = _config(environment={})
    for text in (_render(no_image, _site("podman")), _render(_config(), _site("none"))):
        assert "podman" not in text and "/opt/venv/bin/python -m detslurm.exec.launch &" in text


def test_image_map_by_device_kind() -> None:
    cfg = _config(environment={"image": {"cpu": "img-cpu:1", "cuda": "img-cuda:1"}})
    assert "docker://img-cpu:1" in _render(cfg, _site("apptainer"))
    gpu = _config(environment={"image": {"cpu": "img-cpu:1"}}, resources={"slots_per_trial": 1, "resource_pool": "gpu"})
    with pytest.raises(ConfigError, match="environment.image: no 'cuda' image for this cuda resource pool"):
        _render(gpu, _site("apptainer"))


def test_a_user_bind_mount_that_provides_the_storage_path_wins() -> None:
    cfg = _config(
        checkpoint_storage={"type": "directory", "container_path": "/ckpt/mine"},
        bind_mounts=[{"host_path": "/shared/alice/ckpt", "container_path": "/ckpt"}],
    )
    text = _render(cfg, _site("podman"))
    assert "-v /shared/alice/ckpt:/ckpt " in text and "/ckpt/mine:" not in text


def test_site_container_options_are_checked() -> None:
    with pytest.raises(Exception, match="must be a program name or path"):
        _site("podman", executable="podman; rm -rf ~")
    with pytest.raises(Exception, match="newline"):
        _site("podman", run_options=["--ulimit\nnofile=1"])
    with pytest.raises(Exception, match="container_runtime"):
        SiteConfig.model_validate({"container_runtime": "docker"})


def test_hostile_image_and_paths_stay_one_word() -> None:
    cfg = _config(environment={"image": "img$(touch /tmp/PWNED); echo"})
    text = _render(cfg, _site("podman"))
    assert "'img$(touch /tmp/PWNED); echo'" in text


# -- the in-job library ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("lib")
    return container_lib.ensure_lib(container_lib.lib_dir(base))


def test_in_job_side_imports_from_the_library_alone(lib: Path) -> None:
    # -S: no site-packages at all, as in an image without detslurm. Every module the launcher,
    # the launchers and the Core API import must come from the library or the standard library.
    probe = f"""
import sys, sysconfig
sys.path[:0] = [{str(lib)!r}, {str(lib / "detslurm" / "_compat")!r}]
import detslurm.exec.launch, detslurm.launch.torch_distributed, detslurm.launch.wrap_rank
import detslurm.launch.autohorovod, detslurm.launch.deepspeed, detslurm.launch.horovod, detslurm.core
import determined, determined.core
stdlib = sysconfig.get_paths()["stdlib"]
outside = sorted(
    n for n, m in list(sys.modules.items())
    if getattr(m, "__file__", None) and not m.__file__.startswith(({str(lib)!r}, stdlib))
)
print("outside:", outside)
"""
    res = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, cwd=lib)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "outside: []"


def test_library_leaves_out_the_login_side_and_is_read_only(lib: Path) -> None:
    assert not (lib / "detslurm" / "store").exists() and not (lib / "detslurm" / "controller").exists()
    assert (lib / "detslurm" / "launch" / "torch_distributed.py").stat().st_mode & 0o777 == 0o400
    # Same sources, same key: made once, reused by every run.
    assert container_lib.ensure_lib(container_lib.lib_dir(lib.parent)) == lib


# -- a missing image ends the trial without retries -----------------------------------------


def test_image_exit_record_gives_its_own_cause(tmp_path: Path) -> None:
    record = tmp_path / "exit.json"
    record.write_text(IMAGE_EXIT_PRINTF.replace("\\n", "\n") % (125, "7"))
    outcome = exit_outcome(record)
    assert (outcome.code, outcome.source) == (125, "image")
    from detslurm.slurm.states import SlurmState

    assert _ended(SlurmState.FAILED, 125, image_failed=True).cause is ExitCause.IMAGE_UNAVAILABLE
    assert _ended(None, 125, image_failed=True).state is JobState.EXITED
    # Preempted while pulling: retried as any preemption, not an image failure.
    assert _ended(SlurmState.PREEMPTED, 1, image_failed=True).cause is ExitCause.PREEMPTED


def test_signals_file_of_the_batch_shell_preempts(tmp_path: Path) -> None:
    # In a container, Slurm's SIGTERM may never reach the trial; the line the batch shell writes
    # into the run dir does.
    signals = tmp_path / "signals"
    acks: list[int] = []
    ctx = PreemptContext(
        DummyDistributedContext(), tmp_path / "control.json", lambda: acks.append(1), signals_path=signals
    )
    ctx.start()
    try:
        assert not ctx.should_preempt()
        signals.write_text("TERM\n")
        deadline = time.time() + 5
        while not ctx.should_preempt() and time.time() < deadline:
            time.sleep(0.05)
        assert ctx.should_preempt() and acks == [1]
    finally:
        ctx.close()


def test_registry_auth_reaches_apptainer_through_the_environment_only() -> None:
    auth = {"username": "alice", "password": "s3cret pass", "serveraddress": "ghcr.io"}
    env = {"image": "ghcr.io/alice/img:1", "registry_auth": auth}
    text = _render(_config(environment=env), _site("apptainer"))
    assert "\nexport APPTAINER_DOCKER_USERNAME=alice\n" in text
    assert "\nexport APPTAINER_DOCKER_PASSWORD='s3cret pass'\n" in text
    # Only exported: no command line carries the password.
    assert all("s3cret" not in line for line in text.splitlines() if not line.startswith("export "))
    assert "SINGULARITY_DOCKER_USERNAME=alice" in _render(_config(environment=env), _site("singularity"))
    assert "s3cret" not in _render(_config(environment=env), _site("podman"))


def test_container_settings_a_runtime_does_not_apply_are_warned_about() -> None:
    from detslurm.slurm.render import container_warnings

    cfg = _config(
        environment={"image": "img:1", "registry_auth": {"username": "a"}, "add_capabilities": ["SYS_PTRACE"]},
        resources={"shm_size": "4G"},
    )
    assert container_warnings(cfg, _site("podman")) == [
        "environment.registry_auth is not used with podman: use podman login on the nodes",
        "environment.add_capabilities, resources.shm_size: not applied to podman containers",
    ]
    assert container_warnings(cfg, _site("none")) == [] and container_warnings(_config(), _site("apptainer")) == []


def test_in_a_container_the_shim_wins_over_an_images_own_determined(tmp_path: Path) -> None:
    # An image with the real `determined` installed: outside a container it wins (docs/user/determined-compat.md), in
    # one it would look for a master that does not exist, so detslurm's shim goes first.
    (tmp_path / "determined").mkdir()
    (tmp_path / "determined" / "__init__.py").write_text("")
    probe = (
        "from pathlib import Path; from detslurm.exec.launch import COMPAT_DIR, child_env\n"
        "inside = child_env({'DETSLURM_IN_CONTAINER': 'podman'}, Path('/w'))['PYTHONPATH']\n"
        "outside = child_env({}, Path('/w'))['PYTHONPATH']\n"
        "print(str(COMPAT_DIR) in inside.split(':'), str(COMPAT_DIR) in outside.split(':'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "False"]


@pytest.mark.parametrize(
    "env,devices,visible",
    [
        ({"SLURM_STEP_GPUS": "2,3", "SLURM_JOB_GPUS": "0,1,2,3"}, ["2", "3"], "0,1"),  # a step's GPUs win
        ({"SLURM_JOB_GPUS": "5"}, ["5"], "0"),  # the batch step (one node) has only the job's
    ],
)
def test_podman_gets_exactly_the_allocated_gpus(
    tmp_path: Path, env: dict[str, str], devices: list[str], visible: str
) -> None:
    # A fake podman that prints its arguments: the real shell line runs with Slurm's variables.
    fake = tmp_path / "podman"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    cmd = container_command(_spec(Runtime.PODMAN, gpu=Gpu.NVIDIA, executable=str(fake)))
    argv = [*cmd.prefix, "python3", "-m", "detslurm.exec.launch"]
    res = subprocess.run(argv, capture_output=True, text=True, env={"PATH": os.environ["PATH"], **env}, check=True)
    args = res.stdout.splitlines()
    assert [a.split("=")[-1] for a in args if a.startswith("--device=nvidia.com/gpu=")] == devices
    assert f"--env=CUDA_VISIBLE_DEVICES={visible}" in args and "--env=CUDA_VISIBLE_DEVICES" not in args
    assert args[-4:] == ["determinedai/pytorch-ngc:0.38.0", "python3", "-m", "detslurm.exec.launch"]
