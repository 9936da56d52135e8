"""The dashboard's server and queries, against real stores (no browser: see
test_dashboard_browser.py): token and Host checks, loopback-only binding, actions only when
allowed, scoping, and JSON that agrees with the store, up to 1000 trials and 1M points."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, copy_store

from detslurm.dashboard import downsample, logs, queries, serve
from detslurm.dashboard.server import Sources
from detslurm.dashboard.testing import running_dashboard
from detslurm.identity import os_user
from detslurm.store import Experiment, Store, open_store
from detslurm.store.models import ExperimentState, Metric

sys.path.insert(0, str(ROOT / "bench"))
from dashboard_load import build_store, open_page


def get(base: str, path: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, Any]:
    req = urllib.request.Request(base + path, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            body = r.read()
            return r.status, json.loads(body) if r.headers.get_content_type() == "application/json" else body.decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def small(tmp_path: Path) -> tuple[Store, int]:
    return build_store(f"sqlite:///{tmp_path / 'db.sqlite'}", 12, 40, tmp_path / "exp")


def test_downsample_keeps_mean_min_and_max() -> None:
    rows = [(s, float(s), 1.0 if s != 37 else 9.0) for s in range(100)]
    ser = downsample.bucketize(1, rows, 10)
    assert len(ser.value) == 10 and ser.raw_points == 100
    # The spike at step 37 survives in its bucket's max, and the mean moves with it.
    assert max(ser.vmax) == 9.0 and ser.vmax[3] == 9.0 and ser.value[3] == pytest.approx(1.8)
    assert downsample.points_per_series(1000) == 100 and downsample.points_per_series(1) == downsample.MAX_PER_SERIES


def test_binds_only_to_loopback() -> None:
    for host in ("0.0.0.0", "::", "example.org", "10.0.0.1"):
        with pytest.raises(serve.BindError, match="binds only to 127.0.0.1"):
            serve.bind(host, 0)
    with serve.bind("localhost", 0) as s:
        assert s.getsockname()[0] == "127.0.0.1"


def test_every_request_needs_the_token(small: tuple[Store, int]) -> None:
    store, exp_id = small
    with running_dashboard(store) as (base, cookie):
        token = cookie.split("=", 1)[1]
        for path in ("/", "/static/app.js", "/api/experiments", f"/api/experiments/{exp_id}"):
            assert get(base, path)[0] == 403
            assert get(base, path, {"Cookie": cookie.split("=")[0] + "=wrong"})[0] == 403
            assert get(base, path, {"Cookie": cookie})[0] == 200
        page = urllib.request.urlopen(urllib.request.Request(base + "/", headers={"Cookie": cookie}), timeout=300)
        # The page may not be framed (clickjacking of the action buttons) nor run foreign scripts.
        assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
        assert page.headers["X-Frame-Options"] == "DENY" and page.headers["Cache-Control"] == "no-store"
        # The printed URL's ?token= becomes a cookie and the token leaves the address bar.
        opener = urllib.request.build_opener(NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as e:
            opener.open(base + "/?token=" + token)
        assert e.value.code == 303 and e.value.headers["Location"] == "/"
        assert f"{cookie}" in e.value.headers["Set-Cookie"] and "HttpOnly" in e.value.headers["Set-Cookie"]
        # A cookie an earlier dashboard left (old token) does not shadow the fresh URL: the query
        # token wins and the redirect replaces the cookie.
        stale = cookie.split("=")[0] + "=stale-token-of-a-previous-run"
        with pytest.raises(urllib.error.HTTPError) as e:
            opener.open(urllib.request.Request(base + "/?token=" + token, headers={"Cookie": stale}))
        assert e.value.code == 303 and f"{cookie}" in e.value.headers["Set-Cookie"]
        assert get(base, "/api/experiments?token=" + token, {"Cookie": stale})[0] == 200
        assert get(base, "/api/experiments?token=wrong", {"Cookie": stale})[0] == 403
        # A page on another site that resolves its name to 127.0.0.1 (DNS rebinding) is refused.
        assert get(base, "/api/experiments", {"Cookie": cookie, "Host": "evil.example:80"})[0] == 403


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_pages_agree_with_the_store(small: tuple[Store, int]) -> None:
    store, exp_id = small
    with running_dashboard(store) as (base, cookie):
        h = {"Cookie": cookie}
        _, exps = get(base, "/api/experiments", h)
        assert [(e["id"], e["name"], e["state"], e["searcher"], e["trials"], e["owner"]) for e in exps] == [
            (exp_id, "synthetic-1000", "COMPLETED", "random", 12, os_user())
        ]
        _, page = get(base, f"/api/experiments/{exp_id}", h)
        with store.read() as s:
            exp = s.get(Experiment, exp_id)
            assert exp is not None
            best = min(t.searcher_metric for t in exp.trials if t.searcher_metric is not None)
            n_val = s.query(Metric).filter(Metric.group == "validation").count()
        assert exps[0]["best_metric"] == pytest.approx(best)
        assert [t["id"] for t in page["trials"]] == [t.id for t in exp.trials]
        assert page["metric_names"] == {"training": ["loss"], "validation": ["accuracy", "loss"]}
        assert page["hparam_names"] == ["layers", "lr", "opt"]
        _, curves = get(base, f"/api/experiments/{exp_id}/curves?group=validation&metric=loss", h)
        # Every stored point is in some bucket, each trial is one series.
        assert len(curves["series"]) == 12 and sum(s["raw_points"] for s in curves["series"]) == n_val
        assert curves["epochs_per_batch"] == pytest.approx(64 / 6400)
        tid = page["trials"][0]["id"]
        _, trial = get(base, f"/api/trials/{tid}", h)
        assert trial["trial"]["id"] == tid and trial["experiment"]["id"] == exp_id
        _, tc = get(base, f"/api/trials/{tid}/curves?group=training&metric=loss", h)
        assert [s["trial_id"] for s in tc["series"]] == [tid] and tc["series"][0]["raw_points"] == 20


def test_batches_leave_out_what_a_restart_redid(small: tuple[Store, int]) -> None:
    """The trial table's batches are views.batches' (what `det t describe` shows), also for a
    trial whose rows past its resume checkpoint were archived by a restart."""
    from sqlalchemy import update

    from detslurm import views
    from detslurm.identity import Scope

    store, exp_id = small
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        t1, t2 = exp.trials[0], exp.trials[1]
        t1.run_count = t2.run_count = 2
        s.execute(update(Metric).where(Metric.trial_id == t1.id, Metric.steps_completed > 100).values(archived=True))
        s.execute(update(Metric).where(Metric.trial_id == t2.id).values(archived=True))
    with store.read() as s:
        rows = queries.trial_rows(s, exp_id, Scope.mine())
        assert {r.id: r.batches for r in rows} == {r.id: views.batches(s, r.id) for r in rows}
    assert {r.id: r.batches for r in rows}[t1.id] == 100 and {r.id: r.batches for r in rows}[t2.id] == 0


def test_another_users_experiment_is_not_found(tmp_path: Path) -> None:
    store, exp_id = build_store(f"sqlite:///{tmp_path / 'db.sqlite'}", 2, 4, tmp_path / "exp")
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        exp.owner = "someone-else"
    with running_dashboard(store) as (base, cookie):
        h = {"Cookie": cookie}
        assert get(base, "/api/experiments", h)[1] == []
        code, body = get(base, f"/api/experiments/{exp_id}", h)
        assert code == 404 and f"experiment {exp_id} not found" in body
        assert get(base, f"/api/experiments/{exp_id}/curves?group=validation&metric=loss", h)[0] == 404
        assert get(base, "/api/trials/1/logs", h)[0] == 404


def test_actions_need_the_flag_a_post_and_the_token_header(small: tuple[Store, int]) -> None:
    store, exp_id = small
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        exp.state = ExperimentState.ACTIVE
    done: list[tuple[str, int]] = []
    with running_dashboard(store) as (base, cookie):
        assert get(base, f"/api/experiments/{exp_id}/pause", {"Cookie": cookie}, "POST")[0] == 403  # read-only
    sources = Sources(jobs=list, pools=list, act=lambda a, e: done.append((a, e)))
    with running_dashboard(store, sources) as (base, cookie):
        token = cookie.split("=", 1)[1]
        assert get(base, f"/api/experiments/{exp_id}/pause", {"Cookie": cookie}, "POST")[0] == 403  # no header
        assert get(base, f"/api/experiments/{exp_id}/pause", {"Cookie": cookie}, "GET")[0] == 405
        code, body = get(
            base, f"/api/experiments/{exp_id}/pause", {"Cookie": cookie, "X-Detslurm-Token": token}, "POST"
        )
        assert (code, body) == (200, {"ok": True, "action": "pause"})
        assert (
            get(base, f"/api/experiments/{exp_id}/delete", {"Cookie": cookie, "X-Detslurm-Token": token}, "POST")[0]
            == 404
        )
    assert done == [("pause", exp_id)]


def test_logs_follow_from_a_cursor_with_a_rank_filter(tmp_path: Path) -> None:
    a, b = tmp_path / "run1.log", tmp_path / "run2.log"
    a.write_text("[rank=0] one\n[rank=1] two\n")
    b.write_text("[rank=0] three\n[rank=1] fo")  # the last line is still being written
    first = logs.read([str(a), str(b)], logs.Cursor())
    assert first.lines == [f"=== run 1 ({a})", "[rank=0] one", "[rank=1] two", f"=== run 2 ({b})", "[rank=0] three"]
    with b.open("a") as f:
        f.write("ur\n[rank=0] five\n")
    nxt = logs.read([str(a), str(b)], logs.Cursor.parse(first.cursor))
    assert nxt.lines == ["[rank=1] four", "[rank=0] five"] and not nxt.more
    only1 = logs.read([str(a), str(b)], logs.Cursor(), rank=1)
    assert [x for x in only1.lines if not x.startswith("===")] == ["[rank=1] two", "[rank=1] four"]


@pytest.mark.heavy
def test_a_1000_trial_1m_point_experiment_is_downsampled_in_sql(
    store_1000x1000: tuple[Path, int], tmp_path: Path
) -> None:
    """The shape of the large page (timing is bench/dashboard_load.py's business): every trial
    is a series, the points sent stay within the budget, and every stored point is counted."""
    store, exp_id = copy_store(store_1000x1000[0], tmp_path), store_1000x1000[1]
    with running_dashboard(store) as (base, cookie):
        _, page, curves = open_page(base, cookie, exp_id)
    assert len(page["trials"]) == 1000
    series = curves["series"]
    assert len(series) == 1000 and sum(s["raw_points"] for s in series) == 500_000
    sent = sum(len(s["value"]) for s in series)
    assert sent <= downsample.TOTAL_POINT_BUDGET and all(len(s["value"]) >= 90 for s in series)
    # Bands are not sent for 1000 curves (the browser draws them only for a few).
    assert all(s["vmin"] == [] for s in series)


def test_store_without_a_cluster(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with running_dashboard(store) as (base, cookie):
        assert get(base, "/api/experiments", {"Cookie": cookie})[1] == []
        assert get(base, "/api/queue", {"Cookie": cookie})[1] == {"rows": [], "notice": None}
        code, body = get(base, "/api/experiments/notanumber", {"Cookie": cookie})
        assert code == 400 and "exp_id must be an integer" in body


# What Slurm 22.05's squeue and sinfo print, and their exit code, on a machine with no
# slurm.conf and no configless DNS record (a laptop with the Slurm client package installed).
NO_CONF = """#!/bin/sh
echo "$(basename "$0"): error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host" >&2
echo "$(basename "$0"): error: _establish_config_source: failed to fetch config" >&2
echo "$(basename "$0"): fatal: Could not establish a configuration source" >&2
exit 1
"""


@pytest.mark.parametrize("slurm", ["no commands", "no slurm.conf"])
def test_without_a_slurm_cluster_the_queue_and_pools_say_so(
    det_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurm: str
) -> None:
    """`det dashboard`'s own sources (those of `det job list` and `det rp list`) on a machine
    without Slurm: HTTP 200, no rows and a notice that says why, not squeue's fatal text with
    HTTP 400; the experiments are served all the same."""
    from detslurm.cli.app import App
    from detslurm.cli.dashboard import _sources

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if slurm == "no slurm.conf":
        for name in ("squeue", "sinfo"):
            (bin_dir / name).write_text(NO_CONF)
            (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    app = App()
    store = app.store
    with running_dashboard(store, _sources(app, allow_actions=False)) as (base, cookie):
        for path, what in (("/api/queue", "squeue"), ("/api/pools", "sinfo")):
            code, body = get(base, path, {"Cookie": cookie})
            assert code == 200 and body["rows"] == [], body
            assert body["notice"].startswith("No Slurm cluster is configured on this machine (")
            reason = "not found" if slurm == "no commands" else "Could not establish a configuration source"
            assert f"{what}: {reason}" in body["notice"] or f"{what} {reason}" in body["notice"], body
            assert "error:" not in body["notice"]
        assert get(base, "/api/experiments", {"Cookie": cookie}) == (200, [])


def test_a_slurm_that_is_down_is_still_an_error(tmp_path: Path) -> None:
    """Only a machine without Slurm gets the notice: slurmctld not answering is an error."""
    from detslurm.slurm.client import SlurmCommandError

    def down() -> list[dict[str, Any]]:
        raise SlurmCommandError(["squeue"], 1, "squeue: error: Unable to contact slurm controller (connect failure)")

    store = open_store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with running_dashboard(store, Sources(jobs=down, pools=list)) as (base, cookie):
        code, body = get(base, "/api/queue", {"Cookie": cookie})
        assert code == 400 and "Unable to contact slurm controller" in body
        assert get(base, "/api/pools", {"Cookie": cookie}) == (200, {"rows": [], "notice": None})


def test_det_dashboard_prints_its_url_once_and_serves_it(det: Any) -> None:
    code, _, err = det("dashboard", "--host", "0.0.0.0")
    assert code == 1 and "binds only to 127.0.0.1 or ::1" in err
    import os
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-m", "detslurm.cli.main", "dashboard"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert proc.stdout is not None
        word, url = proc.stdout.readline().split()
        assert word == "Open" and url.startswith("http://127.0.0.1:") and "/?token=" in url
        base, token = url.split("/?token=")
        assert len(token) >= 40  # secrets.token_urlsafe(32)
        assert proc.stdout.readline().startswith("(read-only;")
        assert get(base, "/api/experiments")[0] == 403
        port = base.rsplit(":", 1)[1]
        assert get(base, "/api/experiments", {"Cookie": f"detslurm_{port}={token}"}) == (200, [])
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.e2e
def test_curves_of_a_restarted_trial_count_each_step_once(det: Any) -> None:
    """A trial killed at batch 13 and resumed from its batch-10 checkpoint: its curve has every
    step once (run 1's steps past the checkpoint are archived in metric_points too)."""
    from detslurm import settings
    from detslurm.identity import Scope

    core = ROOT / "examples/core_api"
    crash = "environment.environment_variables=[EXAMPLE_CRASH_AT_BATCH=13]"
    code, _, err = det("e", "create", "--local", core / "const.yaml", core, "--config", crash)
    assert code == 0, err
    store = open_store(settings.load().db_url)
    with store.read() as s:
        (trial,) = s.get(Experiment, 1).trials  # type: ignore[union-attr]
        assert trial.run_count == 2
        training = queries.curves(s, 1, Scope.mine(), "training", "loss")
        stored = s.query(Metric).filter(Metric.trial_id == trial.id, Metric.group == "training").count()
    (series,) = training.series
    assert series.raw_points == 40 < stored  # the archived rows are in the store, not in the curve
    assert series.batches == [float(b) for b in range(1, 41)]


@pytest.mark.heavy
def test_the_same_pages_from_postgresql(tmp_path: Path) -> None:
    """The dashboard's SQL has PostgreSQL branches (JSON paths, epoch seconds): the same
    synthetic experiment gives the same JSON from a real PostgreSQL server as from SQLite."""
    from pg_harness import PostgresUnavailable, private_postgres

    try:
        pg = private_postgres()
        url = pg.__enter__()
    except PostgresUnavailable as e:
        pytest.skip(str(e))
    try:
        answers = []
        for db in (url, f"sqlite:///{tmp_path / 'db.sqlite'}"):
            store, exp_id = build_store(db, 5, 40, tmp_path / "exp")
            with running_dashboard(store) as (base, cookie):
                _, page, curves = open_page(base, cookie, exp_id)
                _, exps = get(base, "/api/experiments", {"Cookie": cookie})
            store.dispose()
            for t in page["trials"]:
                t.pop("id")
            for s in curves["series"]:
                s.pop("trial_id")
            answers.append((exps[0]["best_metric"], exps[0]["searcher"], page["trials"], page["metric_names"], curves))
        pg_answer, lite_answer = answers
        assert pg_answer[:4] == lite_answer[:4]
        pg_curves, lite_curves = pg_answer[4], lite_answer[4]
        assert {k: v for k, v in pg_curves.items() if k != "series"} == {
            k: v for k, v in lite_curves.items() if k != "series"
        }
        for a, b in zip(pg_curves["series"], lite_curves["series"], strict=True):
            for key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-9, abs=2e-3 if key == "seconds" else 0), key
        assert [s["seconds"][:2] for s in answers[0][4]["series"]][0] == [10.0, 20.0]
    finally:
        pg.__exit__(None, None, None)


def test_assets_ship_in_the_package_and_name_no_other_host() -> None:
    """Works offline: the page's assets are package files, and none of them loads anything from
    elsewhere (no CDN, no web fonts)."""
    import re

    static = ROOT / "detslurm/dashboard/static"
    assert sorted(p.name for p in static.iterdir()) == ["app.js", "charts.js", "index.html", "style.css"]
    for p in static.iterdir():
        assert not re.search(r"https?://|//cdn|@import|url\(", p.read_text()), p.name
    assert '"detslurm.dashboard" = ["static/*"]' in (ROOT / "pyproject.toml").read_text()
