"""Pure parsers for Slurm command output (tested on output captured from a real 22.05)."""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Optional

import hostlist

from detslurm.errors import DetSlurmError
from detslurm.slurm.states import SlurmState, state_from_slurm

log = logging.getLogger("detslurm.slurm")

# Field and record separators. A job's name and comment are free text that sbatch accepts with
# newlines and control characters in them (checked on 22.05: --comment=$'a\nb' is queued and
# printed verbatim), so a newline cannot end a record: every record ends with REC_END, and a
# record whose field count is wrong (a name or comment holding SEP) is skipped, never guessed.
SEP = "\x1f"
REC_END = "\x1e"
# The fields of the daemon's one squeue per tick, as ``squeue -O`` names them. ``-O`` because the
# restart count (how often Slurm requeued the job) has no ``-o`` letter; each is printed in full
# (width 0) and followed by SEP, the last by REC_END, so records look as they did with ``-o``
# (%i %A %F %K %T %P %u %Q %r %N %D %C %b %V %S %l %y %j %k, same order, checked to print the
# same on 22.05). Records captured before RestartCnt was added have one field less.
SQUEUE_FIELDS = [
    "JobArrayID",
    "JobID",
    "ArrayJobID",
    "ArrayTaskID",
    "State",
    "Partition",
    "UserName",
    "PriorityLong",
    "Reason",
    "NodeList",
    "NumNodes",
    "NumCPUs",
    "tres-per-node",
    "SubmitTime",
    "StartTime",
    "TimeLimit",
    "Nice",
    "Name",
    "Comment",
    "RestartCnt",
]
SQUEUE_FORMAT = ",".join(f"{name}:0{SEP}" for name in SQUEUE_FIELDS[:-1]) + f",{SQUEUE_FIELDS[-1]}:0{REC_END}"


class SlurmParseError(DetSlurmError):
    def __init__(self, what: str, text: str) -> None:
        self.text = text
        super().__init__(f"cannot parse {what} output: {text[:200]!r}")


@dataclass(frozen=True)
class QueuedJob:
    """One line of ``squeue -r``: a job, or one task of an array."""

    job_id: str  # "12" or "12_3"
    raw_id: int
    array_job_id: int
    array_task_id: Optional[int]
    state: SlurmState
    state_text: str
    partition: str
    user: str
    priority: int
    reason: str
    nodelist: str
    num_nodes: int
    num_cpus: int
    gres: str
    submit_time: str
    start_time: str
    time_limit: str
    nice: int
    name: str
    comment: str
    # How many times Slurm put the job back in the queue after it had started (``scontrol
    # requeue``, preemption on a PreemptMode=REQUEUE partition, a node failure).
    restarts: int = 0

    @property
    def requeued(self) -> bool:
        """Slurm requeued this job at least once: the start it is waiting for (or running) is
        not the one that was submitted."""
        return self.restarts > 0

    # Cached (in the instance's __dict__, which a frozen dataclass allows): `det job list` asks
    # each of 2000 jobs for its identity four times, and parsed records are shared between ticks.
    @functools.cached_property
    def identity(self) -> Optional[tuple[int, int, int]]:
        """(experiment, trial, run) when this is one of our trial runs."""
        return parse_comment(self.comment, self.array_task_id)

    @property
    def gpus(self) -> int:
        m = _GRES_GPUS.search(self.gres)
        return int(m.group(1)) * max(1, self.num_nodes) if m else 0


_GRES_GPUS = re.compile(r"gpu(?::[^:,]+)?:(\d+)")


def _int(text: str, default: int = 0) -> int:
    try:
        return int(text)
    except ValueError:
        return default


def _squeue_records(text: str) -> list[str]:
    """Records of squeue output: ended by REC_END (our format), or by newlines in output
    captured before the format had an end marker."""
    if REC_END not in text:
        return [line for line in text.splitlines() if line.strip()]
    return [r.strip("\n") for r in text.split(REC_END) if r.strip("\n").strip()]


def _queued_job(f: list[str]) -> QueuedJob:
    return QueuedJob(
        job_id=f[0],
        raw_id=int(f[1]),
        array_job_id=_int(f[2]),
        array_task_id=_int(f[3]) if f[3].isdigit() else None,
        state=state_from_slurm(f[4]),
        state_text=f[4],
        partition=f[5],
        user=f[6],
        priority=_int(f[7]),
        reason=f[8],
        nodelist=f[9],
        num_nodes=_int(f[10], 1),
        num_cpus=_int(f[11], 1),
        gres="" if f[12] == "N/A" else f[12],
        submit_time=f[13],
        start_time=f[14],
        time_limit=f[15],
        nice=_int(f[16]),
        name=f[17],
        comment="" if f[18] == "(null)" else f[18],
        # Absent from records captured before the field was added: never requeued, as then.
        restarts=_int(f[19]) if len(f) > 19 else 0,
    )


def parse_squeue_counted(text: str) -> tuple[list[QueuedJob], int]:
    """The jobs of ``squeue -O SQUEUE_FORMAT`` output, and how many records were skipped.

    A record is skipped when it has the wrong number of fields (a name or comment containing
    SEP: which SEP splits them cannot be known) or a job id that is not a number. One odd job
    must never hide the others, nor fail the daemon's tick. Output with no SEP at all is not
    squeue's answer in our format (a wrapper printing something else): that raises, because
    reading it as "no jobs" would declare every running job lost."""
    jobs: list[QueuedJob] = []
    skipped = 0
    records = _squeue_records(text)
    for record in records:
        job = _squeue_record(record)
        if job is None:
            skipped += 1
        else:
            jobs.append(job)
    if records and not jobs and not any(SEP in r for r in records):
        raise SlurmParseError("squeue", text)
    return jobs, skipped


# The daemon asks squeue every tick, and most records are the same as last time (a held or
# running job's line does not change): a record already parsed costs a dict lookup. QueuedJob
# is frozen, so sharing one between answers is safe; the bound keeps memory flat.
@functools.lru_cache(maxsize=1 << 15)
def _squeue_record(record: str) -> Optional[QueuedJob]:
    """One record as a job, or None when it does not parse (see parse_squeue_counted)."""
    f = record.split(SEP)
    if len(f) not in (len(SQUEUE_FIELDS), len(SQUEUE_FIELDS) - 1) or not _JOB_ID.fullmatch(f[0]):
        return None
    try:
        return _queued_job(f)
    except ValueError:
        return None


_JOB_ID = re.compile(r"\d+(_\d+)?|\d+_\[[^\]]*\]")


def parse_squeue(text: str) -> list[QueuedJob]:
    """The jobs of squeue's output; records that do not parse are skipped and logged."""
    jobs, skipped = parse_squeue_counted(text)
    if skipped:
        log.warning("squeue: skipped %d job record(s) that do not parse (a control character in a name?)", skipped)
    return jobs


def parse_sbatch(text: str) -> str:
    """``sbatch --parsable`` prints ``ID`` or ``ID;CLUSTER``."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    job = first.split(";")[0]
    if not job.isdigit():
        raise SlurmParseError("sbatch --parsable", text)
    return job


def parse_key_values(text: str) -> dict[str, str]:
    """``scontrol show job -o`` / ``show config``: ``Key=Value`` pairs (values may hold spaces
    only in show config, where each line is one pair)."""
    out: dict[str, str] = {}
    if "\n" in text.strip() and " = " in text:  # show config: "Key  = Value" per line
        for line in text.splitlines():
            k, sep, v = line.partition("=")
            if sep and k.strip() and not k.startswith(" "):
                out[k.strip()] = v.strip()
        return out
    for m in re.finditer(r"(\S+?)=(\S*)", text):
        out.setdefault(m.group(1), m.group(2))
    return out


@dataclass(frozen=True)
class Capabilities:
    """What ``scontrol show config`` says about the site, probed once per client. Everything
    here is read from the controller's own answer, never guessed from the version string."""

    version: str
    accounting: bool
    enable_user_top: bool
    preemption: bool
    max_array_size: int
    cluster_name: str
    slurm_user: str = "root"
    # Seconds between the SIGTERM of a job's end (time limit, preemption, scancel) and SIGKILL:
    # the whole window a trial has to finish its checkpoint when no GraceTime applies.
    kill_wait_s: int = 30
    preempt_mode: str = "OFF"
    max_job_count: int = 10000
    message_timeout_s: int = 10
    # Slurm 23.02+ can rate-limit each user's RPCs (SlurmctldParameters=rl_enable).
    rate_limited: bool = False
    # Seconds a finished job stays visible in squeue: without accounting, the only window in
    # which detslurm can read how a run ended.
    min_job_age_s: int = 300
    # The plugins that decide how jobs are placed, tracked and confined (`det site doctor` shows
    # them; "" where the config does not name one).
    plugins: Plugins = field(default_factory=lambda: Plugins())


@dataclass(frozen=True)
class Plugins:
    """The site's plugin choices, as ``scontrol show config`` names them."""

    select: str = ""  # select/cons_tres places GPUs per job; select/linear gives whole nodes
    select_params: str = ""
    proctrack: str = ""  # proctrack/cgroup: Slurm cleans up every process of a job
    task: str = ""  # task/cgroup,task/affinity: confinement to the allocated CPUs/GPUs
    switch: str = ""
    mpi_default: str = ""
    job_acct_gather: str = ""
    job_container: str = ""  # job_container/tmpfs: a private /tmp per job
    gres_types: str = ""
    preempt_type: str = ""
    scheduler: str = ""


def _plugin(kv: dict[str, str], key: str) -> str:
    value = kv.get(key, "")
    # Slurm prints "(null)" or "(null type)" for an unset plugin.
    return "" if value.startswith("(null") else value


def _plugins(kv: dict[str, str]) -> Plugins:
    return Plugins(
        select=_plugin(kv, "SelectType"),
        select_params=_plugin(kv, "SelectTypeParameters"),
        proctrack=_plugin(kv, "ProctrackType"),
        task=_plugin(kv, "TaskPlugin"),
        switch=_plugin(kv, "SwitchType"),
        mpi_default=_plugin(kv, "MpiDefault"),
        job_acct_gather=_plugin(kv, "JobAcctGatherType"),
        job_container=_plugin(kv, "JobContainerType"),
        gres_types=_plugin(kv, "GresTypes"),
        preempt_type=_plugin(kv, "PreemptType"),
        scheduler=_plugin(kv, "SchedulerType"),
    )


def parse_config(text: str) -> Capabilities:
    kv = parse_key_values(text)
    if "SLURM_VERSION" not in kv:
        raise SlurmParseError("scontrol show config", text)
    return Capabilities(
        version=kv["SLURM_VERSION"],
        accounting=kv.get("AccountingStorageType", "") not in ("", "(null)", "accounting_storage/none"),
        enable_user_top="enable_user_top" in kv.get("SchedulerParameters", ""),
        preemption=kv.get("PreemptType", "preempt/none") != "preempt/none",
        max_array_size=_int(kv.get("MaxArraySize", "1001"), 1001),
        cluster_name=kv.get("ClusterName", ""),
        slurm_user=kv.get("SlurmUser", "root").split("(")[0],
        kill_wait_s=_int(kv.get("KillWait", "30").split()[0], 30),
        preempt_mode=kv.get("PreemptMode", "OFF"),
        max_job_count=_int(kv.get("MaxJobCount", "10000"), 10000),
        message_timeout_s=_int(kv.get("MessageTimeout", "10").split()[0], 10),
        rate_limited="rl_enable" in kv.get("SlurmctldParameters", "").split(","),
        min_job_age_s=_int(kv.get("MinJobAge", "300").split()[0], 300),
        plugins=_plugins(kv),
    )


@dataclass(frozen=True)
class PartitionNodes:
    partition: str
    default: bool
    available: str
    nodes: int
    state: str
    nodelist: str
    cpus_alloc: int
    cpus_idle: int
    cpus_total: int
    gres: str
    time_limit: str

    @property
    def gpus_per_node(self) -> int:
        m = re.search(r"gpu(?::[^:,()]+)?:(\d+)", self.gres)
        return int(m.group(1)) if m else 0


SINFO_FORMAT = SEP.join(["%R", "%P", "%a", "%D", "%T", "%N", "%C", "%G", "%l"])


def parse_sinfo(text: str) -> list[PartitionNodes]:
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        f = line.split(SEP)
        if len(f) != 9:
            raise SlurmParseError("sinfo", line)
        alloc, idle, _other, total = (f[6].split("/") + ["0"] * 4)[:4]
        out.append(
            PartitionNodes(
                partition=f[0],
                default=f[1].endswith("*"),
                available=f[2],
                nodes=_int(f[3]),
                state=f[4],
                nodelist=f[5],
                cpus_alloc=_int(alloc),
                cpus_idle=_int(idle),
                cpus_total=_int(total),
                gres="" if f[7] == "(null)" else f[7],
                time_limit=f[8],
            )
        )
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """``c[1-2],g1`` -> ``["c1", "c2", "g1"]`` (python-hostlist; the order Slurm uses)."""
    if not nodelist or nodelist in ("(null)", "None"):
        return []
    try:
        result: list[str] = hostlist.expand_hostlist(nodelist)
        return result
    except hostlist.BadHostlist as e:
        raise SlurmParseError("node list", nodelist) from e


COMMENT_RE = re.compile(r"^detslurm:exp=(\d+),trial=(\d+)(\+?),run=(\d+)(?:,tag=([0-9a-f]+))?$")


def trial_comment(exp_id: int, trial_id: int, run_id: int, tag: str = "", array: bool = False) -> str:
    """The job's identity. ``tag`` is unique to the experiment's dir, so two stores of one user
    (or a store reset to id 1) never mistake each other's jobs for their own. An array's tasks
    share one comment: ``trial=N+`` says task T runs trial N+T, so every task keeps its identity."""
    base = f"detslurm:exp={exp_id},trial={trial_id}{'+' if array else ''},run={run_id}"
    return f"{base},tag={tag}" if tag else base


def experiment_tag(exp_dir: str) -> str:
    import hashlib

    return hashlib.sha256(exp_dir.encode()).hexdigest()[:10]


def comment_tag(comment: str) -> str:
    """The experiment-dir tag of one of our job comments ("" when it has none)."""
    m = COMMENT_RE.match(comment.strip())
    return (m.group(5) or "") if m else ""


def parse_comment(comment: str, array_task_id: Optional[int] = None) -> Optional[tuple[int, int, int]]:
    """(experiment, trial, run) of one of our jobs, or of one task of our arrays."""
    m = COMMENT_RE.match(comment.strip())
    if not m:
        return None
    trial = int(m.group(2))
    if m.group(3):
        if array_task_id is None:
            return None  # the array's own record (not expanded): no single trial
        trial += array_task_id
    return (int(m.group(1)), trial, int(m.group(4)))


@dataclass(frozen=True)
class NodeInfo:
    name: str
    partitions: tuple[str, ...]
    state: str
    cpus: int
    alloc_cpus: int
    gpus: int
    gpus_used: int


def _gres_count(text: str) -> int:
    total = 0
    for part in (text or "").split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", part.strip())
        if m:
            total += int(m.group(1))
    return total


def json_lists_nodes(text: str) -> bool:
    """Whether ``sinfo --json`` answered with one record per node (22.05: ``{"nodes": [...]}``).

    From 23.02 on (the data_parser plugins) it answers ``{"sinfo": [...]}`` instead: groups of
    nodes that share a partition and a state, with CPU and GPU counts summed over the group, so
    per-node use must come from ``scontrol show nodes --json``. The answer itself says which
    shape it is: this probe never looks at a version number."""
    import json

    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("nodes"), list)


def _node_state(n: dict[str, object]) -> str:
    """22.05 prints ``"state": "idle"`` plus ``state_flags``; 23.02+ a list (``["IDLE", "DRAIN"]``).
    Both become sinfo's own spelling, ``idle+drain``."""
    state = n.get("state", "unknown")
    words = [state] if isinstance(state, str) else list(state) if isinstance(state, list) else ["unknown"]
    flags = n.get("state_flags")
    words += list(flags) if isinstance(flags, list) else []
    return "+".join(str(w).lower() for w in words)


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    """Node records of ``sinfo --json`` (22.05) or ``scontrol show nodes --json`` (23.02+,
    the same fields): every node's partitions, state, CPUs and GPUs in use."""
    import json

    try:
        data = json.loads(text)
        nodes = data["nodes"]
    except (ValueError, KeyError, TypeError) as e:
        raise SlurmParseError("node list (--json)", text) from e
    out = []
    for n in nodes:
        out.append(
            NodeInfo(
                name=str(n["name"]),
                partitions=tuple(n.get("partitions") or ()),
                state=_node_state(n),
                cpus=int(n.get("cpus", 0)),
                alloc_cpus=int(n.get("alloc_cpus", 0)),
                gpus=_gres_count(str(n.get("gres", ""))),
                gpus_used=_gres_count(str(n.get("gres_used", ""))),
            )
        )
    return out


# JobID last: for an array task it is ARRAY_TASK ("12_3"), the id the executor stores, while
# JobIDRaw is the task's own number. Output without it (older captures) still parses.
SACCT_FIELDS = "JobIDRaw,State,ExitCode,Reason,Start,End,JobID"


@dataclass(frozen=True)
class AccountedJob:
    job_id: str
    state: SlurmState
    exit_code: Optional[int]
    signal: Optional[int]


def parse_sacct(text: str) -> dict[str, AccountedJob]:
    """``sacct -n -P -X -o SACCT_FIELDS``, keyed by raw id and, for array tasks, also by
    ``ARRAY_TASK``; ExitCode is ``code:signal``. A line that does not parse is skipped: sacct
    only adds detail to jobs that left the queue, it must never fail a tick."""
    out: dict[str, AccountedJob] = {}
    for line in text.splitlines():
        f = line.split("|")
        if len(f) < 3 or not f[0].strip().isdigit():
            if line.strip():
                log.warning("sacct: skipped a line that does not parse: %r", line[:200])
            continue
        code, _, sig = f[2].partition(":")
        job = AccountedJob(
            job_id=f[0],
            state=state_from_slurm(f[1]),
            exit_code=int(code) if code.isdigit() else None,
            signal=int(sig) if sig.isdigit() and sig != "0" else None,
        )
        out[f[0]] = job
        if len(f) > 6 and re.fullmatch(r"\d+_\d+", f[6]):
            out[f[6]] = job
    return out
