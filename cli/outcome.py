"""How an experiment or a trial ended, as the console shows it (`det e create`, `det e wait`).

A failure is told where the user is looking: why it ended, the failing trial's last traceback
lines, and the command that shows the rest. Trial output is untrusted: every line of it is made
printable (``detslurm.util.printable``) before it reaches the terminal.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from detslurm.cli.app import App
from detslurm.cli.logs import file_tail, tail
from detslurm.store.states import ExperimentState, TrialState
from detslurm.util import printable

# Of a trial's output, the last SCANNED lines are searched for a traceback; at most SHOWN lines
# of it are printed (its end: the exception is last). Without a traceback, the last FALLBACK lines.
SCANNED = 400
SHOWN = 20
FALLBACK = 10
# Failed trials told in full at the end of `det e wait`; the others are counted.
TRIALS_TOLD = 3
_TRACEBACK = "Traceback (most recent call last):"


def last_traceback(lines: list[str]) -> list[str]:
    """The last traceback in ``lines`` (its last SHOWN lines), else the last FALLBACK lines."""
    starts = [i for i, line in enumerate(lines) if _TRACEBACK in line]
    if not starts:
        return lines[-FALLBACK:]
    return lines[starts[-1] :][-SHOWN:]


def trial_failure(app: App, trial: dict[str, Any]) -> list[str]:
    """``trial N: ERROR (why)``, its last traceback lines, and where the rest of its logs is."""
    tid = trial["id"]
    why = trial.get("exit_reason")
    out = [f"trial {tid}: {trial['state'].value}" + (f" ({printable(why)})" if why else "")]
    runs, _ = app.reads.trial_logs(tid, app.scope.owner)
    last = next((r for r in reversed(runs) if r.log_path and Path(r.log_path).is_file()), None)
    if last is not None:
        out += [f"  | {printable(line)}" for line in last_traceback(file_tail(Path(last.log_path), SCANNED))]
    out.append(f"  The trial's whole output and detslurm's notes: det trial logs {tid}")
    return out


def after_follow(app: App, exp_id: int) -> list[str]:
    """After `det e create --follow` streamed the first trial: why it failed, and why the
    experiment fails (a searcher error), if they did."""
    out: list[str] = []
    first = app.reads.first_trial_id(exp_id, app.scope.owner)
    trial = app.reads.trial(first, app.scope.owner) if first is not None else None
    if trial is not None and trial["state"] == TrialState.ERROR:
        why = trial.get("exit_reason")
        out.append(f"trial {first}: ERROR" + (f" ({printable(why)})" if why else ""))
    e, _ = app.reads.experiment(exp_id, app.scope.owner)
    if e.get("error") and e["state"] in (ExperimentState.ERROR, ExperimentState.STOPPING_ERROR):
        out.append(f"Experiment {exp_id} {e['state'].value}: {printable(str(e['error']))}")
    return out


def experiment_end(app: App, exp_id: int, state: ExperimentState, *, trials: bool) -> list[str]:
    """``Experiment N STATE``; for an error, why, and with ``trials`` the failed trials' stories
    (a driver that printed them as they failed passes False)."""
    out = [f"Experiment {exp_id} {state.value}"]
    if state != ExperimentState.ERROR:
        return out
    e, _ = app.reads.experiment(exp_id, app.scope.owner)
    if e.get("error"):
        out.append(f"  {printable(str(e['error']))}")
    if trials:
        failed = [t for t in app.reads.trial_dicts(exp_id, app.scope.owner) if t["state"] == TrialState.ERROR]
        for t in failed[:TRIALS_TOLD]:
            out += trial_failure(app, t)
        if len(failed) > TRIALS_TOLD:
            out.append(f"  ... and {len(failed) - TRIALS_TOLD} more failed trials: det experiment list-trials {exp_id}")
    return out


# What a test-mode trial must do, by what the store records of it.
_TESTED = (("training", "training metrics"), ("validation", "validation metrics"), ("checkpoint", "a checkpoint"))
# How test mode decides its length: the config `det e create --test` stores (controller/create.py,
# test_mode_config), the same as Determined's --test.
TEST_LENGTH = (
    "Test mode runs one trial with searcher.max_length {batches: 1}, min_validation_period {batches: 1} and "
    "max_restarts 0, as Determined's --test does: the Trainer trains 1 batch, validates and checkpoints; a Core "
    "API script that reads op.length from ctx.searcher.operations() is told 1, so it must report training "
    "metrics, validate and checkpoint within its first batch (reports made only every N batches never come); "
    "a script that picks its own length runs all of it."
)


def test_verdict(app: App, exp_id: int, state: ExperimentState) -> tuple[int, list[str]]:
    """`det e create --test`'s verdict: 0 and a success line when the one trial reported training
    metrics, validation metrics and a checkpoint, then exited 0; else 1 and what was seen, what was
    missing, how test mode decides its length, and the trial's last lines."""
    trials = app.reads.trial_dicts(exp_id, app.scope.owner)
    if not trials:
        return 1, [f"Model definition test failed: experiment {exp_id} ended {state.value} before its trial started."]
    trial = trials[0]
    tid = trial["id"]
    seen = _test_reports(app, exp_id, tid)
    # COMPLETED alone is not enough: a script that exits 0 without training, validating and
    # checkpointing would pass. The controller marks "test_done" once it has seen all three.
    if state == ExperimentState.COMPLETED and all(seen.values()):
        return 0, ["Model definition test succeeded! 🎉"]
    got = [f"{what} ({seen[key]})" for key, what in _TESTED if seen[key]]
    missing = [what for key, what in _TESTED if not seen[key]]
    ended = f"trial {tid} ended {trial['state'].value}" + (
        f" ({printable(r)})" if (r := trial.get("exit_reason")) else ""
    )
    out = [
        "Model definition test failed: the trial must report training metrics, validation metrics and a checkpoint, "
        "then exit 0.",
        f"  {ended}; it reported "
        + (", ".join(got) if got else "nothing")
        + "."
        + (f" Missing: {', '.join(missing)}." if missing else ""),
        f"  {TEST_LENGTH}",
        f"Trial logs (the last 40 lines; det trial logs {tid} shows all):",
    ]
    return 1, out + [printable(line) for line in tail(app, tid, 40)]


def _test_reports(app: App, exp_id: int, trial_id: int) -> dict[str, int]:
    """How many training and validation reports and checkpoints the trial made (a test-mode
    trial is one short run: reading its reports is cheap)."""
    groups = Counter(m["group"] for m in app.reads.metrics(trial_id))
    cks = sum(1 for c in app.reads.checkpoint_dicts(exp_id, app.scope.owner) if c["trial_id"] == trial_id)
    return {"training": groups["training"], "validation": groups["validation"], "checkpoint": cks}
