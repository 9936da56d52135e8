"""Search efficiency on a deterministic suite of synthetic learning curves (no cluster needed).

For each of S seeds: random search trains N configurations fully (max_time T each); its best
final metric is the target. adaptive_asha (detslurm's searcher, driven through the same
interface the controller uses, W trials at a time) and Optuna's SuccessiveHalvingPruner with a
RandomSampler (same suite, same validation period) run until one of their validations reaches
the target. Reported: their compute (units trained, summed over trials) over random search's
N*T. Goal for adaptive_asha: <= 1/3 (median over seeds).

    python bench/search_efficiency.py [--seeds S] [--random-trials N] [--max-time T]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from typing import Any

from _common import save

from detslurm.expconf import ExperimentConfig, validate
from detslurm.searcher import Create, Shutdown, Stop, build

HPARAMS = {
    "lr": {"type": "log", "minval": -4, "maxval": 0},
    "width": {"type": "int", "minval": 8, "maxval": 256},
    "dropout": {"type": "double", "minval": 0.0, "maxval": 0.6},
}


def curve(hp: dict[str, Any], t: int, seed: int) -> float:
    """Validation loss after t units: a power-law approach (as measured learning curves follow)
    to a floor set by the hparams. The learning rate sets the rate and wide models learn more
    slowly early on, so curves cross; the noise is deterministic and shrinks with training."""
    lr = hp["lr"]
    floor = (
        0.1
        + 0.12 * (math.log10(lr) + 1.8) ** 2
        + 0.02 * (math.log2(hp["width"]) - 7) ** 2
        + 0.5 * (hp["dropout"] - 0.2) ** 2
    )
    rate = 0.35 + 0.5 / (1 + math.exp(-2 * (math.log10(lr) + 2))) - 0.1 * (math.log2(hp["width"]) - 3) / 5
    noise = random.Random(seed * 1_000_003 + t).gauss(0, 0.02) / math.sqrt(1 + t)
    return floor + 1.5 * (1 + t) ** (-rate) + noise


def config(
    name: str, seed: int, max_trials: int, max_time: int, workers: int, mode: str = "standard"
) -> ExperimentConfig:
    raw: dict[str, Any] = {
        "name": "bench",
        "entrypoint": "x",
        "hyperparameters": HPARAMS,
        "reproducibility": {"experiment_seed": seed},
        "searcher": {
            "name": name,
            "metric": "loss",
            "max_trials": max_trials,
            "max_time": max_time,
            "time_metric": "batches",
            "max_concurrent_trials": workers,
            "mode": mode,
        },
    }
    if name == "random":
        raw["searcher"] = {
            "name": "random",
            "metric": "loss",
            "max_trials": max_trials,
            "max_length": {"batches": max_time},
            "max_concurrent_trials": workers,
        }
    return validate(raw, {"type": "shared_fs", "host_path": "/tmp"})


def random_target(seed: int, n: int, max_time: int) -> float:
    s = build(config("random", seed, n, max_time, n))
    finals = [curve(a.hparams, max_time, a.seed) for a in s.initial_trials() if isinstance(a, Create)]
    return min(finals)


def asha_compute(
    seed: int, target: float, max_trials: int, max_time: int, workers: int, period: int, mode: str = "standard"
) -> float | None:
    """Units trained when a validation first reaches ``target`` (None: never). W trials at a
    time; each validates every ``period`` units and stops when the searcher says so."""
    s = build(config("adaptive_asha", seed + 7919, max_trials, max_time, workers, mode))
    pending = [a for a in s.initial_trials() if isinstance(a, Create)]
    running: dict[str, list[Any]] = {}  # rid -> [hparams, seed, units]
    used = 0
    while pending or running:
        while pending and len(running) < workers:
            a = pending.pop(0)
            running[a.request_id] = [a.hparams, a.seed, 0]
        for rid in list(running):
            hp, tseed, units = running[rid]
            running[rid][2] = units = units + 1
            used += 1
            if units % period and units < max_time:
                continue
            loss = curve(hp, units, tseed)
            if loss <= target:
                return float(used)
            actions = s.validation_completed(rid, {"loss": loss, "batches": units}, units)
            if units >= max_time or any(isinstance(x, Stop) and x.request_id == rid for x in actions):
                del running[rid]
                actions += s.trial_exited(rid)
            pending += [x for x in actions if isinstance(x, Create)]
            if any(isinstance(x, Shutdown) for x in actions):
                return None
    return None


def optuna_compute(seed: int, target: float, max_trials: int, max_time: int, period: int) -> float | None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(
        sampler=optuna.samplers.RandomSampler(seed=seed + 104729),
        pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=period, reduction_factor=4),
    )
    used = 0
    for _ in range(max_trials):
        trial = study.ask()
        hp = {
            "lr": trial.suggest_float("lr", 1e-4, 1.0, log=True),
            "width": trial.suggest_int("width", 8, 256),
            "dropout": trial.suggest_float("dropout", 0.0, 0.6),
        }
        tseed = trial.number + seed * 7
        loss = math.inf
        for units in range(period, max_time + 1, period):
            used += period
            loss = curve(hp, units, tseed)
            if loss <= target:
                return float(used)
            trial.report(loss, units)
            if trial.should_prune():
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                break
        else:
            study.tell(trial, loss)
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=50)
    ap.add_argument("--random-trials", type=int, default=64)
    ap.add_argument("--max-time", type=int, default=64)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--period", type=int, default=1)
    args = ap.parse_args()
    budget = args.random_trials * args.max_time
    rows = []
    for seed in range(args.seeds):
        target = random_target(seed, args.random_trials, args.max_time)
        a = asha_compute(seed, target, 8 * args.random_trials, args.max_time, args.workers, args.period)
        g = asha_compute(seed, target, 8 * args.random_trials, args.max_time, args.workers, args.period, "aggressive")
        one = asha_compute(seed, target, 8 * args.random_trials, args.max_time, 1, args.period)
        one_g = asha_compute(seed, target, 8 * args.random_trials, args.max_time, 1, args.period, "aggressive")
        o = optuna_compute(seed, target, 8 * args.random_trials, args.max_time, args.period)
        rows.append(
            {
                "seed": seed,
                "target": target,
                "asha": a,
                "asha_aggressive": g,
                "asha_one_at_a_time": one,
                "asha_aggressive_one_at_a_time": one_g,
                "optuna": o,
            }
        )

    def ratio(key: str) -> float:
        # A search that never reached the target counts as the whole random-search budget.
        return statistics.median([(r[key] if r[key] is not None else budget) / budget for r in rows])

    save(
        "search_efficiency",
        {
            "benchmark": "search_efficiency",
            "seeds": args.seeds,
            "random_trials": args.random_trials,
            "max_time": args.max_time,
            "workers": args.workers,
            "random_compute": budget,
            "asha_ratio_median": ratio("asha"),
            "asha_aggressive_ratio_median": ratio("asha_aggressive"),
            "asha_one_at_a_time_ratio_median": ratio("asha_one_at_a_time"),
            "asha_aggressive_one_at_a_time_ratio_median": ratio("asha_aggressive_one_at_a_time"),
            "optuna_sha_ratio_median": ratio("optuna"),
            "asha_reached": sum(r["asha"] is not None for r in rows),
            "optuna_reached": sum(r["optuna"] is not None for r in rows),
            "goal_asha_ratio_max": 1 / 3,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
