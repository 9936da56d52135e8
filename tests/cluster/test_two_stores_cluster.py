"""Two stores on the real cluster: two stores (two databases, one experiments dir)
each create experiment 1. Their dirs and job tags differ, they run side by side, neither
adopts or kills the other's jobs, and a failing create removes only the dir it made."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, write
from helpers import wait_for
from sqlalchemy import select

from detslurm import daemon, settings
from detslurm.controller.create import execute_create, plan_create
from detslurm.slurm.parse import comment_tag, experiment_tag
from detslurm.store import Experiment, Trial, TrialRun, open_store

CORE = EXAMPLES / "core_api"


def use_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    """Switch this process (and the daemons it starts) to store ``name``; the experiments
    dir (DETSLURM_EXPERIMENTS_DIR from det_env) stays the one both share."""
    monkeypatch.delenv("DETSLURM_DB_URL", raising=False)
    monkeypatch.setenv("DETSLURM_DATA_DIR", str(tmp_path / f"data-{name}"))


def exp_one() -> tuple[str, list[str]]:
    """Experiment 1 of the current store: its dir and its runs' job ids."""
    with open_store(settings.load().db_url).tx() as s:
        exp = s.get(Experiment, 1)
        assert exp is not None
        jobs = [r.job_id for r in s.scalars(select(TrialRun).join(Trial).where(Trial.experiment_id == 1))]
        return exp.exp_dir, [j for j in jobs if j]


def queue() -> dict[str, tuple[str, str]]:
    out = subprocess.run(["squeue", "-h", "--states=all", "-o", "%i %T %k"], capture_output=True, text=True).stdout
    return {f[0]: (f[1], f[2]) for f in (line.split(" ", 2) for line in out.splitlines()) if len(f) == 3}


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_env")
def test_two_stores_share_an_experiments_dir(det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ("e", "create", CORE / "const.yaml", CORE, "--config", "hyperparameters.sleep=1.0")
    try:
        use_store(monkeypatch, tmp_path, "a")
        assert det(*cfg)[0] == 0
        use_store(monkeypatch, tmp_path, "b")
        assert det(*cfg)[0] == 0
        wait_for(lambda: len(exp_one()[1]) == 1)
        dir_b, (job_b,) = exp_one()
        use_store(monkeypatch, tmp_path, "a")
        wait_for(lambda: len(exp_one()[1]) == 1)
        dir_a, (job_a,) = exp_one()
        # Both are experiment 1, in the same experiments dir, yet own distinct dirs and tags.
        assert Path(dir_a).parent == Path(dir_b).parent and dir_a != dir_b
        assert Path(dir_a).name.startswith("exp-1-") and Path(dir_b).name.startswith("exp-1-")
        assert experiment_tag(dir_a) != experiment_tag(dir_b)
        wait_for(lambda: queue().get(job_a, ("",))[0] == "RUNNING" and queue().get(job_b, ("",))[0] == "RUNNING")
        q = queue()
        assert comment_tag(q[job_a][1]) == experiment_tag(dir_a) and comment_tag(q[job_b][1]) == experiment_tag(dir_b)
        # Same identity (exp 1, trial 1, run 1): each store's recovery finds only its own job.
        ex = daemon.make_controller(settings.load()).executor
        assert ex.recover((1, 1, 1), dir_a) == job_a and ex.recover((1, 1, 1), dir_b) == job_b
        # Store B kills its experiment: A's job keeps running and A's files are untouched.
        use_store(monkeypatch, tmp_path, "b")
        assert det("e", "kill", "1")[0] == 0
        wait_for(lambda: queue()[job_b][0] not in ("RUNNING", "PENDING", "COMPLETING"))
        assert queue()[job_a][0] == "RUNNING"
        use_store(monkeypatch, tmp_path, "a")
        code, out, err = det("e", "wait", "1")
        assert code == 0, out + err
        with open_store(settings.load().db_url).tx() as s:
            (t,) = s.scalars(select(Trial)).all()
            assert t.state == "COMPLETED" and t.restarts == 0 and t.run_count == 1
        assert (Path(dir_a) / "trials").is_dir() and (Path(dir_b) / "trials").is_dir()
    finally:
        for name in ("a", "b"):
            use_store(monkeypatch, tmp_path, name)
            daemon.stop(settings.load())


def test_failing_create_removes_only_its_own_dir(
    det_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Store B's create fails after making its dir (its context changed under it): B's new dir
    goes, store A's experiment 1 and a stranger's dir in the same experiments dir stay."""
    ctx = tmp_path / "ctx"
    write(ctx / "train.py", "print('hi')\n")
    cfg = write(tmp_path / "c.yaml", "entrypoint: python3 train.py\nsearcher: {name: single, metric: loss}\n")
    use_store(monkeypatch, tmp_path, "a")
    s = settings.load()
    id_a = execute_create(open_store(s.db_url), s, plan_create(s, cfg, ctx), "slurm")
    (dir_a,) = s.experiments_dir.iterdir()
    stranger = write(s.experiments_dir / "exp-1-00000000" / "keep", "not ours")
    use_store(monkeypatch, tmp_path, "b")
    s = settings.load()
    plan = plan_create(s, cfg, ctx)
    (ctx / "train.py").unlink()  # the tarball write fails after the dir was made
    with pytest.raises(FileNotFoundError):
        execute_create(open_store(s.db_url), s, plan, "slurm")
    assert id_a == 1 and sorted(s.experiments_dir.iterdir()) == sorted([dir_a, stranger.parent])
    assert (dir_a / "context.tar.gz").exists() or any(dir_a.iterdir())
    assert stranger.read_text() == "not ours"
    with open_store(s.db_url).tx() as ses:
        assert ses.scalars(select(Experiment)).all() == []  # B's rows rolled back with its dir
