"""What the quickest commands import (goal: `det t logs --tail 100` <= 0.1 s): with no daemon
running and no user config file, a read loads neither the protocol package, nor yaml, nor psutil,
nor the ORM; those load where they are needed, and then still work."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, write

from detslurm import settings
from detslurm.controller.create import execute_create, plan_create
from detslurm.errors import ConfigError
from detslurm.store import LogEntry, Trial, open_store
from detslurm.util import DETACHED_DIR, detached_root

CONFIG = "name: s\nentrypoint: python3 train.py\nsearcher: {name: single, metric: loss}\n"
WATCHED = ("detslurm.protocol", "yaml", "psutil", "sqlalchemy", "alembic")

PROBE = """
import sys
from detslurm.cli.main import main
code = main(sys.argv[1:])
loaded = sorted(m for m in {watched!r} if m in sys.modules)
print("LOADED=" + ",".join(loaded), file=sys.stderr)
sys.exit(code)
"""


def _probe(*args: str) -> tuple[int, str, list[str]]:
    p = subprocess.run(
        [sys.executable, "-c", PROBE.format(watched=WATCHED), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        cwd=ROOT,
        timeout=120,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("LOADED=")]
    assert lines, p.stderr
    return p.returncode, p.stdout, [m for m in lines[-1].removeprefix("LOADED=").split(",") if m]


def _ended_trial_with_notes(tmp_path: Path) -> int:
    st = settings.load()
    store = open_store(st.db_url)
    write(tmp_path / "ctx" / "train.py", "pass\n")
    exp_id = execute_create(store, st, plan_create(st, write(tmp_path / "c.yaml", CONFIG), tmp_path / "ctx"), "slurm")
    with store.tx() as s:
        trial = Trial(experiment_id=exp_id, request_id="r", hparams={}, seed=1)
        s.add(trial)
        s.flush()
        s.add(LogEntry(trial_id=trial.id, message="first note"))
        tid = int(trial.id)
    store.dispose()
    con = sqlite3.connect(st.db_url.split("///", 1)[-1])
    with con:
        con.execute("UPDATE experiments SET state = 'COMPLETED'")  # nothing left to reconcile
    con.close()
    return tid


def test_t_logs_loads_no_protocol_yaml_psutil_or_orm(det_env: Path, tmp_path: Path) -> None:
    tid = _ended_trial_with_notes(tmp_path)
    code, out, loaded = _probe("t", "logs", str(tid), "--tail", "5")
    assert code == 0 and "first note" in out and loaded == []
    # A detached-runs root makes the read look for detached runs: that is when the rest loads.
    detached_root(Path(os.environ["DETSLURM_EXPERIMENTS_DIR"])).mkdir(parents=True)
    code, out, loaded = _probe("t", "logs", str(tid), "--tail", "5")
    assert code == 0 and "first note" in out


def test_the_detached_root_is_the_one_the_protocol_names(tmp_path: Path) -> None:
    from detslurm.protocol import detached

    assert detached.detached_root(tmp_path) == detached_root(tmp_path) == tmp_path / "detached"
    assert detached.DETACHED_DIR == DETACHED_DIR


def test_a_user_config_file_is_still_read_and_checked(det_env: Path) -> None:
    path = Path(os.environ["DETSLURM_CONFIG"])
    path.write_text("max_local_trials: 7\n")
    assert settings.load().max_local_trials == 7
    path.write_text("max_local_trials: [1\n")
    with pytest.raises(ConfigError, match=str(path)):
        settings.load()
