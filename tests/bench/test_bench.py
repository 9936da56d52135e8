"""Every benchmark runs (at toy sizes) on the real cluster, so bench/ cannot rot. Timing goals
are not asserted here (they live in bench/README.md, measured side by side); what is asserted
are the counts the goals name and that every ratio was measured."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

# In the whole suite only (marker `full`): on a loaded 2-core machine these smoke runs took over
# 20 min of CI's 90, and they guard bench/ against rot, not a behaviour users meet.
pytestmark = [pytest.mark.slurm, pytest.mark.full, pytest.mark.usefixtures("slurm_env")]
BENCH = ROOT / "bench"


def run(tmp_path: Path, script: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ, BENCH_RESULTS_DIR=str(tmp_path / "results"))
    for k in [k for k in env if k.startswith("DETSLURM_") and k != "DETSLURM_SITE_CONFIG"]:
        del env[k]  # each benchmark makes its own private store
    p = subprocess.run(
        [sys.executable, str(BENCH / script), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    name = script.removesuffix(".py")
    return dict(json.loads((tmp_path / "results" / f"{name}.json").read_text()))


def finite(*xs: float) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


def test_slurmctld_load_is_one_query_per_tick(tmp_path: Path) -> None:
    d = run(tmp_path, "slurmctld_load.py", "--counts", "1,10", "--ticks", "2")
    assert [r["jobs"] for r in d["rows"]] == [1, 10]
    for r in d["rows"]:
        assert r["detslurm_job_queries_per_tick"] == 1  # one squeue, whatever the count
        assert r["per_job_job_queries_per_tick"] == r["jobs"]


def test_tick_cost_follows_change(tmp_path: Path) -> None:
    d = run(tmp_path, "tick_cost.py", "--trials", "20", "--ticks", "2", "--rows", "10,30")
    (r,) = d["rows"]
    assert r["trials"] == 20 and r["squeue_per_tick"] == 1
    assert r["idle_tick_event_opens"] == 0  # nothing new: no event file is opened
    # A tick opens exactly the files that grew (10 rows a run).
    assert r["ingest_tick_event_opens"] == {"10": [1, 1], "30": [3, 3]}
    # One validation, one op completed, one trial ending: each loads only its own trial (not 20).
    assert {k: v[1] for k, v in r["change_tick"].items()} == {"validation": 3, "op_completed": 3, "trial_ended": 3}
    assert finite(r["idle_tick_cpu_s"], r["full_tick_cpu_s"], r["max_rss_mb"])


def test_submission_uses_one_array(tmp_path: Path) -> None:
    d = run(tmp_path, "submission.py", "--trials", "16", "--repeats", "1")
    assert d["detslurm_sbatch_calls"] == [1]
    assert finite(d["ratio_vs_submitit"], d["ratio_vs_sbatch_loop"])


@pytest.mark.torch
def test_launch_and_trainer_and_checkpoint_benchmarks(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    d = run(tmp_path, "launch_overhead.py", "--repeats", "1", "--warmup", "0")
    assert finite(d["ratio"])
    d = run(tmp_path, "fail_fast.py", "--repeats", "1")
    assert finite(d["ratio"], d["plain_median_s"])
    d = run(tmp_path, "trainer_overhead.py", "--batches", "200", "--repeats", "1")
    assert finite(d["ratio"], d["report_training_metrics_us_per_call"])
    d = run(tmp_path, "checkpoint_io.py", "--mb", "8", "--repeats", "2")
    assert finite(d["save_throughput_ratio"], d["restore_throughput_ratio"])


def test_search_efficiency_and_cli_benchmarks(tmp_path: Path) -> None:
    d = run(tmp_path, "search_efficiency.py", "--seeds", "3", "--random-trials", "16", "--max-time", "16")
    assert finite(d["asha_ratio_median"], d["optuna_sha_ratio_median"])
    d = run(tmp_path, "cli_latency.py", "--experiments", "300", "--jobs", "50", "--log-mib", "4", "--repeats", "1")
    assert d["jobs"] == 50 and d["log_mib"] == 4
    assert finite(
        d["help_ratio_vs_import_click"],
        d["e_list_ratio_vs_raw_sqlite"],
        d["job_list_ratio_vs_squeue"],
        d["python_floor_job_list_ratio_vs_squeue"],
        d["t_logs_tail_ratio_vs_tail"],
    )
    summary = _summary(tmp_path)
    assert "| search: adaptive_asha |" in summary and "| det e list, 300 experiments |" in summary
    assert "| det t logs --tail 100, 4 MiB log |" in summary


def test_read_commands_benchmark(tmp_path: Path) -> None:
    d = run(tmp_path, "read_commands.py", "--experiments", "20", "--trials", "3", "--reports", "4", "--repeats", "1")
    assert d["trials"] == 60 and d["ratio_vs_e_list"]["e list"] == 1.0
    # Every read command was timed (job list too: the cluster is there).
    assert {"e describe", "e list-trials", "e list-checkpoints", "t describe --metrics", "checkpoint list"} <= set(
        d["ratio_vs_e_list"]
    )
    assert "job list" in d["median_s"] and finite(*d["ratio_vs_e_list"].values(), d["max_ratio"])


def test_store_scale_benchmark(tmp_path: Path) -> None:
    d = run(tmp_path, "store_scale.py", "--ingest", "500", "--rows", "3500", "--trials", "3", "--points", "50")
    # Every event ingested once, the store holds the rows asked for (the ingest, both floors and 2000
    # in bulk), the curve is downsampled.
    assert d["ingested_rows"] == 500 and d["metric_rows"] == 3500
    assert 0 < d["curve_points"] <= 51 and d["curve_trial_validation_rows"] > 50
    assert finite(d["ingest_rows_per_s"], d["ingest_ratio_vs_raw"], d["store_mb_per_million_rows"])
    assert finite(
        d["ingest_ratio_vs_raw_with_points"], d["ingest_cpu_rows_per_s"], d["ingest_store_mb_per_million_rows"]
    )
    assert "| metrics ingest into SQLite |" in _summary(tmp_path)


def _summary(tmp_path: Path) -> str:
    return subprocess.run(
        [sys.executable, str(BENCH / "summary.py")],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, BENCH_RESULTS_DIR=str(tmp_path / "results")),
    ).stdout


def test_dashboard_benchmark(tmp_path: Path) -> None:
    d = run(tmp_path, "dashboard_load.py", "--trials", "20", "--points", "100")
    assert (d["trials"], d["points"]) == (20, 2000) and finite(d["page_s"], d["whole_rows_s"], d["ratio"])


def test_asha_scale_search_ends_throttled_with_arrays(tmp_path: Path) -> None:
    d = run(
        tmp_path,
        "asha_scale.py",
        "--trials",
        "12",
        "--concurrent",
        "4",
        "--budget-s",
        "300",
        "--poll-s",
        "1",
        "--idle-s",
        "2",
    )
    assert d["search_ended"] and d["experiment_state"] == "COMPLETED"
    assert d["trials"] == 12 and d["trial_states"] == {"COMPLETED": 12}
    # The trials a tick starts go as one array: at most one sbatch per tick, and the first four
    # trials share one.
    assert 1 <= d["sbatch_calls"] <= min(d["ticks"] + 1, 12 - 4 + 1)
    # One squeue per tick (the last may be counted before its stats line is written), and one
    # by `det e create`'s own first tick, which reads the queue for the user's room.
    assert d["rpcs_by_type"].get("REQUEST_JOB_INFO", 0) <= d["ticks"] + 2
    assert finite(d["tick_cpu_s_median"], d["describe_s"], d["store_mb"])
