"""Partitions as ``scontrol show partition -o`` describes them: the limits a request is checked
against before anything is queued, and the GraceTime a preempted trial gets.

Pure parsing (tested on output captured from real clusters); ``SlurmClient.partitions()`` runs
the command."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from detslurm.slurm.parse import SlurmParseError, parse_key_values

# Words Slurm prints where a limit is absent.
_NO_LIMIT = {"UNLIMITED", "INFINITE", "NONE", "N/A", "(null)", ""}


def parse_duration_s(text: str) -> Optional[int]:
    """Slurm's time format (``MaxTime``, ``DefaultTime``, sbatch ``--time``): ``minutes``,
    ``minutes:seconds``, ``hours:minutes:seconds``, ``days-hours[:minutes[:seconds]]``.
    None means no limit; a malformed value raises ValueError."""
    text = text.strip()
    if text.upper() in _NO_LIMIT:
        return None
    days = 0
    if "-" in text:
        d, _, text = text.partition("-")
        days = int(d)
        parts = [int(x) for x in text.split(":")]
        # After a day count the first field is hours, not minutes.
        h, m, s = (parts + [0, 0])[:3]
        return ((days * 24 + h) * 60 + m) * 60 + s
    parts = [int(x) for x in text.split(":")]
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    if len(parts) == 3:
        return (parts[0] * 60 + parts[1]) * 60 + parts[2]
    raise ValueError(f"not a Slurm time: {text!r}")


def _limit(text: str) -> Optional[int]:
    return None if text.strip().upper() in _NO_LIMIT else int(text)


def _names(text: str) -> Optional[frozenset[str]]:
    """``AllowAccounts=ALL`` (None: everyone) or a comma list."""
    return None if text.upper() in ("ALL", "") else frozenset(x for x in text.split(",") if x)


@dataclass(frozen=True)
class PartitionInfo:
    """One partition's limits. ``None`` means Slurm sets no limit."""

    name: str
    default: bool
    up: bool
    nodes: str
    total_nodes: int
    total_cpus: int
    max_nodes: Optional[int]
    max_time_s: Optional[int]
    default_time_s: Optional[int]
    # Seconds a preempted job keeps running after its SIGTERM before Slurm kills it (added to
    # KillWait for PreemptMode=CANCEL/REQUEUE); 0 on most sites.
    grace_time_s: int
    max_cpus_per_node: Optional[int]
    allow_accounts: Optional[frozenset[str]]
    deny_accounts: Optional[frozenset[str]]
    allow_qos: Optional[frozenset[str]]
    deny_qos: Optional[frozenset[str]]
    preempt_mode: str
    priority_tier: int

    def allows_account(self, account: str) -> bool:
        if self.allow_accounts is not None and account not in self.allow_accounts:
            return False
        return not (self.deny_accounts and account in self.deny_accounts)

    def allows_qos(self, qos: str) -> bool:
        if self.allow_qos is not None and qos not in self.allow_qos:
            return False
        return not (self.deny_qos and qos in self.deny_qos)


def _partition(kv: dict[str, str], line: str) -> PartitionInfo:
    try:
        return PartitionInfo(
            name=kv["PartitionName"],
            default=kv.get("Default", "NO") == "YES",
            up=kv.get("State", "UP") == "UP",
            nodes=kv.get("Nodes", ""),
            total_nodes=int(kv.get("TotalNodes", "0")),
            total_cpus=int(kv.get("TotalCPUs", "0")),
            max_nodes=_limit(kv.get("MaxNodes", "UNLIMITED")),
            max_time_s=parse_duration_s(kv.get("MaxTime", "UNLIMITED")),
            default_time_s=parse_duration_s(kv.get("DefaultTime", "NONE")),
            grace_time_s=int(kv.get("GraceTime", "0")),
            max_cpus_per_node=_limit(kv.get("MaxCPUsPerNode", "UNLIMITED")),
            allow_accounts=_names(kv.get("AllowAccounts", "ALL")),
            deny_accounts=_names(kv["DenyAccounts"]) if "DenyAccounts" in kv else None,
            allow_qos=_names(kv.get("AllowQos", "ALL")),
            deny_qos=_names(kv["DenyQos"]) if "DenyQos" in kv else None,
            preempt_mode=kv.get("PreemptMode", "OFF"),
            priority_tier=int(kv.get("PriorityTier", "1")),
        )
    except (KeyError, ValueError) as e:
        raise SlurmParseError("scontrol show partition -o", line) from e


def parse_partitions(text: str) -> list[PartitionInfo]:
    """``scontrol show partition -o``: one partition per line, ``Key=Value`` pairs."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        # TRES=cpu=4,mem=... holds '=' inside a value: parse_key_values keeps the first pair.
        kv = parse_key_values(re.sub(r"\s+", " ", line.strip()))
        out.append(_partition(kv, line))
    return out


@dataclass(frozen=True)
class AssocLimit:
    """One association of the user (``sacctmgr show assoc``): the per-user job limits a site
    sets in its accounting database. ``None`` means no limit at this level."""

    account: str
    partition: str  # "" for an association that covers every partition
    max_submit_jobs: Optional[int]
    max_jobs: Optional[int]


ASSOC_FIELDS = "Account,Partition,MaxSubmitJobs,MaxJobs"


def parse_assoc_limits(text: str) -> list[AssocLimit]:
    """``sacctmgr -n -P show assoc user=U format=ASSOC_FIELDS``: ``|``-separated lines."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        f = line.split("|")
        if len(f) < 4:
            raise SlurmParseError("sacctmgr show assoc", line)
        try:
            out.append(AssocLimit(f[0], f[1], _limit(f[2]), _limit(f[3])))
        except ValueError as e:
            raise SlurmParseError("sacctmgr show assoc", line) from e
    return out
