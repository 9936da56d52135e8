"""Two Unix users share one PostgreSQL store (docs/design/security.md): neither sees, changes nor
ticks the other's experiments.

The victim ("alice") is this test process (root), running the CLI in-process; the attacker is
the system user detslurm-mallory running a real `det` from a venv every user can execute
(security_harness.shared_det). Both use the same database URL, as two users of a site's shared
PostgreSQL would.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT
from security_harness import Attacker, run_as, shared_det
from sqlalchemy import create_engine, select, text
from test_views_ops import add_experiment, add_trial

from detslurm.identity import os_user
from detslurm.store import Experiment, LogEntry, Store, Trial, TrialRun, open_store

pytestmark = pytest.mark.security
CORE = EXAMPLES / "core_api"
_DB_NAMES = count()


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    from pg_harness import PostgresUnavailable, private_postgres

    try:
        with private_postgres() as url:
            yield url
    except PostgresUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def shared_url(pg_server: str, monkeypatch: pytest.MonkeyPatch, det_env: Path) -> str:
    """A fresh database on the shared server, used by this test's alice (in-process)."""
    name = f"users_{os.getpid()}_{next(_DB_NAMES)}"
    admin = create_engine(pg_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = pg_server.rsplit("/", 1)[0] + "/" + name
    monkeypatch.setenv("DETSLURM_DB_URL", url)
    return url


@pytest.fixture(scope="module")
def mallory_det(mallory: Attacker) -> Path:
    det_bin = shared_det(ROOT)
    r = run_as(mallory.user, [str(det_bin), "--version"], cwd=str(mallory.home))
    if r.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"{mallory.user.pw_name} cannot run {det_bin}: {r.stderr}")
        pytest.skip(f"{mallory.user.pw_name} cannot run {det_bin} (is the checkout under a private dir?)")
    return det_bin


class Mallory:
    """Runs `det` as the second user, against the shared database, from its own dirs."""

    def __init__(self, attacker: Attacker, det_bin: Path, url: str) -> None:
        self.attacker, self.det_bin, self.url = attacker, det_bin, url
        self.home = attacker.home

    def __call__(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        base = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": str(self.home),
            "DETSLURM_DB_URL": self.url,
            "DETSLURM_DATA_DIR": str(self.home / "data"),
            "DETSLURM_EXPERIMENTS_DIR": str(self.home / "exps"),
            "DETSLURM_CHECKPOINT_DIR": str(self.home / "ckpts"),
            "DETSLURM_CONFIG": str(self.home / "no-config.yaml"),
        }
        argv = [str(self.det_bin), *map(str, args)]
        # A guard against a hang, not a timing: one `det e create` as this user took over 120 s on
        # CI's loaded 2-core machine (load 22, 2026-11-27).
        return run_as(self.attacker.user, argv, env={**base, **(env or {})}, cwd=str(self.home), timeout=600)


@pytest.fixture
def as_mallory(mallory: Attacker, mallory_det: Path, shared_url: str) -> Mallory:
    for sub in ("data", "exps", "ckpts"):
        (mallory.home / sub).mkdir(exist_ok=True)
        os.chown(mallory.home / sub, mallory.uid, mallory.user.pw_gid)
    return Mallory(mallory, mallory_det, shared_url)


@contextmanager
def shared_store(url: str) -> Iterator[Store]:
    store = open_store(url)
    try:
        yield store
    finally:
        store.dispose()


def snapshot(url: str) -> dict[str, Any]:
    """Every row a tick or an operation could change."""
    with shared_store(url) as store, store.read() as s:
        return {
            "experiments": [(e.id, e.owner, e.state, e.resource_pool, e.config) for e in s.scalars(select(Experiment))],
            "trials": [(t.id, t.state, t.restarts, t.run_count) for t in s.scalars(select(Trial))],
            "runs": [(r.id, r.state, r.job_id, r.exit_reason) for r in s.scalars(select(TrialRun))],
            "notes": len(s.scalars(select(LogEntry.id)).all()),
        }


def _alice_experiments(det: Any, url: str, tmp_path: Path) -> tuple[int, int, int]:
    """Alice's paused local experiment, and her Slurm experiment with a queued run (job 999999,
    which no squeue shows: a foreign tick would call it lost and resubmit it). Returns the
    experiment ids and the trial id."""
    code, out, err = det("e", "create", "--local", "--paused", CORE / "const.yaml", CORE)
    assert code == 0, out + err
    with shared_store(url) as store:
        slurm_exp = add_experiment(store, tmp_path / "alice-slurm", owner=os_user())
        trial = add_trial(store, slurm_exp, tmp_path / "alice-slurm/trials/1/runs/1", "QUEUED")
        with store.tx() as s:
            s.scalars(select(TrialRun).where(TrialRun.trial_id == trial)).one().job_id = "999999"
    return 1, slurm_exp, trial


@pytest.mark.heavy  # about 25 commands as the second user: 11 min on a loaded 2-core machine
def test_other_users_experiments_are_not_found_and_never_ticked(
    det: Any, shared_url: str, as_mallory: Mallory, tmp_path: Path
) -> None:
    local_exp, slurm_exp, alice_trial = _alice_experiments(det, shared_url, tmp_path)
    r = as_mallory("e", "create", "--local", "--paused", CORE / "const.yaml", CORE)
    assert r.returncode == 0, r.stderr
    mine = int(r.stdout.split("Created experiment ")[1].split()[0])
    # Mallory's own experiment counts as an unfinished Slurm one: her read commands then really
    # reconcile (a tick, as her) on every call.
    with shared_store(shared_url) as store, store.tx() as s:
        s.get(Experiment, mine).executor = "slurm"  # type: ignore[union-attr]
    before = snapshot(shared_url)

    r = as_mallory("e", "list", "--json")
    assert r.returncode == 0, r.stderr
    assert [e["id"] for e in json.loads(r.stdout)] == [mine]
    assert (as_mallory.home / "data/daemon.lock").exists()  # the read did reconcile, as mallory
    r = as_mallory("e", "list")
    assert r.returncode == 0 and "detslurm-mallory" in r.stdout and "root" not in r.stdout, r.stdout

    attempts = [
        ("e", "describe", local_exp),
        ("e", "config", local_exp),
        ("e", "list-trials", slurm_exp),
        ("e", "list-checkpoints", slurm_exp),
        ("e", "logs", slurm_exp),
        ("e", "kill", local_exp),
        ("e", "kill", slurm_exp),
        ("e", "pause", slurm_exp),
        ("e", "cancel", slurm_exp),
        ("e", "activate", local_exp),
        ("e", "delete", "--yes", local_exp),
        ("e", "wait", slurm_exp),
        ("checkpoint", "list", slurm_exp),
    ]
    for args in attempts:
        r = as_mallory(*args)
        assert r.returncode == 1 and f"Error: experiment {args[-1]} not found" in r.stderr, (args, r.stderr)
    trial_cmds = [("describe",), ("logs",), ("logs", "-f"), ("logs", "--tail", "3"), ("kill",)]
    for args in [("t", *cmd, alice_trial) for cmd in trial_cmds]:
        r = as_mallory(*args)
        assert r.returncode == 1 and f"Error: trial {alice_trial} not found" in r.stderr, (args, r.stderr)
    # Names in the environment are not identities: the uid decides.
    forged = {"LOGNAME": os_user(), "USER": os_user()}
    r = as_mallory("e", "kill", local_exp, env=forged)
    assert r.returncode == 1 and f"experiment {local_exp} not found" in r.stderr
    r = as_mallory("--all-users", "e", "list", env=forged)
    assert r.returncode == 1 and "--all-users is only for root" in r.stderr
    # A missing experiment reads the same as another user's: ids in use are not leaked.
    r = as_mallory("e", "describe", 99)
    # (Her own experiment's tick may fail before it, in a line of its own: she has no Slurm here.)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == "Error: experiment 99 not found"

    assert snapshot(shared_url) == before
    assert [p for p in Path(os.environ["DETSLURM_EXPERIMENTS_DIR"]).glob("exp-1*") if p.is_dir()]
    squeue = subprocess.run(["squeue", "-h", "-u", as_mallory.attacker.user.pw_name], capture_output=True, text=True)
    assert squeue.returncode != 0 or not squeue.stdout.strip()  # nothing was ever submitted as mallory


def test_root_reaches_other_users_only_when_asked_and_never_runs_them(
    det: Any, shared_url: str, as_mallory: Mallory
) -> None:
    r = as_mallory("e", "create", "--local", "--paused", CORE / "const.yaml", CORE)
    assert r.returncode == 0, r.stderr
    code, out, err = det("e", "list", "--json")
    assert code == 0 and json.loads(out) == [], out + err
    code, _, err = det("e", "kill", 1)
    assert code == 1 and "experiment 1 not found" in err
    code, out, err = det("--all-users", "e", "list", "--json")
    assert code == 0 and [(e["id"], e["owner"]) for e in json.loads(out)] == [(1, "detslurm-mallory")], out + err
    # Activating someone else's local experiment changes its state only: root never runs their code.
    code, out, err = det("--all-users", "e", "activate", 1)
    assert code == 0 and "Activated experiment 1" in out, err
    with shared_store(shared_url) as store, store.read() as s:
        exp = s.get(Experiment, 1)
        assert exp is not None and exp.state == "ACTIVE" and not [r for t in exp.trials for r in t.runs]
    code, _, err = det("--all-users", "e", "kill", 1)
    assert code == 0, err
    code, _, err = det("--all-users", "e", "delete", "--yes", 1)  # files are the owner's to delete
    assert code == 1 and "only its owner can delete it" in err, err
    with shared_store(shared_url) as store, store.read() as s:
        assert s.get(Experiment, 1).state == "STOPPING_KILLED"  # type: ignore[union-attr]
