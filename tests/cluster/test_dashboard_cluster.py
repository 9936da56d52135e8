"""The dashboard on an ASHA search that really ran as Slurm jobs on the test cluster, in a real
headless Chromium: every page checked against the store (and the queue and pools against
Slurm, through the same code as `det job list` and `det rp list`). Screenshots go to
artifacts/dashboard/cluster-*.png."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from browser import chromium, column, open_page, require_browser, shot, texts
from conftest import EXAMPLES

from detslurm import settings
from detslurm.dashboard.testing import running_dashboard
from detslurm.store import Checkpoint, Experiment, open_store

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
CORE = EXAMPLES / "core_api"


def test_dashboard_shows_a_real_asha_search(det: Any, tmp_path: Path) -> None:
    require_browser()
    code, out, err = det("e", "create", CORE / "adaptive.yaml", CORE, "--config", "searcher.max_trials=6")
    assert code == 0, err
    code, out, err = det("e", "wait", "1")
    assert code == 0 and "COMPLETED" in out, out + err
    store = open_store(settings.load().db_url)
    with store.read() as s:
        exp = s.get(Experiment, 1)
        assert exp is not None
        trials = {t.id: t for t in exp.trials}
        best = min(t.searcher_metric for t in exp.trials if t.searcher_metric is not None)
        n_rungs = sum(len(b["rungs"]) for b in (exp.searcher_state or {})["method"]["brackets"])
        t1 = trials[min(trials)]
        jobs = [r.job_id for r in t1.runs]
        cks = {c.uuid for c in s.query(Checkpoint).filter(Checkpoint.trial_id == t1.id)}
        log_line = next(line for line in Path(t1.runs[0].log_path).read_text().splitlines() if line.strip())

    from detslurm.cli.app import App
    from detslurm.cli.dashboard import _sources

    app = App()
    with running_dashboard(store, _sources(app, allow_actions=False)) as (base, cookie), chromium() as driver:
        open_page(driver, f"{base}/?token={cookie.split('=', 1)[1]}", "/")
        assert column(driver, "experiments", 0) == ["1"] and column(driver, "experiments", 2) == ["COMPLETED"]
        assert column(driver, "experiments", 4) == [f"validation_loss {round(best, 4)}"]
        assert column(driver, "experiments", 5) == ["adaptive_asha"]
        shot(driver, "cluster-experiments")

        open_page(driver, f"{base}/#/experiments/1", "/experiments/1")
        assert column(driver, "trials", 0) == [str(t) for t in sorted(trials)]
        with_val = sum(1 for t in trials.values() if t.searcher_metric is not None)
        assert driver.find_element("css selector", "canvas#curves").get_attribute("data-series") == str(with_val)
        assert len(column(driver, "rungs", 0)) == n_rungs and n_rungs >= 2
        shot(driver, "cluster-experiment")

        open_page(driver, f"{base}/#/trials/{t1.id}", f"/trials/{t1.id}")
        assert column(driver, "runs", 2) == jobs and all(jobs)
        assert set(column(driver, "checkpoints", 0)) == cks and cks
        assert all(x.endswith(("B", "KiB", "MiB", "GiB")) for x in column(driver, "checkpoints", 2))
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(driver, 30).until(lambda d: log_line in d.find_element("css selector", "pre#log").text)
        shot(driver, "cluster-trial")

        open_page(driver, f"{base}/#/pools", "/pools")
        assert column(driver, "pools", 0) == sorted(app.site().pools)
        shot(driver, "cluster-pools")
        open_page(driver, f"{base}/#/queue", "/queue")
        assert texts(driver, "#error") == []
        shot(driver, "cluster-queue")
