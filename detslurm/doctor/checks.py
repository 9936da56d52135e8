"""Site-level checks: pure functions from :class:`SiteFacts` to findings (no I/O, no Slurm).

Each check says what it found and what detslurm does about it. Thresholds are the ones a
newcomer could not guess, so each carries the reason it has the value it has.
"""

from __future__ import annotations

from detslurm.doctor.facts import SiteFacts
from detslurm.doctor.findings import Finding, Status
from detslurm.slurm.budget import preemption_budget
from detslurm.slurm.partitions import PartitionInfo
from detslurm.slurm.refusals import takes_no_jobs
from detslurm.slurm.site import Pool

OK, WARNING, PROBLEM = Status.OK, Status.WARNING, Status.PROBLEM

# Below this, a trial that checkpoints on SIGTERM is likely cut off by SIGKILL: writing even a
# small model to a network filesystem takes tens of seconds on a busy site.
MIN_PREEMPT_WINDOW_S = 30
# A polling floor under this lets every user's daemon query slurmctld more often than the
# Slurm docs advise for scripts on a large site (squeue every few seconds per user adds up).
MIN_POLL_FLOOR_S = 5.0


def _secs(value: int | None) -> str:
    return "unlimited" if value is None else f"{value} s"


def check_slurm(f: SiteFacts) -> Finding:
    caps = f.caps
    cluster = f", cluster {caps.cluster_name}" if caps.cluster_name else ""
    return Finding("slurm", OK, f"Slurm {caps.version}{cluster}, SlurmUser {caps.slurm_user}", "")


def check_plugins(f: SiteFacts) -> Finding:
    p = f.caps.plugins
    # Listed whatever the verdict: admins answering a user's question want the whole set.
    names = [
        f"{p.select} ({p.select_params})" if p.select_params else p.select,
        p.proctrack,
        p.task,
        p.switch,
        f"MpiDefault={p.mpi_default}" if p.mpi_default else "",
        p.job_acct_gather,
        p.job_container,
        f"GresTypes={p.gres_types}" if p.gres_types else "GresTypes none",
    ]
    detail = ", ".join(n for n in names if n)
    # Without gpu in GresTypes, slurmctld rejects every --gres=gpu:N at submission time.
    gpu_pools = [name for name, pool in f.site.pools.items() if pool.slot_type == "gpu"]
    if gpu_pools and "gpu" not in p.gres_types.split(","):
        return Finding(
            "plugins",
            PROBLEM,
            f"{detail}; pools {', '.join(sorted(gpu_pools))} ask for GPUs but GresTypes has no gpu",
            "GPU trials would be refused by sbatch: ask the admins for gpu GRES, or make the pools cpu",
        )
    if p.select == "select/linear":
        return Finding(
            "plugins",
            WARNING,
            detail,
            "select/linear allocates whole nodes: every trial holds a node, however few slots it asks for",
        )
    # linuxproc and pgid track processes by parent or group, which a double-forked process leaves.
    if p.proctrack and p.proctrack != "proctrack/cgroup":
        return Finding(
            "plugins",
            WARNING,
            detail,
            f"{p.proctrack}: a process that leaves its job (a daemonized worker) escapes Slurm's cleanup; "
            "detslurm's launchers keep their workers in the job, proctrack/cgroup is the admins' fix",
        )
    return Finding("plugins", OK, detail, "")


def check_accounting(f: SiteFacts) -> Finding:
    caps = f.caps
    if caps.accounting:
        # Configured but unreachable slurmdbd: sacct fails too, so final states fall back to squeue.
        if f.assoc_error:
            return Finding(
                "accounting", WARNING, f"slurmdbd configured, but sacctmgr failed: {f.assoc_error}", "sacct is used"
            )
        return Finding(
            "accounting", OK, "slurmdbd: sacct knows how jobs ended", "final states of jobs gone from squeue via sacct"
        )
    # No slurmdbd is common on small clusters and works, but the window to learn an ending is short.
    return Finding(
        "accounting",
        WARNING,
        f"none: a finished job's state is visible only for MinJobAge ({caps.min_job_age_s} s)",
        "the daemon reads final states with squeue --states=all; a daemon stopped longer than MinJobAge "
        "records such runs by their exit record only",
    )


def _preempt_partitions(f: SiteFacts) -> list[PartitionInfo]:
    """The partitions the site config uses (every one when it names none) that can be preempted."""
    used = {p.partition for p in f.site.pools.values()} or {p.name for p in f.partitions}
    return [p for p in f.partitions if p.name in used and p.preempt_mode.upper() != "OFF"]


def check_preemption(f: SiteFacts) -> Finding:
    """KillWait, GraceTime per partition and the site's warning signal, in one line."""
    caps, site = f.caps, f.site
    grace = ", ".join(f"{p.name} {p.grace_time_s} s" for p in f.partitions) or "no partitions"
    detail = (
        f"KillWait {caps.kill_wait_s} s, GraceTime {grace}; "
        f"signal {site.signal} {site.signal_lead_s} s before the time limit (site config)"
    )
    if site.signal_lead_s == 0:
        return Finding(
            "preemption",
            WARNING,
            detail,
            "signal_lead_s is 0: a trial gets no warning before its time limit, only SIGTERM",
        )
    exposed = _preempt_partitions(f) if caps.preemption else []
    if not exposed:
        return Finding("preemption", OK, f"none ({caps.plugins.preempt_type or 'preempt/none'}); {detail}", "")
    mode = caps.preempt_mode.upper()
    # SUSPEND sends no SIGTERM: the trial is frozen, not stopped, so there is nothing to checkpoint.
    if "SUSPEND" in mode or "GANG" in mode:
        return Finding(
            "preemption",
            WARNING,
            f"PreemptMode {caps.preempt_mode}; {detail}",
            "suspended trials keep their memory and GPUs and resume where they were; "
            "detslurm shows them as suspended and does not resubmit them",
        )
    # The tightest partition decides: a pool there gets only this much between SIGTERM and SIGKILL
    # (the same budget `det e describe` holds measured stop times against).
    window = min(preemption_budget(caps, p, site).preemption_s for p in exposed)
    status = WARNING if window < MIN_PREEMPT_WINDOW_S else OK
    return Finding(
        "preemption",
        status,
        f"PreemptMode {caps.preempt_mode} on {', '.join(p.name for p in exposed)}; {detail}",
        f"on SIGTERM trials checkpoint and stop: they have {window} s before SIGKILL; "
        "detslurm resubmits them from their latest checkpoint without spending a restart",
    )


def check_limits(f: SiteFacts) -> Finding:
    caps = f.caps
    parts = [f"MaxArraySize {caps.max_array_size}", f"MaxJobCount {caps.max_job_count}"]
    if f.assoc is None:
        parts.append("MaxSubmitJobs: no accounting, no per-user limit")
    else:
        # Slurm applies the strictest association that matches a job, so the minimum is the bound.
        submit = [a.max_submit_jobs for a in f.assoc if a.max_submit_jobs is not None]
        running = [a.max_jobs for a in f.assoc if a.max_jobs is not None]
        parts.append(f"MaxSubmitJobs {min(submit) if submit else 'unlimited'}")
        parts.append(f"MaxJobs {min(running) if running else 'unlimited'}")
    detail = ", ".join(parts)
    if caps.max_array_size <= 1:
        # MaxArraySize=1 allows only task 0: arrays are of no use.
        return Finding("job limits", WARNING, detail, "job arrays are off: every trial is its own sbatch")
    return Finding(
        "job limits",
        OK,
        detail,
        # Task ids run from 0 to MaxArraySize-1, and detslurm numbers tasks from 0.
        f"trials that start together go as job arrays of at most {caps.max_array_size - 1} tasks (split if more)",
    )


def check_rate_limit(f: SiteFacts) -> Finding:
    floor = f.site.poll_interval_s
    if f.caps.rate_limited:
        return Finding(
            "rpc rate limit",
            OK,
            "SlurmctldParameters=rl_enable: slurmctld throttles each user's RPCs",
            f"one squeue per daemon tick (every {floor:g} s or slower); reads without a daemon do one tick",
        )
    return Finding("rpc rate limit", OK, "not enabled", f"one squeue per daemon tick all the same (every {floor:g} s)")


def check_user_top(f: SiteFacts) -> Finding:
    # Without it `scontrol top` is an operator command, and Determined's "move ahead" has no user-level twin.
    if f.caps.enable_user_top:
        return Finding(
            "enable_user_top", OK, "users may reorder their own jobs", "det job update --ahead-of uses scontrol top"
        )
    return Finding(
        "enable_user_top",
        WARNING,
        "not set: only admins may use scontrol top",
        "det job update can still lower priorities (nice); moving a job ahead of another is refused with this reason",
    )


def check_polling(f: SiteFacts) -> Finding:
    floor = f.site.poll_interval_s
    # The same rule as the daemon's (daemon.py): a user may poll slower than the floor, never faster.
    mine = f.user_poll_interval_s
    used = floor if mine is None else max(floor, mine)
    setting = "sets none" if mine is None else f"asks for {mine:g} s"
    detail = f"site floor poll_interval_s {floor:g} s (from {f.site.origin('poll_interval_s')}); this user {setting}"
    action = f"the daemon polls Slurm every {used:g} s"
    if floor < MIN_POLL_FLOOR_S:
        return Finding(
            "polling", WARNING, detail, f"{action}; a floor under {MIN_POLL_FLOOR_S:g} s suits only small clusters"
        )
    return Finding("polling", OK, detail, action)


def check_site_limits(f: SiteFacts) -> Finding:
    """Each limit a site file sets, and which file set it: what no user's config can loosen."""
    lim, site = f.site.limits, f.site
    parts = [f"poll floor {site.poll_interval_s:g} s ({site.origin('poll_interval_s')})"]
    for name in ("partitions", "accounts", "qos"):
        values = getattr(lim, name)
        where = site.origin(f"limits.{name}")
        parts.append(f"{name} any" if values is None else f"{name} {', '.join(values) or 'none'} ({where})")
    time = lim.max_time_min
    parts.append("max time none" if time is None else f"max time {time} min ({site.origin('limits.max_time_min')})")
    action = "a user's config may tighten these, never loosen them"
    if site.shadowed_pools:
        names = ", ".join(site.shadowed_pools)
        mine = site.files[-1]
        return Finding(
            "site limits",
            WARNING,
            "; ".join([*parts, f"pools {names} of {mine} are the site's too"]),
            f"{action}; the site's definitions of {names} are used: remove them from {mine}",
        )
    return Finding("site limits", OK, "; ".join(parts), action)


def check_site_config(f: SiteFacts) -> Finding:
    if f.site_path is None and not f.site.files:
        return Finding(
            "site config",
            WARNING,
            "none found (/etc/detslurm/site.yaml, $DETSLURM_SITE_CONFIG, ~/.config/detslurm/site.yaml)",
            "every partition is a pool of CPU slots; `det site init` writes a starter config",
        )
    pools = ", ".join(sorted(f.site.pools)) or "no pools"
    default = f" (default {f.site.default_pool})" if f.site.default_pool else ""
    return Finding(
        "site config",
        OK,
        f"{' + '.join(map(str, f.site.files)) or f.site_path}: pools {pools}{default}, "
        f"container_runtime {f.site.container_runtime.value}",
        "experiments choose a pool with resources.resource_pool",
    )


def check_store(f: SiteFacts) -> Finding:
    s = f.store
    if s.kind != "sqlite":
        # Never the URL itself: it may hold a password.
        return Finding("store", OK, f"{s.kind} (db_url)", "writers take a per-user lock; reads take none")
    if s.network_fs:
        return Finding(
            "store",
            WARNING,
            f"SQLite {s.sqlite_path} is on a network filesystem ({s.network_fs})",
            "SQLite's locking is unsafe there from several hosts: set DETSLURM_DATA_DIR to a local disk, "
            "or db_url to PostgreSQL when you work from several login nodes",
        )
    return Finding("store", OK, f"SQLite {s.sqlite_path} on a local filesystem", "use it from this login node only")


def check_partition(f: SiteFacts, p: PartitionInfo) -> Finding:
    gres = f.gres(p.name) or "no GRES"
    detail = (
        f"{'UP' if p.up else 'not UP'}, {p.total_nodes} nodes ({p.nodes}), {p.total_cpus} CPUs, {gres}, "
        f"MaxTime {_secs(p.max_time_s)}, MaxNodes {p.max_nodes if p.max_nodes is not None else 'unlimited'}, "
        f"GraceTime {p.grace_time_s} s, PreemptMode {p.preempt_mode}, PriorityTier {p.priority_tier}"
    )
    pools = sorted(name for name, pool in f.site.pools.items() if pool.partition == p.name)
    # Without a site config every partition is a pool; with one, unused partitions matter less.
    used = f"pool {', '.join(pools)}" if pools else ("a pool" if not f.site.pools else "not used by any pool")
    subject = f"partition {p.name}"
    states = f.node_states(p.name)
    if states:
        detail += "; nodes " + ", ".join(f"{count} {state} ({nodes})" for state, count, nodes in states)
    # A partition no pool uses cannot hurt a trial: it is a warning, not a problem.
    if not p.up:
        return Finding(subject, PROBLEM if pools else WARNING, detail, f"{used}: jobs queue but never start")
    if p.total_nodes == 0:
        return Finding(subject, PROBLEM if pools else WARNING, detail, f"{used}: it has no nodes")
    away = [(state, count, nodes) for state, count, nodes in states if takes_no_jobs(state)]
    out = sum(count for _, count, _ in away)
    if away and out >= p.total_nodes:
        return Finding(subject, PROBLEM if pools else WARNING, detail, f"{used}: no node takes jobs, none start")
    if away:
        names = ", ".join(f"{nodes} {state}" for state, _, nodes in away)
        return Finding(
            subject,
            WARNING,
            detail,
            f"{used}: {out} of {p.total_nodes} nodes take no jobs ({names}); jobs run on the others, "
            "and one that needs every node waits",
        )
    return Finding(subject, OK, detail, used)


def check_pool(f: SiteFacts, name: str, pool: Pool) -> Finding:
    """A site-config pool against the partition it names."""
    subject = f"pool {name}"
    p = f.partition(pool.partition)
    if p is None:
        return Finding(
            subject,
            PROBLEM,
            f"partition {pool.partition!r} does not exist",
            "trials in this pool are refused by sbatch: fix the pool's partition in the site config",
        )
    detail = f"partition {p.name}, {pool.slot_type} slots, {pool.slots_per_node} per node"
    if pool.slot_type == "gpu":
        gpus = f.gpus_per_node(p.name)
        if 0 < f.gpu_nodes(p.name) < p.total_nodes:
            detail += f"; {f.gpu_nodes(p.name)} of its {p.total_nodes} nodes have GPUs (GPU trials run only there)"
        if gpus == 0:
            return Finding(
                subject, PROBLEM, f"{detail}; the partition's nodes have no GPU GRES", "GPU trials never start"
            )
        if pool.slots_per_node > gpus:
            return Finding(
                subject,
                WARNING,
                f"{detail}; the nodes have {gpus} GPUs",
                f"a trial asking for {pool.slots_per_node} GPUs per node never starts: set slots_per_node {gpus}",
            )
    cpus = f.cpus_per_node(p.name)
    if pool.slot_type == "cpu" and 0 < cpus < pool.slots_per_node:
        return Finding(
            subject,
            WARNING,
            f"{detail}; the nodes have {cpus} CPUs",
            f"a trial asking for {pool.slots_per_node} CPUs per node never starts: set slots_per_node {cpus}",
        )
    # Slurm holds such a job forever (PartitionTimeLimit) unless EnforcePartLimits rejects it.
    if pool.time_limit_min and p.max_time_s is not None and pool.time_limit_min * 60 > p.max_time_s:
        return Finding(
            subject,
            PROBLEM,
            f"{detail}; time_limit_min {pool.time_limit_min} exceeds MaxTime {p.max_time_s // 60} min",
            "sbatch refuses (or holds) such jobs: lower time_limit_min",
        )
    if pool.account and not p.allows_account(pool.account):
        return Finding(subject, PROBLEM, f"{detail}; account {pool.account} is not allowed here", "sbatch refuses it")
    if pool.qos and not p.allows_qos(pool.qos):
        return Finding(subject, PROBLEM, f"{detail}; QOS {pool.qos} is not allowed here", "sbatch refuses it")
    return Finding(subject, OK, detail, "default pool" if name == f.site.default_pool else "")


def site_findings(f: SiteFacts) -> list[Finding]:
    """Every site-level finding, in the table's order."""
    out = [
        check_slurm(f),
        check_site_config(f),
        check_store(f),
        check_plugins(f),
        check_accounting(f),
        check_preemption(f),
        check_limits(f),
        check_rate_limit(f),
        check_user_top(f),
        check_polling(f),
        check_site_limits(f),
    ]
    out += [check_partition(f, p) for p in f.partitions]
    out += [check_pool(f, name, pool) for name, pool in sorted(f.site.pools.items())]
    return out
