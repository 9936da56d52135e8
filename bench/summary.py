"""Print the current results (bench/results/*.json) as the table in bench/README.md."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


Row = tuple[str, str, str, bool]

# Each benchmark's result file and the table rows it gives (a file that is missing gives none).
TABLE: list[tuple[str, Callable[[dict[str, Any]], list[Row]]]] = [
    (
        "slurmctld_load",
        lambda d: [
            (
                f"slurmctld load, {r['jobs']} jobs",
                f"{r['detslurm_job_queries_per_tick']:.0f} job query "
                f"({r['detslurm_rpcs_per_tick']:.0f} RPCs) per tick vs {r['per_job_job_queries_per_tick']:.0f} "
                f"({r['per_job_rpcs_per_tick']:.0f} RPCs) polling per job"
                + (" (estimated)" if r.get("per_job_estimated") or "estimated" in r["per_job_by_type"] else "")
                + (f"; tick {r['detslurm_tick_cpu_s'] * 1000:.0f} ms CPU" if "detslurm_tick_cpu_s" in r else ""),
                "1 query per tick",
                r["detslurm_job_queries_per_tick"] <= 1,
            )
            for r in d["rows"]
        ],
    ),
    (
        "asha_scale",
        lambda d: [
            (
                f"ASHA search on Slurm, {d['trials']} of up to {d['max_trials']} trials in {d['elapsed_s']:.0f} s",
                f"daemon's commands {d['daemon_rpcs_per_min']:.0f} RPCs/min (poll {d['poll_s']:g} s; all of "
                f"slurmctld {d['rpcs_per_min']:.0f}/min, mostly the jobs' own completions), "
                f"{d['sbatch_calls']} sbatch, {d['trial_states'].get('COMPLETED', 0)} completed, tick CPU "
                f"{d['tick_cpu_s_median'] * 1000:.0f} ms median / {d['tick_cpu_s_max'] * 1000:.0f} ms max, "
                f"store {d['store_mb']:.1f} MiB, det e describe {d['describe_s']:.2f} s",
                "< 60 RPCs/min",
                d["daemon_rpcs_per_min"] < d["goal_rpcs_per_min"],
            )
        ],
    ),
    (
        "tick_cost",
        lambda d: [
            row
            for r in d["rows"]
            for row in (
                (
                    f"daemon tick, nothing new, {r['trials']} held trials",
                    f"{r['idle_tick_cpu_s'] * 1000:.0f} ms CPU ({r['idle_vs_full']:.2f}x a full tick, "
                    f"{r['full_tick_cpu_s']:.2f} s); {r['idle_tick_event_opens']} event files opened",
                    "<= 50 ms (1000), <= 200 ms (10,000)",
                    r["idle_tick_cpu_s"] <= (0.05 if r["trials"] <= 1000 else 0.2),
                ),
                (
                    f"daemon tick ingesting N rows, {r['trials']} trials",
                    ", ".join(f"{n} rows {v:.2f} s" for n, v in r["ingest_tick_cpu_s"].items()),
                    "O(N)",
                    True,
                ),
                (
                    f"daemon tick with one validation report, {r['trials']} trials",
                    f"{r['validation_tick_cpu_s']:.2f} s CPU (a full step of the experiment)",
                    "O(change)",
                    False,
                ),
                (
                    f"daemon memory, {r['trials']} trials",
                    f"{r['max_rss_mb']:.0f} MB",
                    "<= 300 MB",
                    r["max_rss_mb"] <= 300,
                ),
            )
        ],
    ),
    (
        "submission",
        lambda d: [
            (
                f"submission, {d['trials']}-trial grid",
                f"{max(d['detslurm_sbatch_calls'])} sbatch; "
                f"{d['median_s']['detslurm']:.2f} s vs submitit {d['median_s']['submitit']:.2f} s "
                f"({d['ratio_vs_submitit']:.2f}x), sbatch loop {d['median_s']['sbatch_loop']:.2f} s",
                "<= 2 sbatch, <= 1.0x submitit",
                max(d["detslurm_sbatch_calls"]) <= 2 and d["ratio_vs_submitit"] <= 1.0,
            )
        ],
    ),
    (
        "launch_overhead",
        lambda d: [
            (
                "launch overhead, 2 nodes",
                f"{d['ratio']:.2f}x raw srun torchrun (medians of {d['repeats']})",
                "<= 1.05x",
                d["ratio"] <= d.get("goal_ratio_max", 1.05),
            )
        ],
    ),
    (
        "fail_fast",
        lambda d: [
            (
                "fail-fast, 2 nodes x 2 ranks, one rank exits 3",
                f"{d['detslurm_median_s']:.1f} s from the failure to the job's end vs {d['plain_median_s']:.1f} s for "
                f"srun --kill-on-bad-exit torchrun ({d['ratio']:.2f}x, medians of {len(d['detslurm_s'])})",
                "< 1.0x",
                d["ratio"] < 1.0,
            )
        ],
    ),
    (
        "trainer_overhead",
        lambda d: [
            (
                "Trainer vs hand loop",
                f"{d['ratio_of_medians']:.2f}x (medians), {d['ratio']:.2f}x (best-of)",
                ">= 0.97x",
                d["ratio_of_medians"] >= 0.97,
            ),
            (
                "report_training_metrics",
                f"{d['report_training_metrics_us_per_call']:.1f} us/call",
                "< 20 us",
                d["report_training_metrics_us_per_call"] < 20,
            ),
        ],
    ),
    (
        "checkpoint_io",
        lambda d: [
            (
                f"checkpoint save, {d['mb']} MB",
                f"{d['save_throughput_ratio']:.2f}x torch.save",
                ">= 0.9x",
                d["save_throughput_ratio"] >= 0.9,
            ),
            (
                f"checkpoint restore, {d['mb']} MB",
                f"{d['restore_throughput_ratio']:.2f}x torch.load",
                ">= 0.9x",
                d["restore_throughput_ratio"] >= 0.9,
            ),
        ],
    ),
    (
        "search_efficiency",
        lambda d: [
            (
                "search: adaptive_asha",
                f"{d['asha_ratio_median']:.2f} of random search's compute, 16 at a time "
                f"({d['seeds']} seeds); one at a time, aggressive: "
                f"{d.get('asha_aggressive_one_at_a_time_ratio_median', float('nan')):.2f} vs Optuna SHA "
                f"{d['optuna_sha_ratio_median']:.2f}",
                "<= 0.33",
                d["asha_ratio_median"] <= 1 / 3,
            )
        ],
    ),
    (
        "cli_latency",
        lambda d: (
            [
                (
                    "det --help",
                    f"{d['median_s']['det_help']:.2f} s ({d['help_ratio_vs_import_click']:.2f}x import click)",
                    "<= 0.15 s",
                    d["median_s"]["det_help"] <= 0.15,
                ),
                (
                    f"det e list, {d['experiments']} experiments",
                    f"{d['median_s']['det_e_list']:.2f} s ({d['e_list_ratio_vs_raw_sqlite']:.1f}x raw sqlite3)",
                    "<= 0.3 s",
                    d["median_s"]["det_e_list"] <= 0.3,
                ),
            ]
            + (
                [
                    (
                        f"det t logs --tail 100, {d['log_mib']} MiB log",
                        f"{d['median_s']['det_t_logs_tail']:.2f} s ({d['t_logs_tail_ratio_vs_tail']:.1f}x tail -n)",
                        "<= 0.1 s",
                        d["median_s"]["det_t_logs_tail"] <= 0.1,
                    )
                ]
                if "det_t_logs_tail" in d["median_s"]
                else []
            )
            + (
                [
                    (
                        f"det job list, {d['jobs']} jobs",
                        f"{d['median_s']['det_job_list']:.2f} s ({d['job_list_ratio_vs_squeue']:.1f}x squeue -r)",
                        "<= 3x squeue",
                        d["job_list_ratio_vs_squeue"] <= 3.0,
                    )
                ]
                if d.get("jobs")
                else []
            )
        ),
    ),
    (
        "dashboard_load",
        lambda d: [
            (
                f"dashboard experiment page, {d['trials']} trials / {d['points'] // 1000}k points",
                f"{d['page_s']:.2f} s, {d.get('page_cpu_s', float('nan')):.2f} s CPU "
                f"(reading the rows whole: {d['whole_rows_s']:.2f} s, {d['ratio']:.2f}x)",
                "< 2 s",
                d["page_s"] < d["goal_s"],
            )
        ],
    ),
    (
        "store_scale",
        lambda d: [
            (
                "metrics ingest into SQLite",
                f"{d['ingest_rows_per_s']:,.0f} rows/s ({d['ingest_ratio_vs_raw']:.2f}x a bare executemany, "
                f"{d['raw_executemany_rows_per_s']:,.0f} rows/s)",
                ">= 100k rows/s",
                d["ingest_rows_per_s"] >= 100_000,
            ),
            (
                f"det e describe, {d['metric_rows']:,} metric rows",
                f"{d['median_s']['det_e_describe']:.2f} s",
                "<= 0.5 s",
                d["median_s"]["det_e_describe"] <= 0.5,
            ),
            (
                f"curve query, {d['metric_rows']:,} metric rows ({d['curve_trial_validation_rows']:,} in the curve)",
                f"{d['median_s']['curve_query'] * 1000:.0f} ms, {d['curve_points']} points",
                "<= 0.5 s",
                d["median_s"]["curve_query"] <= 0.5,
            ),
            (
                "store size per million metric rows",
                "n/a" if d["store_mb_per_million_rows"] is None else f"{d['store_mb_per_million_rows']:.0f} MiB",
                "shown",
                True,
            ),
        ],
    ),
]


def rows() -> list[Row]:
    out: list[Row] = []
    for name, fn in TABLE:
        d = load(name)
        if d is not None:
            out.extend(fn(d))
    return out


def main() -> int:
    print("| benchmark | measured | goal | met |\n|---|---|---|---|")
    for name, measured, goal, met in rows():
        print(f"| {name} | {measured} | {goal} | {'yes' if met else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
