"""Horovod overrides in horovodrun's spelling -> Horovod's environment (no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from detslurm.launch._common import LaunchError
from detslurm.launch._horovod_args import Controller, parse_overrides
from detslurm.launch.horovod import take_autohorovod


def test_seed_example_overrides() -> None:
    s = parse_overrides(["--fusion-threshold-mb", "1", "--cycle-time-ms", "2"])
    assert s.env == {"HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_CYCLE_TIME": "2.0"}
    assert s.controller is Controller.GLOO


def test_every_tuning_flag_maps_to_its_variable() -> None:
    s = parse_overrides(
        [
            "--cache-capacity=2048",
            "--hierarchical-allreduce",
            "--no-hierarchical-allgather",
            "--autotune",
            "--autotune-log-file",
            "/tmp/at.csv",
            "--autotune-gaussian-process-noise",
            "0.5",
            "--timeline-filename",
            "/tmp/tl.json",
            "--timeline-mark-cycles",
            "--no-stall-check",
            "--stall-check-warning-time-seconds",
            "30",
            "--stall-check-shutdown-time-seconds",
            "90",
            "--log-level",
            "debug",
            "--tcp",
            "--gloo-timeout-seconds",
            "60",
            "--log-without-timestamp",
        ]
    )
    assert s.env == {
        "HOROVOD_CACHE_CAPACITY": "2048",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "0",
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": "/tmp/at.csv",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5",
        "HOROVOD_TIMELINE": "/tmp/tl.json",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90",
        "HOROVOD_LOG_LEVEL": "DEBUG",
        "NCCL_IB_DISABLE": "1",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "60",
        "HOROVOD_LOG_HIDE_TIME": "1",
    }


def test_controller_mpi_args_and_topology_flags() -> None:
    s = parse_overrides(
        ["--mpi", "--mca", "btl", "tcp,self", "--mpi-args=-x FOO --bind-to core", "--start-timeout", "30"]
    )
    assert s.controller is Controller.MPI and s.start_timeout_s == 30
    assert s.mpi_args == ["--mca", "btl", "tcp,self", "-x", "FOO", "--bind-to", "core"]
    s = parse_overrides(["--gloo", "--network-interface", "ib0", "-p", "12350", "--verbose"])
    assert (s.network_interface, s.ignored, s.verbose) == ("ib0", ["-p", "12350"], True)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--bogus"], "unknown horovod override '--bogus'"),
        (["--fusion-threshold", "1"], "unknown horovod override '--fusion-threshold'"),
        (["--fusion-threshold-mb", "x"], "--fusion-threshold-mb: expected a non-negative integer, got 'x'"),
        (["--cycle-time-ms", "-1"], "--cycle-time-ms: expected a non-negative number"),
        (["--autotune-gaussian-process-noise", "2"], "expected a number between 0 and 1"),
        (["--log-level", "LOUD"], "expected one of TRACE, DEBUG"),
        (["--cycle-time-ms"], "--cycle-time-ms needs 1 value"),
        (["--autotune=1"], "--autotune takes no value"),
        (["-np", "4"], "-np is not supported: the Slurm allocation decides"),
        (["--min-np", "2"], "elastic Horovod is not supported"),
        (["--mca", "btl", "tcp"], "--mca is an mpirun option: it needs --mpi"),
    ],
)
def test_bad_overrides_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=message.replace("(", r"\(")):
        parse_overrides(overrides)


def test_autohorovod_flag_is_taken_after_the_separator() -> None:
    assert take_autohorovod(["--autohorovod", "--trial", "m:C"]) == (["--trial", "m:C"], True)
    assert take_autohorovod(["--cycle-time-ms", "2", "--", "--autohorovod", "s.py"]) == (
        ["--cycle-time-ms", "2", "--", "s.py"],
        True,
    )
    assert take_autohorovod(["s.py", "--autohorovod"]) == (["s.py", "--autohorovod"], False)


def test_legacy_harness_torch_env_from_each_launcher() -> None:
    from detslurm.exec.harness import torch_env_for_trial

    hvd = {"USE_HOROVOD": "1", "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1"}
    hvd |= {"HOROVOD_LOCAL_SIZE": "2", "DET_CHIEF_IP": "c1", "DETSLURM_TORCH_PORT": "4100"}
    assert torch_env_for_trial(hvd) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "c1",
        "MASTER_PORT": "4100",
        "USE_TORCH_DISTRIBUTED": "true",
    }
    mpi = {"USE_HOROVOD": "1", "DETSLURM_TORCH_PORT": "9"} | {
        f"OMPI_COMM_WORLD_{k}": v for k, v in {"RANK": "0", "SIZE": "2", "LOCAL_RANK": "0", "LOCAL_SIZE": "2"}.items()
    }
    assert (
        torch_env_for_trial(mpi)["MASTER_ADDR"] == "127.0.0.1" and torch_env_for_trial(mpi)["GROUP_WORLD_SIZE"] == "1"
    )
    ds = {"USE_DEEPSPEED": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    assert torch_env_for_trial(ds) == {
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "USE_TORCH_DISTRIBUTED": "true",
    }
    assert torch_env_for_trial({**ds, "WORLD_SIZE": "1"}) == {}  # one rank: no process group
    assert torch_env_for_trial({"USE_TORCH_DISTRIBUTED": "True", **hvd}) == {}  # torchrun set it all
    with pytest.raises(ValueError, match="did not set DETSLURM_TORCH_PORT"):
        torch_env_for_trial({k: v for k, v in hvd.items() if k != "DETSLURM_TORCH_PORT"})
    with pytest.raises(ValueError, match="did not set CROSS_RANK"):
        torch_env_for_trial({k: v for k, v in ds.items() if k != "CROSS_RANK"})


def test_legacy_harness_names_a_missing_module_or_class(tmp_path: Path) -> None:
    import os

    from detslurm.exec.harness import load_trial_class

    (tmp_path / "model_def.py").write_text("class Real:\n    pass\n")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ValueError, match="no module 'nope'"):
            load_trial_class("nope:Trial")
        with pytest.raises(ValueError, match="model_def has no attribute 'Typo'"):
            load_trial_class("model_def:Typo")
        assert load_trial_class("model_def:Real").__name__ == "Real"
    finally:
        os.chdir(cwd)
