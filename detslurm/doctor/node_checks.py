"""Checks on what one pool's probe job found: pure functions from a :class:`PoolProbe` to findings."""

from __future__ import annotations

from dataclasses import replace

from detslurm.doctor.findings import Finding, Status
from detslurm.doctor.probe import PoolProbe, dir_failures
from detslurm.doctor.report import DirCheck, DirFacts, NodeReport, Scratch

OK, WARNING, PROBLEM = Status.OK, Status.WARNING, Status.PROBLEM

# detslurm's own floor (pyproject requires-python): a node with an older Python cannot run trials.
MIN_PYTHON = (3, 10)
# Below this, unpacking a context and a few DataLoader workers' temp files may fill the scratch.
MIN_SCRATCH_BYTES = 1 << 30
# Slurm's pending reasons that only mean "busy, wait": anything else will not fix itself.
_BUSY = ("Priority", "Resources", "None", "BeginTime", "Dependency", "JobArrayTaskLimit")

# What a healthy dir is used for (the action of an ok line).
_DIR_USE = {
    "experiments": "run dirs (events, logs, control files) go there",
    "checkpoints": "checkpoints are written there (private, renamed into place when complete)",
}
_DIR_ACTIONS = {
    "experiments": (
        "trials in this pool cannot run (their run dirs, events and control files live there): set "
        "experiments_dir / DETSLURM_EXPERIMENTS_DIR to a filesystem these nodes mount"
    ),
    "checkpoints": (
        "checkpoints written on these nodes would not reach the login node: set checkpoint_dir / "
        "DETSLURM_CHECKPOINT_DIR (or checkpoint_storage.host_path) to a filesystem these nodes mount"
    ),
}


def _subject(p: PoolProbe, what: str) -> str:
    return f"pool {p.pool}: {what}"


def _not_run(p: PoolProbe) -> list[Finding]:
    """The probe never ran: refused by sbatch, or still queued at the timeout."""
    if not p.submitted:
        return [
            Finding(
                _subject(p, "probe"), PROBLEM, f"sbatch refused the probe: {p.reason}", "trials would be refused too"
            )
        ]
    if p.timed_out:
        busy = p.reason in _BUSY or p.reason.startswith(("QOS", "Assoc"))
        return [
            Finding(
                _subject(p, "probe"),
                WARNING if busy else PROBLEM,
                f"job {p.job_id} did not start within {p.waited_s:.0f} s ({p.state}, reason {p.reason or 'none'})",
                "cancelled; "
                + ("the pool is busy, run the doctor again later" if busy else "trials would wait the same way"),
            )
        ]
    return []


def _without_report(p: PoolProbe) -> list[Finding]:
    """The job ended but no usable report came back: say what the exit code and files tell."""
    subject = _subject(p, "probe")
    where = f"job {p.job_id} on {p.node or '?'} ended {p.state}, exit code {p.exit_code}"
    bases = dict(zip(p.dirs, p.bases, strict=False))
    out = []
    for name, unseen, unwritable in dir_failures(p.exit_code, p.dirs):
        what = [
            w for w, bad in (("cannot see the login node's test file", unseen), ("cannot write", unwritable)) if bad
        ]
        out.append(
            Finding(
                _subject(p, f"{name} dir"),
                PROBLEM,
                f"{where}: in {bases.get(name, name)} the node {' and '.join(what)}",
                _DIR_ACTIONS.get(name, ""),
            )
        )
    if p.python_failure:
        out.append(
            Finding(
                _subject(p, "python"),
                PROBLEM,
                f"{where}: the interpreter failed before reporting: {p.python_failure}",
                "set `python` in the site config to a Python 3.10+ that exists on the nodes",
            )
        )
    if p.report_error:
        out.append(Finding(subject, PROBLEM, f"{where}: unusable report ({p.report_error})", "run the doctor again"))
    if not out and p.state not in ("COMPLETED", "FAILED"):
        # Cancelled, node failure, boot failure, time limit: the job ended before the probe could.
        out.append(
            Finding(
                subject,
                PROBLEM,
                f"{where}: the job ended before the probe could report",
                "run the doctor again; if it repeats, trials on these nodes would end the same way",
            )
        )
    if not out:
        out.append(
            Finding(
                subject,
                PROBLEM,
                f"{where}: no report reached the login node through any shared dir",
                "neither the experiments dir nor the checkpoint dir is shared with these nodes",
            )
        )
    return out


def check_dir(p: PoolProbe, d: DirCheck) -> Finding:
    # Both ways: a node may read the login node's file from a stale cache (NFS attribute caching)
    # yet write where the login node never looks; only the round trip proves one filesystem.
    came_back = dict(p.login_reads).get(d.name, False)
    subject = _subject(p, f"{d.name} dir")
    # Name the dir the user configured, not the probe's random subdir in it.
    path = dict(zip(p.dirs, p.bases, strict=False)).get(d.name, d.path)
    if d.seen and d.written and came_back:
        return Finding(subject, OK, f"{path}: shared with {p.node} both ways", _DIR_USE.get(d.name, ""))
    problems = [d.error] if d.error else []
    if d.written and not came_back:
        problems.append("the node's test file never reached the login node")
    return Finding(
        subject, PROBLEM, f"{p.node} sees {path} differently: {'; '.join(problems)}", _DIR_ACTIONS.get(d.name, "")
    )


def _describe(f: DirFacts) -> str:
    free = f", {f.free_bytes / (1 << 30):.1f} GiB free" if f.free_bytes is not None else ""
    return f"{f.path} ({'private' if f.private else 'shared'}{free})"


def check_scratch(p: PoolProbe, s: Scratch) -> Finding:
    subject = _subject(p, "node scratch")
    # The launcher's first two choices (exec/workdir.py): a per-job dir only we can enter.
    per_job = next((d for d in (s.slurm_tmpdir, s.tmpdir) if d.exists and d.private), None)
    detail = f"per-job private tmp: {_describe(per_job)}" if per_job else "no per-job private tmp"
    if s.chosen is None:
        return Finding(
            subject, WARNING, detail, "unknown which base the launcher picks: detslurm is not importable there"
        )
    detail += f"; trials unpack their code under {_describe(s.chosen)}"
    action = "a fresh 0700 dir per launcher" + ("" if s.chosen.private else " (the sticky bit keeps it ours)")
    if s.chosen.free_bytes is not None and s.chosen.free_bytes < MIN_SCRATCH_BYTES:
        return Finding(subject, WARNING, detail, f"{action}; little room: set node_tmpdir to a bigger local disk")
    return Finding(subject, OK, detail, action)


def check_python(p: PoolProbe, r: NodeReport, login_version: str) -> list[Finding]:
    # Text from the node: a version we cannot read counts as too old rather than failing the doctor.
    parts = r.python_version.split(".")
    try:
        version = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        version = (0, 0)
    py = Finding(
        _subject(p, "python"),
        OK,
        f"{r.python_version} ({r.python_executable})",
        "trials run `python -m detslurm.exec.launch` with it",
    )
    if version < MIN_PYTHON:
        py = Finding(py.subject, PROBLEM, py.detail, "detslurm needs Python 3.10+: set `python` in the site config")
    subject = _subject(p, "detslurm")
    if r.detslurm_version is None:
        det = Finding(
            subject,
            PROBLEM,
            f"not importable with {r.python_executable}: {r.detslurm_error}",
            "trials run `python -m detslurm.exec.launch` there: install detslurm where the nodes see it, "
            "or set `python` in the site config",
        )
    elif r.detslurm_version != login_version:
        det = Finding(
            subject,
            WARNING,
            f"{r.detslurm_version} on the node, {login_version} here",
            "trials run the node's version: keep them equal (one install on a shared filesystem)",
        )
    else:
        det = Finding(subject, OK, f"{r.detslurm_version}, same as here", "")
    return [py, det]


def check_gpus(p: PoolProbe, r: NodeReport) -> Finding:
    """Only for GPU pools: the probe asked for one GPU; is it visible, and to what?"""
    g = r.gpus
    subject = _subject(p, "GPUs")
    assigned = f"CUDA_VISIBLE_DEVICES={g.cuda_visible_devices}" if g.cuda_visible_devices else "no CUDA_VISIBLE_DEVICES"
    # nvidia-smi lists what the driver sees (the job's cgroup may narrow it to the assigned GPU).
    if g.nvidia_smi:
        return Finding(subject, OK, f"{assigned}; nvidia-smi: {'; '.join(g.nvidia_smi)}", "")
    if g.cuda_visible_devices:
        return Finding(
            subject,
            WARNING,
            f"{assigned} (Slurm assigned GPU {g.slurm_job_gpus or '?'}), "
            f"but {g.nvidia_smi_error or 'nvidia-smi lists no GPUs'}",
            "trials get the GPUs Slurm assigns; no driver could confirm them",
        )
    return Finding(
        subject,
        PROBLEM,
        f"{assigned}; {g.nvidia_smi_error or 'nvidia-smi lists no GPUs'}",
        "GPU trials would see no GPU",
    )


def check_container(p: PoolProbe, r: NodeReport) -> Finding:
    c = r.container
    subject = _subject(p, "containers")
    if c.runtime == "none":
        return Finding(subject, OK, "container_runtime none", "environment.image is not used")
    if c.version is None:
        return Finding(subject, PROBLEM, f"{c.runtime}: {c.error}", "experiments with environment.image fail here")
    if not c.image:
        return Finding(subject, OK, f"{c.runtime}: {c.version}", "no test image named (det site doctor --image IMAGE)")
    if c.image_ok:
        return Finding(subject, OK, f"{c.runtime}: {c.version}; ran {c.image}", "")
    return Finding(
        subject, PROBLEM, f"{c.runtime}: {c.version}; {c.image} failed: {c.image_error}", "this image cannot run here"
    )


def pool_findings(p: PoolProbe, login_version: str) -> list[Finding]:
    """Every finding for one pool's probe, in the table's order."""
    # A probe that never ran says nothing about the nodes: one line says why, nothing else.
    not_run = _not_run(p)
    if not_run:
        return not_run
    r = p.report
    if r is None:
        return _without_report(p)
    # scontrol forgets a job after MinJobAge; the report still knows where it ran.
    p = replace(p, node=p.node or r.node)
    ended = f"ended {p.state}" + (f" (exit code {p.exit_code}: see below)" if p.exit_code else "")
    out = [Finding(_subject(p, "node"), OK, f"probe job {p.job_id} ran on {r.node} and {ended}", "")]
    # The login side's list decides which dirs are judged; a report may not add or drop any.
    reported = {d.name: d for d in r.dirs}
    for name, base in zip(p.dirs, p.bases, strict=False):
        d = reported.get(name)
        if d is None:
            out.append(Finding(_subject(p, f"{name} dir"), PROBLEM, f"the report says nothing about {base}", ""))
        else:
            out.append(check_dir(p, d))
    out.append(check_scratch(p, r.scratch))
    out += check_python(p, r, login_version)
    if p.slot_type == "gpu":
        out.append(check_gpus(p, r))
    out.append(check_container(p, r))
    return out
