"""One probe job per pool: what only a compute node can tell (shared dirs, scratch, Python,
detslurm, GPUs, container runtime), submitted through the Slurm client.

The login node makes a private probe dir in the experiments dir and in the checkpoint dir and
writes a random token into each; the job (``detslurm/exec/node_probe.py``, sent inside its
script) reads them back, leaves its own token, and writes its report into every probe dir. A
dir the nodes do not share never returns anything, so the job's exit code carries the same
verdict in bits (``scontrol show job`` keeps it for MinJobAge).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import stat
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Optional

from detslurm import settings
from detslurm.doctor.report import NodeReport, ReportError, clean, parse_report
from detslurm.slurm.client import SlurmClient, SlurmCommandError, SlurmUnavailable
from detslurm.slurm.render import SbatchRequest
from detslurm.slurm.site import Pool, SiteConfig

# Names the node probe uses too (detslurm/exec/node_probe.py runs without detslurm: it cannot
# import them, so tests/unit/doctor/test_doctor.py checks both sides agree).
LOGIN_TOKEN = "login-token"
EXIT_BASE = 32
PROBE_DIR = ".detslurm-doctor"
# A probe job's comment: not a trial's (parse_comment ignores it), so daemons leave it alone.
COMMENT = "detslurm:doctor"
_HEREDOC = "DET_NODE_PROBE_EOF"
# Long enough for a container runtime to pull a test image on a cold node.
JOB_TIME_MIN = 15


@dataclass(frozen=True)
class ProbeDir:
    """One shared dir under test: ``path`` is the probe's own subdir, made on the login node."""

    name: str  # "experiments" or "checkpoints"
    base: Path
    path: Path
    token: str


@dataclass(frozen=True)
class PoolProbe:
    """What happened to one pool's probe job."""

    pool: str
    partition: str
    slot_type: str
    job_id: Optional[str] = None
    state: str = ""  # Slurm's last word on the job ("COMPLETED", "PENDING", ...)
    reason: str = ""  # why it is pending, or why sbatch refused it
    exit_code: Optional[int] = None
    node: str = ""
    waited_s: float = 0.0
    submitted: bool = True
    timed_out: bool = False
    report: Optional[NodeReport] = None
    report_error: str = ""  # a report came back but is unusable (untrusted input)
    python_failure: str = ""  # the interpreter failed before the probe could report
    # Per probe dir: did the node's token come back to the login node?
    login_reads: tuple[tuple[str, bool], ...] = ()
    dirs: tuple[str, ...] = field(default=())  # the probe dirs' names, in the exit code's bit order
    bases: tuple[str, ...] = field(default=())  # the dirs under test (experiments dir, ...), same order


def file_key(pool: str) -> str:
    """The pool's name in the probe's file names: pool names are YAML keys (any text), file
    names must stay plain."""
    return hashlib.sha256(pool.encode()).hexdigest()[:12]


def node_probe_source() -> str:
    """The node probe's code, sent inside the script (the node may lack detslurm altogether)."""
    return resources.files("detslurm.exec").joinpath("node_probe.py").read_text()


def render_script(pool: str, site: SiteConfig, python: str, dirs: Sequence[ProbeDir], image: str) -> str:
    """The probe job's batch script (pure). Every value is quoted; the probe's config is one
    JSON argument; the site's setup lines run first, as they do before every trial."""
    source = node_probe_source()
    # The source travels in a quoted here-document (no expansion inside): only its end marker
    # could cut it short.
    if _HEREDOC in source:
        raise ValueError(f"the node probe's source contains its here-document end marker {_HEREDOC}")
    # Two bits per dir in an exit code of EXIT_BASE..EXIT_BASE+15: room for two dirs.
    if len(dirs) > 2:
        raise ValueError(f"the probe checks at most 2 shared dirs, not {len(dirs)}")
    config = {
        "pool": pool,
        "key": file_key(pool),
        "dirs": [{"name": d.name, "path": str(d.path), "token": d.token} for d in dirs],
        "runtime": site.container_runtime.value,
        "image": image,
    }
    fail_name = f"python-failed-{file_key(pool)}"
    # set -u as in the trial script, so setup lines behave here exactly as before a trial.
    lines = [
        "#!/bin/bash",
        f"# detslurm site doctor: probe for pool {json.dumps(pool)}",
        "set -u",
        *site.setup,
    ]
    if site.node_tmpdir:
        # The same node-local scratch a trial's launcher would use.
        lines.append(f'export {settings.NODE_TMPDIR.name}="{site.node_tmpdir}"')
    lines += [
        f"_det_py={shlex.quote(python)}",
        # stderr goes to a node-local file: the job's output is /dev/null (see probe_request).
        "_det_err=$(mktemp 2>/dev/null || echo /dev/null)",
        f'"$_det_py" - {shlex.quote(json.dumps(config))} 2>"$_det_err" <<\'{_HEREDOC}\'',
        source.rstrip("\n"),
        _HEREDOC,
        "rc=$?",
        # 0 or EXIT_BASE+bits: the probe ran and reported.
        f'if [ "$rc" = 0 ] || {{ [ "$rc" -ge {EXIT_BASE} ] && [ "$rc" -lt {EXIT_BASE + 16} ]; }}; then',
        '  rm -f "$_det_err"; exit "$rc"',
        "fi",
        "# The interpreter failed (missing, too old, broken): say how, in every dir we can reach.",
        '_det_msg="$("$_det_py" -V 2>&1 | head -c 300); $(tail -c 1000 "$_det_err" 2>/dev/null)"',
        *(
            f'printf "rc=%s\\n%s\\n" "$rc" "$_det_msg" > {shlex.quote(str(d.path / fail_name))} 2>/dev/null'
            for d in dirs
        ),
        'rm -f "$_det_err"',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def probe_request(
    pool_name: str, pool: Pool, site: SiteConfig, python: str, dirs: Sequence[ProbeDir], image: str
) -> SbatchRequest:
    """sbatch's options and script for one pool's probe (pure)."""
    # The name only helps people reading squeue: anything odd in a pool's name becomes "_".
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", pool_name)[:40]
    args = [
        f"--job-name=det-doctor-{slug}",
        f"--comment={COMMENT}",
        f"--partition={pool.partition}",
        "--nodes=1",
        "--ntasks=1",
        # Short, so backfill can start it in any gap; a pool's own shorter limit wins (MaxTime).
        f"--time={min(pool.time_limit_min or JOB_TIME_MIN, JOB_TIME_MIN)}",
        # The job's output file would need a dir the node can see, which is what is being tested.
        "--output=/dev/null",
        "--chdir=/",
        "--no-requeue",
    ]
    if pool.slot_type == "gpu":
        args.append(f"--gres={pool.gres_name}:1")
    if pool.account:
        args.append(f"--account={pool.account}")
    if pool.qos:
        args.append(f"--qos={pool.qos}")
    args += pool.extra_sbatch_args
    return SbatchRequest(
        name=f"det-doctor-{slug}", args=args, script=render_script(pool_name, site, python, dirs, image)
    )


def make_probe_dirs(bases: Sequence[tuple[str, Path]]) -> tuple[list[ProbeDir], list[tuple[str, Path, str]]]:
    """A fresh private probe dir with a login token in each base; the bases that failed, with why."""
    made: list[ProbeDir] = []
    failed: list[tuple[str, Path, str]] = []
    run = secrets.token_hex(6)
    for name, base in bases:
        try:
            # Private, as detslurm makes these bases for experiments and checkpoints itself.
            base.mkdir(parents=True, exist_ok=True, mode=0o700)
            (base / PROBE_DIR).mkdir(mode=0o700, exist_ok=True)
            # A base may be shared (a site's /scratch/checkpoints, mode 1777): there, another user
            # can pre-create PROBE_DIR, and as its owner rename our run dir away and put one of
            # theirs (with planted reports or symlinks) in its place. Only a dir of ours will do.
            _check_own_private(base / PROBE_DIR)
            path = base / PROBE_DIR / run
            path.mkdir(mode=0o700)  # exclusive: never a dir someone else made
            token = secrets.token_hex(16)
            _write_new(path / LOGIN_TOKEN, token)
            made.append(ProbeDir(name, base, path, token))
        except OSError as e:
            failed.append((name, base, e.strerror or str(e)))
    return made, failed


def _check_own_private(path: Path) -> None:
    """``path`` is a real dir (not a symlink) owned by us that no one else may write into;
    else OSError with a message that says what to do (the caller reports it as a failed base)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise OSError(errno.EPERM, f"{path} is not a private dir of yours (another user's?): remove it and rerun")


def _write_new(path: Path, text: str) -> None:
    # O_EXCL | O_NOFOLLOW: a file (or symlink) already there is never written through.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def remove_probe_dirs(dirs: Sequence[ProbeDir]) -> None:
    for d in dirs:
        shutil.rmtree(d.path, ignore_errors=True)


def _read_small(path: Path, limit: int) -> Optional[str]:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit + 1).decode(errors="replace")
    except OSError:
        return None


def collect(probe: PoolProbe, dirs: Sequence[ProbeDir]) -> PoolProbe:
    """Read what the job left in the probe dirs (all of it untrusted)."""
    report: Optional[NodeReport] = None
    error = failure = ""
    # The first dir with a report wins: every copy is the same, and any one that came back will do.
    for d in dirs:
        text = _read_small(d.path / f"report-{file_key(probe.pool)}.json", 256 * 1024)
        if text is not None and report is None:
            try:
                report = parse_report(text)
            except ReportError as e:
                error = str(e)
        failed = _read_small(d.path / f"python-failed-{file_key(probe.pool)}", 2000)
        if failed and not failure:
            failure = clean(failed)
    # The other direction: the node's token must be readable here, with the report's value.
    reads: list[tuple[str, bool]] = []
    for d in dirs:
        token = _read_small(d.path / f"node-{file_key(probe.pool)}.token", 200)
        reads.append((d.name, report is not None and token is not None and token.strip() == report.node_token))
    return replace(probe, report=report, report_error=error, python_failure=failure, login_reads=tuple(reads))


Clock = Callable[[], float]
Sleep = Callable[[float], None]


def run_probes(
    client: SlurmClient,
    site: SiteConfig,
    pools: Sequence[tuple[str, Pool]],
    dirs: Sequence[ProbeDir],
    *,
    python: str,
    image: str = "",
    timeout_s: float = 300.0,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> list[PoolProbe]:
    """Submit every pool's probe, wait (polling no faster than the site's floor) until each has
    ended or ``timeout_s`` passed, cancel what never started, and collect the reports."""
    names = tuple(d.name for d in dirs)
    bases = tuple(str(d.base) for d in dirs)
    probes: list[PoolProbe] = []
    for name, pool in pools:
        base = PoolProbe(name, pool.partition, pool.slot_type, dirs=names, bases=bases)
        try:
            req = probe_request(name, pool, site, python, dirs, image)
            job = client.sbatch(req.args, req.script)
            probes.append(replace(base, job_id=job, state="PENDING"))
        except SlurmCommandError as e:
            probes.append(replace(base, submitted=False, state="NOT SUBMITTED", reason=e.stderr or str(e)))
    try:
        probes = _wait(client, probes, site.poll_interval_s, timeout_s, clock, sleep)
    except BaseException:
        # Ctrl-C or a failing Slurm while waiting: the probe dirs are about to be removed, so
        # no probe may stay queued behind us (best effort: the error that got us here wins).
        submitted = [p.job_id for p in probes if p.job_id]
        if submitted:
            with contextlib.suppress(SlurmCommandError, SlurmUnavailable):
                client.scancel(submitted)
        raise
    return [collect(p, dirs) if p.submitted and not p.timed_out else p for p in probes]


def _wait(
    client: SlurmClient, probes: list[PoolProbe], poll_s: float, timeout_s: float, clock: Clock, sleep: Sleep
) -> list[PoolProbe]:
    start = clock()
    waiting = {p.job_id for p in probes if p.job_id}
    # The last state, reason and node squeue showed: what a timed-out probe is reported with.
    last: dict[str, tuple[str, str, str]] = {}
    while waiting and clock() - start < timeout_s:
        # The site's polling floor: the doctor must not load slurmctld more than a daemon does.
        sleep(poll_s)
        try:
            queue = {j.job_id: j for j in client.squeue() if j.job_id in waiting}
        except SlurmCommandError as e:
            if not e.unreachable:
                raise
            continue  # slurmctld busy or restarting: no news this round, the timeout still holds
        for job_id in list(waiting):
            job = queue.get(job_id)
            if job is not None:
                last[job_id] = (job.state_text, job.reason, job.nodelist)
            # Gone from squeue (MinJobAge passed already) counts as ended: show_job says how.
            if job is None or job.state.is_terminal:
                waiting.discard(job_id)
    waited = clock() - start
    if waiting:
        # Never leave a probe queued behind us: it would run later and write into removed dirs.
        client.scancel(sorted(waiting))
    out = []
    for p in probes:
        if not p.job_id:
            out.append(p)
            continue
        state, reason, node = last.get(p.job_id, (p.state, "", ""))
        if p.job_id in waiting:
            out.append(replace(p, state=state, reason=reason, waited_s=waited, timed_out=True))
            continue
        # scontrol keeps an ended job for MinJobAge with its exit code: the fallback channel.
        shown = client.show_job(p.job_id)
        code = _exit_code(shown.get("ExitCode", ""))
        out.append(
            replace(
                p,
                state=shown.get("JobState", state),
                reason=shown.get("Reason", reason),
                node=shown.get("NodeList", node),
                exit_code=code,
                waited_s=waited,
            )
        )
    return out


def _exit_code(text: str) -> Optional[int]:
    """``ExitCode=rc:signal`` from scontrol; None when absent or odd."""
    code, _, _ = text.partition(":")
    return int(code) if code.isdigit() else None


def dir_failures(exit_code: Optional[int], names: Sequence[str]) -> list[tuple[str, bool, bool]]:
    """Decode the probe's exit code: per dir, (name, login token not seen, not writable)."""
    if exit_code is None or not EXIT_BASE <= exit_code < EXIT_BASE + 16:
        return []
    bits = exit_code - EXIT_BASE
    return [
        (name, bool(bits & (1 << 2 * i)), bool(bits & (1 << (2 * i + 1))))
        for i, name in enumerate(names)
        if bits & (3 << 2 * i)
    ]


def default_python(site: SiteConfig) -> str:
    """The interpreter trials run with: the site's, else the one running this command (as the
    Slurm executor does: a venv's python, not its resolved target, keeps the venv)."""
    return site.python or sys.executable
