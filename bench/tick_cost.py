"""Daemon tick cost: CPU of a tick with nothing new at N active trials, a tick ingesting M new
metric rows, and the daemon's memory, with no cluster (pure CPU of the controller).

Slurm is a stateful fake behind the real ``SlurmClient`` and ``SlurmExecutor``: sbatch hands out
array ids, squeue answers every task held (PENDING, JobHeldUser) in the format the parser reads
(``tests/data/slurm-22.05/squeue-array.txt``), so the tick parses a real-size squeue answer. The
store is SQLite on local disk. Goals: <= 50 ms of CPU per idle tick at 1000 trials,
<= 200 ms at 10,000; a tick ingesting N rows costs O(N); RSS at 10k trials <= 300 MB.

    python bench/tick_cost.py [--trials 1000,10000] [--ticks 5] [--rows 100,1000]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from _common import ROOT, save
from sqlalchemy import event, select

from detslurm.controller.apply import Reader
from detslurm.controller.changes import TickMemory
from detslurm.controller.controller import Controller
from detslurm.controller.create import execute_create, plan_create
from detslurm.controller.slurm_executor import SlurmExecutor
from detslurm.daemon import settle_heap
from detslurm.protocol import Batch, Event, ExitRecord, Metrics, OpCompleted, RunPaths, exit_record_of, read_lines
from detslurm.protocol.events import encode
from detslurm.slurm.client import Result, SlurmClient
from detslurm.slurm.parse import SEP, SQUEUE_FIELDS
from detslurm.slurm.site import SiteConfig
from detslurm.store import open_store
from detslurm.store.models import Experiment, Trial, TrialRun

SHOW_CONFIG = (ROOT / "tests/data/slurm-22.05/show-config.txt").read_text()


class FakeSlurm:
    """sbatch/squeue/scontrol as a held queue: every submitted task stays PENDING."""

    def __init__(self) -> None:
        self.next_id = 100
        self.tasks: list[tuple[str, str]] = []  # (job id, comment)
        self.calls: dict[str, int] = {}
        self._answer: Optional[str] = None

    def reset(self) -> None:
        """The queue changed: render squeue's answer again."""
        self._answer = None

    def __call__(
        self,
        argv: Sequence[str],
        *,
        input: Optional[str] = None,
        timeout: float,
        env: Optional[Mapping[str, str]] = None,
    ) -> Result:
        cmd = argv[0] if argv[0] != "scontrol" else f"scontrol {argv[1]}"
        self.calls[cmd] = self.calls.get(cmd, 0) + 1
        if cmd == "sbatch":
            return self._sbatch(argv)
        if cmd == "squeue":
            # Rendered once per change of the queue: the fake's own work must not count as the tick's.
            if self._answer is None:
                self._answer = "".join(self._record(j, c) for j, c in self.tasks)
            return Result(0, self._answer, "")
        if cmd == "scontrol show":
            return Result(0, SHOW_CONFIG, "")
        return Result(0, "", "")

    def _sbatch(self, argv: Sequence[str]) -> Result:
        self._answer = None
        job = self.next_id
        self.next_id += 1
        comment = next(a.split("=", 1)[1] for a in argv if a.startswith("--comment="))
        arr = next((a.split("=", 1)[1] for a in argv if a.startswith("--array=")), None)
        if arr is None:
            self.tasks.append((str(job), comment))
        else:
            for part in arr.split("%")[0].split(","):
                lo, _, hi = part.partition("-")
                self.tasks += [(f"{job}_{t}", comment) for t in range(int(lo), int(hi or lo) + 1)]
        return Result(0, f"{job}\n", "")

    @staticmethod
    def _record(job: str, comment: str) -> str:
        raw, _, task = job.partition("_")
        f = [job, raw, raw, task or "N/A", "PENDING", "cpu", "bench", "100", "JobHeldUser", "", "1", "1", "N/A"]
        f += ["2026-11-22T04:25:33", "N/A", "UNLIMITED", "0", "det-bench", comment, "0"]
        assert len(f) == len(SQUEUE_FIELDS)
        return SEP.join(f) + "\x1e"


def private_env(dir: Path) -> None:
    """Point this process's detslurm at a private store and dirs below ``dir``."""
    os.environ.update(
        DETSLURM_DATA_DIR=str(dir / "data"),
        DETSLURM_EXPERIMENTS_DIR=str(dir / "exps"),
        DETSLURM_CHECKPOINT_DIR=str(dir / "ck"),
        DETSLURM_CONFIG=str(dir / "none.yaml"),
    )


def build(
    dir: Path, trials: int, reader: Reader = read_lines, search: Optional[str] = None
) -> tuple[Controller, FakeSlurm, int]:
    """A store (from the DETSLURM_* environment) with one grid experiment of ``trials``
    trials, all submitted and held; ``reader`` is the controller's event-file reader;
    ``search``: the config's hyperparameters and searcher lines instead (YAML)."""
    from detslurm import settings

    if not os.environ.get("DETSLURM_DATA_DIR"):
        # Never the user's own store: its daemon would find thousands of "lost" jobs.
        sys.exit("tick_cost.build needs a private store: call private_env(dir) first")

    s = settings.load()
    ctx = dir / "ctx"
    ctx.mkdir()
    (ctx / "noop.py").write_text("pass\n")
    grid = f"""hyperparameters: {{x: {{type: int, minval: 0, maxval: {max(trials - 1, 1)}, count: {trials}}}}}
searcher: {{name: grid, metric: loss, max_length: {{batches: 1}}, max_concurrent_trials: {trials}}}
"""
    (ctx / "c.yaml").write_text(f"name: tick-{trials}\nentrypoint: python3 noop.py\n{search or grid}")
    store = open_store(s.db_url)
    exp_id = execute_create(store, s, plan_create(s, ctx / "c.yaml", ctx), "slurm")
    fake = FakeSlurm()
    ctl = Controller(store, SlurmExecutor(SlurmClient(fake, user="bench"), SiteConfig()), reader=reader)
    ctl.tick()  # submits every trial (job arrays) and records the job ids
    ctl.tick()  # first sight of the queue
    return ctl, fake, exp_id


class CountingReader:
    """The controller's event reader, counting the files it opens."""

    def __init__(self) -> None:
        self.opens = 0

    def __call__(self, path: Path, offset: int) -> Batch:
        self.opens += 1
        return read_lines(path, offset)


def cpu_per_tick(ctl: Controller, ticks: int, forget: bool = False) -> float:
    """Median process CPU seconds of one tick; ``forget``: with the controller's memory
    emptied first, as a restarted daemon's (or the periodic full) tick."""
    xs = []
    for _ in range(ticks):
        if forget:
            ctl.memory = TickMemory()
        t0 = time.process_time()
        ctl.tick()
        xs.append(time.process_time() - t0)
    xs.sort()
    return xs[len(xs) // 2]


def append_metrics(ctl: Controller, exp_id: int, rows: int) -> int:
    """``rows`` training-metric events, spread over the first trials' runs (10 rows a run);
    how many runs got rows."""
    with ctl.store.read() as s:
        dirs = [
            Path(d)
            for (d,) in s.execute(
                TrialRun.__table__.select()
                .with_only_columns(TrialRun.run_dir)
                .join(Trial.__table__)
                .where(Trial.experiment_id == exp_id)
                .order_by(TrialRun.id)
            )
        ]
    per_run = 10
    touched = set()
    for i in range(0, rows, per_run):
        path = RunPaths.from_run_dir(dirs[(i // per_run) % len(dirs)]).event_file(0)
        touched.add(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            for k in range(per_run):
                f.write(encode(Metrics(group="training", steps_completed=i + k, metrics={"loss": 0.5})))
    return len(touched)


class TrialLoads:
    """Counts the Trial rows the ORM builds (a SQLAlchemy ``load`` event): what a tick loads."""

    def __init__(self) -> None:
        self.count = 0
        event.listen(Trial, "load", self._loaded)

    def _loaded(self, target: Trial, context: Any) -> None:
        self.count += 1

    def close(self) -> None:
        event.remove(Trial, "load", self._loaded)


def nth_run(ctl: Controller, exp_id: int, n: int) -> tuple[Path, str]:
    """The run dir and job id of the experiment's ``n``-th run."""
    with ctl.store.read() as s:
        row = s.execute(
            select(TrialRun.run_dir, TrialRun.job_id)
            .join(Trial)
            .where(Trial.experiment_id == exp_id)
            .order_by(TrialRun.id)
            .offset(n)
            .limit(1)
        ).one()
    return Path(row[0]), str(row[1])


def append_event(run_dir: Path, ev: Event) -> None:
    path = RunPaths.from_run_dir(run_dir).event_file(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(encode(ev))


def end_job(fake: FakeSlurm, run_dir: Path, job: str) -> None:
    """The run's job ends with code 0: its exit record written, gone from the queue."""
    ExitRecord(code=0).write(exit_record_of(run_dir))
    fake.tasks = [(j, c) for j, c in fake.tasks if j != job]
    fake.reset()


def timed_tick(ctl: Controller, loads: TrialLoads) -> tuple[float, int]:
    """CPU seconds of one tick and how many Trial rows it loaded."""
    before = loads.count
    t0 = time.process_time()
    ctl.tick()
    return time.process_time() - t0, loads.count - before


def change_ticks(ctl: Controller, fake: FakeSlurm, exp_id: int, reps: int) -> dict[str, list[float]]:
    """Ticks whose change is one event: a validation report, an op completed, a trial ending
    (each on its own run, ``reps`` times); each [median CPU seconds, most Trial rows loaded]."""
    loads = TrialLoads()
    ticks: dict[str, list[tuple[float, int]]] = {"validation": [], "op_completed": [], "trial_ended": []}
    try:
        for i in range(reps):
            run_dir, _ = nth_run(ctl, exp_id, 3 * i)
            append_event(run_dir, Metrics(group="validation", steps_completed=1, metrics={"loss": 0.5 - i / 100}))
            ticks["validation"].append(timed_tick(ctl, loads))
            run_dir, _ = nth_run(ctl, exp_id, 3 * i + 1)
            append_event(run_dir, OpCompleted(index=0, length=1, metric=0.25))
            ticks["op_completed"].append(timed_tick(ctl, loads))
            run_dir, job = nth_run(ctl, exp_id, 3 * i + 2)
            end_job(fake, run_dir, job)
            ticks["trial_ended"].append(timed_tick(ctl, loads))
    finally:
        loads.close()
    return {k: [sorted(c for c, _ in v)[len(v) // 2], max(n for _, n in v)] for k, v in ticks.items()}


def measure(trials: int, ticks: int, rows: list[int]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-tick-") as tmp:
        t0 = time.perf_counter()
        private_env(Path(tmp))
        reader = CountingReader()
        ctl, fake, exp_id = build(Path(tmp), trials, reader)
        setup_s = time.perf_counter() - t0
        # As the daemon starts: what exists now stands for its start-up (settle_heap), then a
        # first tick with empty memory, whose marks and snapshots the collector does track.
        settle_heap()
        ctl.memory = TickMemory()
        ctl.tick()
        append_metrics(ctl, exp_id, 10)  # one run has an event file: idle ticks must not open it
        ctl.tick()
        squeues, opens = fake.calls.get("squeue", 0), reader.opens
        idle = cpu_per_tick(ctl, ticks)
        per_tick_squeue = (fake.calls.get("squeue", 0) - squeues) / ticks
        idle_opens = reader.opens - opens
        full = cpu_per_tick(ctl, max(1, ticks // 2), forget=True)
        ctl.tick()
        ingest: dict[str, float] = {}
        ingest_opens: dict[str, list[int]] = {}
        for n in rows:
            touched = append_metrics(ctl, exp_id, n)
            opens = reader.opens
            t1 = time.process_time()
            ctl.tick()
            ingest[str(n)] = time.process_time() - t1
            ingest_opens[str(n)] = [reader.opens - opens, touched]
        changed = change_ticks(ctl, fake, exp_id, ticks)
        with ctl.store.read() as s:
            assert s.get(Experiment, exp_id) is not None
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return {
            "trials": trials,
            "setup_s": setup_s,
            "idle_tick_cpu_s": idle,
            "full_tick_cpu_s": full,
            "idle_vs_full": idle / full if full else None,
            "squeue_per_tick": per_tick_squeue,
            "idle_tick_event_opens": idle_opens,
            "ingest_tick_cpu_s": ingest,
            # One event each: the step walks only the trial it changed ([CPU s, Trial rows loaded]).
            "change_tick": changed,
            "validation_tick_cpu_s": changed["validation"][0],
            "ingest_s_per_row": {n: v / int(n) for n, v in ingest.items() if int(n)},
            # [event files opened, runs whose files grew]
            "ingest_tick_event_opens": ingest_opens,
            "max_rss_mb": rss_mb,
        }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", default="1000")
    ap.add_argument("--ticks", type=int, default=5)
    ap.add_argument("--rows", default="100,1000")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r]
    out = [measure(int(n), args.ticks, rows) for n in args.trials.split(",")]
    for r in out:
        print(r, file=sys.stderr, flush=True)
    goals = {"1000": 0.05, "10000": 0.2}
    save("tick_cost", {"benchmark": "tick_cost", "ticks": args.ticks, "rows": out, "goal_idle_cpu_s": goals})
    return 0


if __name__ == "__main__":
    sys.exit(main())
