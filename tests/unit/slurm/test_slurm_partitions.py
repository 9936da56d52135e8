"""Partition limits and site timing parsed from output captured on the real test clusters."""

from __future__ import annotations

from pathlib import Path

import pytest

from detslurm.slurm.parse import SlurmParseError, parse_config
from detslurm.slurm.partitions import AssocLimit, parse_assoc_limits, parse_duration_s, parse_partitions

DATA = Path(__file__).parents[2] / "data"


def test_partitions_from_22_05() -> None:
    parts = {p.name: p for p in parse_partitions((DATA / "slurm-22.05" / "show-partition.txt").read_text())}
    assert sorted(parts) == ["cpu", "gpu", "high"]
    cpu, high = parts["cpu"], parts["high"]
    assert cpu.default and not high.default
    assert (cpu.total_nodes, cpu.total_cpus, cpu.nodes) == (2, 4, "c[1-2]")
    assert cpu.max_nodes is None and cpu.max_time_s is None and cpu.grace_time_s == 0
    assert cpu.preempt_mode == "REQUEUE" and high.preempt_mode == "OFF"
    assert high.priority_tier == 10 and cpu.priority_tier == 1
    assert cpu.allows_account("anyone") and cpu.allows_qos("normal")


def test_partition_limits_and_lists() -> None:
    line = (
        "PartitionName=short AllowGroups=ALL AllowAccounts=ml,vision AllowQos=ALL DenyQos=debug Default=NO "
        "GraceTime=120 MaxNodes=4 MaxTime=1-12:00:00 DefaultTime=30:00 MaxCPUsPerNode=64 Nodes=n[1-8] "
        "PriorityTier=2 PreemptMode=CANCEL State=DOWN TotalCPUs=512 TotalNodes=8 TRES=cpu=512,node=8"
    )
    (p,) = parse_partitions(line + "\n")
    assert (p.max_nodes, p.max_time_s, p.default_time_s, p.grace_time_s) == (4, 36 * 3600, 1800, 120)
    assert p.max_cpus_per_node == 64 and not p.up
    assert p.allows_account("ml") and not p.allows_account("physics")
    assert p.allows_qos("normal") and not p.allows_qos("debug")


def test_bad_partition_line_is_a_parse_error() -> None:
    with pytest.raises(SlurmParseError):
        parse_partitions("Default=YES MaxNodes=4\n")
    with pytest.raises(SlurmParseError):
        parse_partitions("PartitionName=x MaxNodes=lots\n")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("UNLIMITED", None),
        ("INFINITE", None),
        ("30", 1800),
        ("5:30", 330),
        ("1:00:00", 3600),
        ("2-03", 2 * 86400 + 3 * 3600),
        ("1-00:01:02", 86462),
    ],
)
def test_slurm_durations(text: str, seconds: int | None) -> None:
    assert parse_duration_s(text) == seconds


def test_site_timing_from_show_config() -> None:
    caps = parse_config((DATA / "slurm-22.05" / "show-config.txt").read_text())
    assert caps.kill_wait_s == 5 and caps.preempt_mode == "REQUEUE"
    assert caps.max_job_count == 10000 and caps.message_timeout_s == 10 and not caps.rate_limited
    limited = parse_config("SLURM_VERSION = 24.11.5\nSlurmctldParameters = enable_configless,rl_enable\n")
    assert limited.rate_limited and limited.kill_wait_s == 30


def test_plugins_and_min_job_age_from_show_config() -> None:
    caps = parse_config((DATA / "slurm-22.05" / "show-config.txt").read_text())
    p = caps.plugins
    assert (p.select, p.select_params, p.proctrack, p.task) == (
        "select/cons_tres",
        "CR_CORE",
        "proctrack/linuxproc",
        "task/none",
    )
    assert (p.switch, p.mpi_default, p.job_acct_gather, p.job_container) == (
        "switch/none",
        "none",
        "jobacct_gather/none",
        "job_container/none",
    )
    assert p.gres_types == "gpu" and p.preempt_type == "preempt/partition_prio" and caps.min_job_age_s == 300
    # "(null)" means the plugin is not set at all.
    bare = parse_config("SLURM_VERSION = 24.11.5\nJobContainerType = (null)\n")
    assert bare.plugins.job_container == "" and bare.plugins.select == ""


def test_assoc_limits() -> None:
    limits = parse_assoc_limits("ml||500|100\nml|gpu|50|\n\n")
    assert limits == [AssocLimit("ml", "", 500, 100), AssocLimit("ml", "gpu", 50, None)]
    with pytest.raises(SlurmParseError):
        parse_assoc_limits("ml|x|lots|1\n")
    with pytest.raises(SlurmParseError):
        parse_assoc_limits("just one field\n")
