"""The dashboard in a real headless Chromium: what each page shows is checked against the store
(DOM text, chart series and point counts), and a screenshot of each page is kept in
artifacts/dashboard/. A synthetic store here; an ASHA search that really ran on the Slurm test
cluster in test_dashboard_cluster.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from browser import chromium, column, open_page, require_browser, shot, texts
from conftest import ROOT, copy_store

from detslurm.dashboard.server import Sources
from detslurm.dashboard.testing import running_dashboard
from detslurm.store import Experiment, Trial, TrialRun

sys.path.insert(0, str(ROOT / "bench"))
from dashboard_load import build_store

JOBS = [
    {
        "#": 0,
        "id": "4242",
        "type": "TYPE_EXPERIMENT",
        "name": "synthetic-1000 (1) trial 1",
        "priority": 42,
        "slurm_priority": 1,
        "nice": 0,
        "submitted": "2026-01-01 00:00:00",
        "slots": "0/1",
        "state": "STATE_QUEUED",
        "user": "me",
        "partition": "cpu",
        "reason": "Resources",
    }
]
POOLS = [
    {
        "name": "cpu",
        "partition": "cpu",
        "slot_type": "cpu",
        "nodes": 2,
        "slots_used": 1,
        "slots_total": 4,
        "default": True,
        "state": "2 idle",
        "description": "CPU nodes",
    }
]

pytestmark = pytest.mark.heavy  # minutes of CPU: CI's run starts it after the rest


@pytest.fixture(autouse=True)
def _browser() -> None:
    require_browser()


def test_pages_show_what_the_store_holds(tmp_path: Path) -> None:
    store, exp_id = build_store(f"sqlite:///{tmp_path / 'db.sqlite'}", 30, 200, tmp_path / "exp")
    with store.tx() as s:
        # The first trial's second run waits in Slurm's queue (job 4242 of JOBS): its pending
        # reason comes from the queue, its job id from the store.
        first_id = min(t.id for t in s.query(Trial).filter(Trial.experiment_id == exp_id))
        for run_id, state, job in ((1, "EXITED", "4241"), (2, "QUEUED", "4242")):
            log = tmp_path / f"run{run_id}.log"
            log.write_text(f"[rank=0] hello from run {run_id}\n[rank=1] rank one of run {run_id}\n")
            s.add(
                TrialRun(
                    trial_id=first_id,
                    run_id=run_id,
                    state=state,
                    executor="slurm",
                    job_id=job,
                    run_dir=str(tmp_path),
                    log_path=str(log),
                )
            )
    with store.read() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        trial_ids = [t.id for t in exp.trials]
        best = min(t.searcher_metric for t in exp.trials if t.searcher_metric is not None)
        first = s.get(Trial, trial_ids[0])
        assert first is not None
        hp = first.hparams
    sources = Sources(jobs=lambda: JOBS, pools=lambda: POOLS)
    with running_dashboard(store, sources) as (base, cookie), chromium() as driver:
        token = cookie.split("=", 1)[1]
        open_page(driver, f"{base}/?token={token}", "/")
        assert "token" not in driver.current_url  # moved into a cookie
        assert column(driver, "experiments", 0) == [str(exp_id)]
        assert column(driver, "experiments", 2) == ["COMPLETED"]
        assert column(driver, "experiments", 4) == [f"loss {round(best, 4)}"]
        assert column(driver, "experiments", 5) == ["random"] and column(driver, "experiments", 6) == ["30"]
        shot(driver, "experiments")

        open_page(driver, f"{base}/#/experiments/{exp_id}", f"/experiments/{exp_id}")
        assert column(driver, "trials", 0) == [str(t) for t in trial_ids]
        curves = driver.find_element("css selector", "canvas#curves")
        assert curves.get_attribute("data-series") == "30" and curves.get_attribute("data-points") == str(30 * 100)
        hparams = driver.find_element("css selector", "canvas#hparams")
        # One line per trial with a searcher metric; axes: the 3 hyperparameters and the metric.
        assert hparams.get_attribute("data-lines") == "30" and hparams.get_attribute("data-axes") == "4"
        assert "30 trials, 3000 of 3000 points drawn" in texts(driver, "#curves-info")[0]
        assert texts(driver, "#action-pause") == []  # read-only: no buttons
        # Offline: everything the page loaded came from the dashboard itself (no CDN, no fonts).
        loaded = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert loaded and all(u.startswith(base + "/") for u in loaded), loaded
        shot(driver, "experiment")
        # The x axis can be switched to epochs (records_per_epoch and global_batch_size known).
        options = [o.get_attribute("value") for o in driver.find_elements("css selector", "#x-axis option")]
        assert options == ["batches", "epochs", "time"]

        open_page(driver, f"{base}/#/trials/{trial_ids[0]}", f"/trials/{trial_ids[0]}")
        assert dict(zip(column(driver, "hparams-table", 0), column(driver, "hparams-table", 1), strict=True)) == {
            k: str(v) for k, v in hp.items()
        }
        assert driver.find_element("css selector", "canvas#curves").get_attribute("data-series") == "1"
        assert column(driver, "runs", 2) == ["4241", "4242"] and column(driver, "runs", 4) == ["", "Resources"]
        from selenium.webdriver.support.ui import WebDriverWait

        log = lambda d: d.find_element("css selector", "pre#log").text  # noqa: E731
        WebDriverWait(driver, 30).until(lambda d: "rank one of run 2" in log(d))
        # The rank filter keeps rank 0's lines only (as `det trial logs --rank-id 0`).
        driver.find_element("css selector", "#rank").send_keys("0\n")
        WebDriverWait(driver, 30).until(lambda d: "hello from run 2" in log(d) and "rank one" not in log(d))
        shot(driver, "trial")

        open_page(driver, f"{base}/#/queue", "/queue")
        assert column(driver, "queue", 1) == ["4242"] and column(driver, "queue", 10) == ["Resources"]
        shot(driver, "queue")
        open_page(driver, f"{base}/#/pools", "/pools")
        assert column(driver, "pools", 0) == ["cpu"] and column(driver, "pools", 4) == ["1/4"]
        shot(driver, "pools")


def test_a_1000_trial_experiment_opens_in_the_browser(store_1000x1000: tuple[Path, int], tmp_path: Path) -> None:
    store, exp_id = copy_store(store_1000x1000[0], tmp_path), store_1000x1000[1]
    with running_dashboard(store) as (base, cookie), chromium() as driver:
        token = cookie.split("=", 1)[1]
        open_page(driver, f"{base}/?token={token}", "/")
        open_page(driver, f"{base}/#/experiments/{exp_id}", f"/experiments/{exp_id}", timeout=120)
        curves = driver.find_element("css selector", "canvas#curves")
        assert curves.get_attribute("data-series") == "1000"
        assert int(curves.get_attribute("data-points")) <= 100_000
        assert len(column(driver, "trials", 0)) == 1000
        shot(driver, "experiment-1000-trials")


def test_actions_appear_only_when_allowed(tmp_path: Path) -> None:
    store, exp_id = build_store(f"sqlite:///{tmp_path / 'db.sqlite'}", 2, 10, tmp_path / "exp")
    done: list[tuple[str, int]] = []
    sources = Sources(jobs=list, pools=list, act=lambda a, e: done.append((a, e)))
    with running_dashboard(store, sources) as (base, cookie), chromium() as driver:
        token = cookie.split("=", 1)[1]
        open_page(driver, f"{base}/?token={token}#/experiments/{exp_id}", f"/experiments/{exp_id}")
        assert texts(driver, "#mode") == ["actions enabled"]
        driver.find_element("css selector", "#action-pause").click()
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(driver, 30).until(lambda d: done)
    assert done == [("pause", exp_id)]


def test_without_slurm_the_queue_and_pools_pages_say_so(tmp_path: Path) -> None:
    """Local mode on a laptop: the queue and pools pages show why they are empty, and the
    experiments page (and the navigation back to it) keeps working."""
    from detslurm.slurm.client import SlurmUnavailable

    def missing() -> list[dict[str, object]]:
        raise SlurmUnavailable("squeue not found: is this a Slurm login node (or is the test cluster up)?")

    store, exp_id = build_store(f"sqlite:///{tmp_path / 'db.sqlite'}", 2, 10, tmp_path / "exp")
    with running_dashboard(store, Sources(jobs=missing, pools=missing)) as (base, cookie), chromium() as driver:
        token = cookie.split("=", 1)[1]
        for route in ("/queue", "/pools"):
            open_page(driver, f"{base}/?token={token}#{route}", route)
            (notice,) = texts(driver, "#notice")
            assert notice.startswith("No Slurm cluster is configured on this machine (squeue not found)")
            assert texts(driver, "#error") == []
        shot(driver, "pools-without-slurm")
        open_page(driver, f"{base}/#/", "/")
        assert column(driver, "experiments", 0) == [str(exp_id)]
