"""Trial-written input cannot hurt the controller: hostile event lines are
quarantined with a note on their trial, and every other run and experiment keeps going."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, write
from sqlalchemy import select

from detslurm import settings
from detslurm.controller.apply import ingest_run
from detslurm.controller.controller import Controller
from detslurm.controller.create import execute_create, plan_create
from detslurm.controller.local import LocalExecutor
from detslurm.protocol import ExpPaths, Metrics, encode
from detslurm.store import Metric, Trial, open_store
from detslurm.store.models import Experiment, ExperimentState, IngestOffset, LogEntry, TrialRun

# Malformed fields of each event type, plus an unknown type, a path-like checkpoint id and non-UTF-8 bytes.
HOSTILE = [
    b'{"type": "metrics", "group": "training", "steps_completed": "ten", "metrics": {}}',
    b'{"type": "metrics", "group": "training", "steps_completed": 1, "metrics": [1, 2]}',
    b'{"type": "checkpoint", "steps_completed": 1}',
    b'{"type": "progress", "progress": null}',
    b'{"type": "progress", "progress": "half"}',
    b'{"type": "op_completed", "index": "a", "length": 1, "metric": 0}',
    b'{"type": "checkpoint", "uuid": "../../x", "steps_completed": 1}',
    b'{"type": "telemetry", "cpu": 1}',
    b"\xff\xfe not even text",
    # Lone surrogates: no UTF-8 holds them (a TensorBoard tag, PostgreSQL text), escaped or as
    # CESU-8 bytes; in a metric's name, a status and a group.
    b'{"type": "metrics", "group": "training", "steps_completed": 2, "metrics": {"\\ud800": 0.5}}',
    b'{"type": "status", "state": "\\udfff"}',
    b'{"type": "metrics", "group": "\xed\xa0\x80", "steps_completed": 3, "metrics": {"loss": 0.5}}',
    b"x" * (2 << 20),  # longer than the reader's line limit
]

POISON_SCRIPT = f"""
import os
from detslurm.protocol import Metrics, RunPaths, encode

path = RunPaths.from_env(os.environ).event_file(0)
path.parent.mkdir(parents=True, exist_ok=True)
with open(path, "ab") as f:
    for line in {HOSTILE[:-1]!r}:
        f.write(line + b"\\n")
    f.write(b"x" * {len(HOSTILE[-1])} + b"\\n")
    f.write(encode(Metrics(group="validation", steps_completed=1, metrics={{"loss": 0.5}})).encode())
"""

GOOD_CONFIG = """
name: good
entrypoint: python3 train.py
hyperparameters: {lr: 0.1, noise: 0.1, sleep: 0.0}
searcher: {name: single, metric: validation_loss, smaller_is_better: true}
max_restarts: 0
"""


def _quarantined(s: Any, trial_id: int) -> int:
    notes = s.scalars(select(LogEntry.message).where(LogEntry.trial_id == trial_id).where(LogEntry.level == "WARNING"))
    return sum(int(m.group(1)) for n in notes if (m := re.match(r"quarantined (\d+) bad event line", n)))


@pytest.mark.e2e
def test_hostile_trial_cannot_stall_another_experiment(det_env: Path, tmp_path: Path) -> None:
    st = settings.load()
    store = open_store(st.db_url)
    poison_ctx = tmp_path / "poison"
    write(poison_ctx / "poison.py", POISON_SCRIPT)
    poison_cfg = write(
        tmp_path / "p.yaml", "name: p\nentrypoint: python3 poison.py\nsearcher: {name: single, metric: loss}"
    )
    bad = execute_create(store, st, plan_create(st, poison_cfg, poison_ctx), "local")
    good_cfg = write(tmp_path / "g.yaml", GOOD_CONFIG)
    good = execute_create(store, st, plan_create(st, good_cfg, EXAMPLES / "core_api"), "local")
    ctl = Controller(store, LocalExecutor(4))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ctl.tick()  # both experiments in every tick: this must never raise
        with store.tx() as s:
            states = [ExperimentState(s.get(Experiment, i).state) for i in (bad, good)]  # type: ignore[union-attr]
        if all(x.is_terminal for x in states):
            break
        time.sleep(0.1)
    assert states[1] == ExperimentState.COMPLETED, states
    with store.tx() as s:
        (gt,) = s.scalars(select(Trial).where(Trial.experiment_id == good))
        steps = s.scalars(
            select(Metric.steps_completed).where(Metric.trial_id == gt.id).where(Metric.group == "training")
        )
        assert sorted(steps) == list(range(1, 41))  # every metric of the good experiment
        (bt,) = s.scalars(select(Trial).where(Trial.experiment_id == bad))
        assert _quarantined(s, bt.id) == len(HOSTILE)
        # The valid line after the hostile ones still counts.
        assert list(s.scalars(select(Metric.group).where(Metric.trial_id == bt.id))) == ["validation"]


class ExplodingSearcher:
    """A searcher with a bug: it raises on every validation of one trial."""

    def __init__(self, victim: str) -> None:
        self.victim = victim

    def validation_completed(self, request_id: str, metrics: dict[str, Any], steps: int) -> list[Any]:
        if request_id == self.victim:
            raise RuntimeError("searcher bug")
        return []


def test_one_failing_event_costs_only_itself(det_env: Path, tmp_path: Path) -> None:
    st = settings.load()
    store = open_store(st.db_url)
    cfg = write(tmp_path / "c.yaml", "entrypoint: x\nsearcher: {name: single, metric: loss}")
    exp_id = execute_create(store, st, plan_create(st, cfg, tmp_path), "local")
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        first = exp.trials[0]
        second = Trial(experiment_id=exp_id, request_id="second", hparams={}, seed=2)
        s.add(second)
        s.flush()
        for t in (first, second):
            run_dir = ExpPaths(Path(exp.exp_dir)).run_dir(t.id, 1)
            s.add(TrialRun(trial_id=t.id, run_id=1, executor="local", run_dir=str(run_dir), log_path="-"))
            events = [Metrics(group="training", steps_completed=1, metrics={"loss": 1.0})]
            events += [Metrics(group="validation", steps_completed=1, metrics={"loss": 1.0})]
            events += [Metrics(group="training", steps_completed=2, metrics={"loss": float("nan")})]
            write(ExpPaths(Path(exp.exp_dir)).run(t.id, 1).event_file(0), "".join(encode(e) for e in events))
        victim = first.request_id
    with store.tx() as s:  # one experiment's tick: every run in one transaction
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        for t in exp.trials:
            ingest_run(s, exp, t, t.runs[0], ExplodingSearcher(victim))  # type: ignore[arg-type]
    with store.tx() as s:
        rows = {(r, g, n) for r, g, n in s.execute(_metric_rows())}
        assert rows == {
            (victim, "training", 1),
            (victim, "training", 2),  # after the failed event: still applied
            ("second", "training", 1),
            ("second", "validation", 1),
            ("second", "training", 2),
        }
        nan = s.scalar(select(Metric.metrics).where(Metric.steps_completed == 2).limit(1))
        assert nan == {"loss": "NaN"}  # stored in a form every database accepts
        (note,) = s.scalars(select(LogEntry.message).where(LogEntry.level == "WARNING"))
        assert "could not apply metrics: RuntimeError: searcher bug" in note
        assert all(o.offset > 0 for o in s.scalars(select(IngestOffset)))


def test_event_files_the_writer_never_makes_are_refused_with_a_note(det_env: Path, tmp_path: Path) -> None:
    """A FIFO, a directory or a symlink in place of an event file is noted once and never read
    (a FIFO would hang the daemon's open); a file that shrank below what was read is read
    on from the end of its last whole line, with a note. The run's other files are ingested all
    along."""
    st = settings.load()
    store = open_store(st.db_url)
    cfg = write(tmp_path / "c.yaml", "entrypoint: x\nsearcher: {name: single, metric: loss}")
    exp_id = execute_create(store, st, plan_create(st, cfg, tmp_path), "local")
    line = lambda n: encode(Metrics(group="training", steps_completed=n, metrics={"loss": 1.0}))  # noqa: E731
    with store.tx() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        t = exp.trials[0]
        paths = ExpPaths(Path(exp.exp_dir)).run(t.id, 1)
        s.add(TrialRun(trial_id=t.id, run_id=1, executor="local", run_dir=str(paths.dir), log_path="-"))
    first = line(1)  # once: each encode stamps its own time, and the length with it
    write(paths.event_file(0), first + line(2))
    os.mkfifo(paths.event_file(1))
    paths.event_file(2).mkdir()
    paths.event_file(3).symlink_to(paths.event_file(0))

    def tick() -> None:
        with store.tx() as s:
            exp = s.get(Experiment, exp_id)
            assert exp is not None
            t = exp.trials[0]
            ingest_run(s, exp, t, t.runs[0], ExplodingSearcher("none"))  # type: ignore[arg-type]

    done = threading.Event()
    threading.Thread(target=lambda: (tick(), done.set()), daemon=True).start()
    assert done.wait(30), "the tick hung on the FIFO"
    tick()  # refused files stay refused, without a second note
    os.truncate(paths.event_file(0), len(first.encode()))  # it lost its tail (a crashed NFS server)
    tick()
    with open(paths.event_file(0), "a") as f:  # and the writer appends after what is left
        f.write(line(3))
    tick()
    with store.tx() as s:
        steps = sorted(s.scalars(select(Metric.steps_completed)))
        notes = list(s.scalars(select(LogEntry.message).where(LogEntry.level == "WARNING")))
    assert steps == [1, 2, 3]
    assert sorted(n.split(" of run")[0] for n in notes if "is not read" in n) == [
        "event file rank-1.jsonl",
        "event file rank-2.jsonl",
        "event file rank-3.jsonl",
    ]
    assert any("is a FIFO" in n for n in notes) and any("is a directory" in n for n in notes)
    assert steps == [1, 2, 3]  # nothing read twice
    assert any("rank-0.jsonl of run 1 shrank below the" in n and "end of its last whole line" in n for n in notes)


def _metric_rows() -> Any:
    return select(Trial.request_id, Metric.group, Metric.steps_completed).join(Trial, Trial.id == Metric.trial_id)


POISON_SLURM = f"""
import os
from detslurm.protocol import Metrics, RunPaths, encode

path = RunPaths.from_env(os.environ).event_file(0)
path.parent.mkdir(parents=True, exist_ok=True)
with open(path, "ab") as f:
    for line in {HOSTILE[:-1]!r}:
        f.write(line + b"\\n")
    for _ in range(100):  # 100 MiB without a newline, then the good report
        f.write(b"x" * (1 << 20))
    f.write(b"\\n")
    f.write(encode(Metrics(group="validation", steps_completed=1, metrics={{"loss": 0.5}})).encode())
"""


@pytest.mark.slurm
@pytest.mark.security
def test_hostile_trial_on_slurm_cannot_stall_another_experiment(slurm_env: Path, det: Any, tmp_path: Path) -> None:
    """The same on the cluster, driven by the daemon, with a 100 MiB line."""
    write(tmp_path / "poison/poison.py", POISON_SLURM)
    bad_cfg = write(
        tmp_path / "p.yaml", "name: p\nentrypoint: python3 poison.py\nsearcher: {name: single, metric: loss}"
    )
    good_cfg = write(tmp_path / "g.yaml", GOOD_CONFIG)
    assert det("e", "create", bad_cfg, tmp_path / "poison")[0] == 0
    assert det("e", "create", good_cfg, EXAMPLES / "core_api")[0] == 0
    code, out, err = det("e", "wait", "2")
    assert code == 0, out + err
    code, out, err = det("e", "wait", "1")
    assert code == 0, out + err  # its one good report after the garbage completes it
    store = open_store(settings.load().db_url)
    with store.read() as s:
        (gt,) = s.scalars(select(Trial).where(Trial.experiment_id == 2))
        steps = s.scalars(
            select(Metric.steps_completed).where(Metric.trial_id == gt.id).where(Metric.group == "training")
        )
        assert sorted(steps) == list(range(1, 41))
        (bt,) = s.scalars(select(Trial).where(Trial.experiment_id == 1))
        assert _quarantined(s, bt.id) == len(HOSTILE)
