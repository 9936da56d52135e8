"""What a failed end-to-end test leaves behind, in a few lines: every trial run's end as the
store recorded it, the last lines of the logs of runs that did not complete, and the cluster's
nodes that take no jobs. conftest.py prints it with the failure under CI, where the run dirs
are gone once the box ends and only the printed output tells why an experiment ended in ERROR."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

LOG_LINES = 4  # per run that did not complete
WIDTH = 220  # characters per line: a rank's traceback line, not a whole tensor dump
MAX_RUNS = 8


def story() -> list[str]:
    """Best effort: a test that failed before it made a store gets the nodes' states only."""
    lines: list[str] = []
    try:
        lines += _runs()
    except Exception as e:  # the store may not exist or be mid-migration: say so, go on
        lines.append(f"store: not readable ({type(e).__name__}: {e})")
    lines += _nodes()
    return [line[:WIDTH] for line in lines]


def _runs() -> list[str]:
    from sqlalchemy import make_url, select

    from detslurm import settings
    from detslurm.store import Trial, open_store

    s = settings.load()
    url = make_url(s.db_url)
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").exists():
        return []  # the test failed before anything made the store: opening it would make one
    out: list[str] = []
    with open_store(s.db_url).tx() as ses:
        trials = list(ses.scalars(select(Trial).order_by(Trial.id)))
        runs = [(t, r) for t in trials for r in t.runs]
        for t, r in runs[-MAX_RUNS:]:
            out.append(
                f"trial {t.id} ({t.state.value}, restarts {t.restarts}) run {r.run_id} job {r.job_id}: "
                f"{r.state.value} exit {r.exit_code} ({r.exit_reason}) acked={r.preempt_acked}"
            )
            if r.exit_code != 0:  # failed, killed, or still going: what its ranks said last
                out += [f"  | {line}" for line in _tail(Path(r.log_path))]
    return out


def _tail(log: Path) -> list[str]:
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-LOG_LINES:]


def _nodes() -> list[str]:
    if not os.environ.get("SLURM_CONF"):
        return []
    try:
        nodes = node_states()
    except (OSError, subprocess.TimeoutExpired):
        return []
    shown = (
        f"{name} {state} ({reason})" if reason and reason != "none" else f"{name} {state}"
        for name, (state, reason) in nodes.items()
    )
    return [f"nodes: {', '.join(shown)}"] if nodes else []


def node_states() -> dict[str, tuple[str, str]]:
    """Every node of the cluster (SLURM_CONF): its short state (sinfo's %t) and Slurm's reason.
    sinfo -N lists a node once per partition it is in: once here."""
    res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t %E"], capture_output=True, text=True, timeout=10)
    out: dict[str, tuple[str, str]] = {}
    for line in res.stdout.splitlines():
        name, state, reason = (line.split(" ", 2) + ["", ""])[:3]
        out[name] = (state, reason.strip())
    return out
