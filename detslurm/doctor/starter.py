"""`det site init`: a starter site config written from what Slurm reports.

Every partition that is up and has nodes becomes a pool (GPU slots where sinfo shows GPUs,
else CPU slots); the default partition becomes the default pool; the polling floor and the
warning signal get values that suit the site's size. The result is YAML with comments, and it
is validated as a site config before anything is written.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from detslurm.doctor.facts import SiteFacts
from detslurm.errors import DetSlurmError
from detslurm.slurm.parse import Capabilities
from detslurm.slurm.site import SiteConfig

# Polling floors: 10 s suits most sites; big or rate-limited ones want the daemons slower still.
POLL_FLOOR_S = 10
POLL_FLOOR_BUSY_S = 30
BIG_SITE_NODES = 1000


class SiteInitError(DetSlurmError):
    pass


def poll_floor(caps: Capabilities, total_nodes: int) -> int:
    """The polling floor `det site init` writes (and the doctor's table explains)."""
    return POLL_FLOOR_BUSY_S if caps.rate_limited or total_nodes >= BIG_SITE_NODES else POLL_FLOOR_S


def _q(text: str) -> str:
    # JSON strings are valid YAML scalars: any partition name or description stays one value.
    return json.dumps(text)


def _found(f: SiteFacts) -> list[str]:
    """What Slurm said, as comments: the reasons behind the values below, for the admin reading it."""
    caps, p = f.caps, f.caps.plugins
    yes_no = {True: "yes", False: "no"}
    return [
        f"# Found: {p.select or 'select/?'}, {p.proctrack or 'proctrack/?'}, GresTypes {p.gres_types or 'none'}; "
        f"accounting {yes_no[caps.accounting]}; enable_user_top {yes_no[caps.enable_user_top]}; "
        f"RPC rate limiting {yes_no[caps.rate_limited]}",
        f"#        PreemptMode {caps.preempt_mode} ({p.preempt_type or 'preempt/none'}), "
        f"KillWait {caps.kill_wait_s} s; MaxArraySize {caps.max_array_size}, MaxJobCount {caps.max_job_count}",
    ]


def starter_yaml(f: SiteFacts) -> str:
    """The starter site config's text (pure)."""
    parts = [p for p in f.partitions if p.up and p.total_nodes > 0]
    if not parts:
        raise SiteInitError("no partition is up with nodes: nothing to describe as a pool")
    # Slurm's Default=YES partition is where a plain sbatch goes: the natural default pool.
    default = next((p.name for p in parts if p.default), parts[0].name)
    total_nodes = sum(p.total_nodes for p in f.partitions)
    cluster = f.caps.cluster_name or "this cluster"
    lines = [
        f"# detslurm site config for {cluster} (Slurm {f.caps.version}), written by `det site init`.",
        "# Check it with `det site doctor`; every key is described in site-configs/generic.yaml.",
        *_found(f),
        f"default_pool: {_q(default)}",
        "# A floor: no user's daemon polls slurmctld more often than this.",
        f"poll_interval_s: {poll_floor(f.caps, total_nodes)}",
        "# Sent this many seconds before a job's time limit so the trial can checkpoint (never USR1: NCCL's).",
        "signal: USR2",
        "signal_lead_s: 300",
        "container_runtime: none     # or podman, apptainer, singularity, pyxis",
        "# Shell lines run before every trial, e.g. module load python/3.11",
        "setup: []",
        "# python: /path/to/venv/bin/python   # the interpreter on the nodes (default: the one running det)",
        "# node_tmpdir: ${LOCAL_SCRATCH:-/tmp} # node-local scratch for unpacked code",
        "pools:",
    ]
    for p in parts:
        # A partition that mixes GPU and CPU nodes is a CPU pool: a GPU pool there would still
        # run (Slurm picks GPU nodes for --gres), but its slot counts would describe half the nodes.
        gpus = f.gpus_per_node(p.name) if f.all_gpu(p.name) else 0
        # Average CPUs per node: mixed partitions get a slot count every node can offer or close.
        cpus = p.total_cpus // p.total_nodes
        limit = f", MaxTime {p.max_time_s // 60} min" if p.max_time_s is not None else ""
        lines += [
            f"  {_q(p.name)}:",
            f"    partition: {_q(p.name)}",
            f"    slot_type: {'gpu' if gpus else 'cpu'}",
            f"    slots_per_node: {gpus or max(1, cpus)}",
        ]
        if gpus:
            lines.append("    gres_name: gpu")
        what = f"{gpus} GPUs each" if gpus else f"{cpus} CPUs each"
        if not gpus and f.gpu_nodes(p.name):
            what += f" ({f.gpu_nodes(p.name)} of them with GPUs)"
        lines.append(f"    description: {_q(f'{p.total_nodes} nodes ({p.nodes}), {what}{limit}')}")
    text = "\n".join(lines) + "\n"
    # Never write a config that would not load: the same validation `det` applies to it.
    from detslurm.expconf.load import parse_yaml

    SiteConfig.model_validate(parse_yaml(text, "<site-config>"))
    return text


def write_starter(text: str, path: Path, force: bool) -> None:
    """Write ``text`` to ``path``; an existing file only with ``force``."""
    if path.exists() and not force:
        raise SiteInitError(f"{path} exists; use --force to overwrite it (or --output to write elsewhere)")
    try:
        # Every user reads a site config: dirs made here are 0755 whatever the umask (root's
        # may be 077, which would hide /etc/detslurm from everyone else).
        for d in reversed([p for p in path.parents if not p.exists()]):
            d.mkdir(exist_ok=True)
            d.chmod(0o755)
        # A random temp name, created exclusively and never through a link: the config may go to
        # a dir others can write (a group's shared config dir), where a predictable name (the
        # pid) could be pre-planted as a symlink that this write would follow.
        tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
        # 0644: a site config is read by every user of the site; it holds no secret.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        os.fchmod(fd, 0o644)  # the umask took bits off the create's mode
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        tmp.replace(path)
    except OSError as e:
        raise SiteInitError(f"cannot write {path}: {e.strerror}") from None
