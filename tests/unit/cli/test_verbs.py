"""The everyday verbs on local experiments and as pure logic: archive, labels, set, list
filters and machine outputs, fork, continue, downloads, checkpoint delete/rm, log filters,
the polling floor of reads, priorities in sbatch, and an example under every --help."""

from __future__ import annotations

import csv
import importlib
import io
import json
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import click
import pytest
from conftest import EXAMPLES

from detslurm.cli.log_filter import LogFilter, line_level, parse_time
from detslurm.store import open_store

CORE = EXAMPLES / "core_api"
# Ten batches, a checkpoint and a validation every five: a quick experiment to work on.
QUICK = (
    "--config",
    "hyperparameters.sleep=0",
    "--config",
    "environment.environment_variables=[EXAMPLE_TOTAL_BATCHES=10]",
)


def create(det: Any, *extra: str) -> None:
    code, out, err = det("e", "create", "--local", CORE / "const.yaml", CORE, *QUICK, *extra)
    assert code == 0, (out, err)


def describe(det: Any, exp_id: int) -> dict[str, Any]:
    code, out, err = det("e", "describe", str(exp_id), "--json")
    assert code == 0, err
    return dict(json.loads(out)[0])


def test_archive_labels_set_and_list_filters(det: Any) -> None:
    create(det)
    code, out, err = det("e", "create", "--local", "--paused", CORE / "const.yaml", CORE)
    assert code == 0, err
    # Only an ended experiment can be archived (as in Determined).
    code, _, err = det("e", "archive", "2")
    assert code != 0 and "only an ended experiment can be archived" in err
    assert det("e", "archive", "1") == (0, "Archived experiment 1\n", "")
    code, out, _ = det("e", "list")
    assert [r.split("|")[0].strip() for r in out.splitlines()[2:]] == ["2"]
    code, out, _ = det("e", "list", "--all", "--csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["ID"], r["Archived"]) for r in rows] == [("1", "True"), ("2", "False")]
    assert det("e", "unarchive", "1")[1] == "Unarchived experiment 1\n"

    assert det("e", "label", "add", "1", "baseline")[0] == 0
    assert det("e", "label", "add", "1", "v2")[0] == 0
    assert det("e", "label", "remove", "1", "v2")[0] == 0
    assert describe(det, 1)["experiment"]["labels"] == ["baseline"]
    code, out, _ = det("e", "list", "--label", "baseline", "--json")
    assert [e["id"] for e in json.loads(out)] == [1]
    code, out, _ = det("e", "list", "--state", "paused", "--csv")
    assert [r["ID"] for r in csv.DictReader(io.StringIO(out))] == ["2"]

    assert det("e", "set", "description", "1", "first try")[0] == 0
    assert det("e", "set", "name", "1", "renamed")[0] == 0
    e = describe(det, 1)["experiment"]
    assert (e["description"], e["name"]) == ("first try", "renamed")
    code, out, _ = det("e", "list", "--name", "RENAM", "--json")
    assert [x["id"] for x in json.loads(out)] == [1]
    for key, value in (("priority", "60"), ("weight", "2.5"), ("max-slots", "3")):
        assert det("e", "set", key, "1", value)[0] == 0
    resources = json.loads(json.dumps(__import__("yaml").safe_load(det("e", "config", "1")[1])["resources"]))
    assert (resources["priority"], resources["weight"], resources["max_slots"]) == (60, 2.5, 3)
    code, out, err = det("e", "set", "priority", "1", "100")
    assert code == 2 and "100 is not in the range" in out + err
    code, _, err = det("e", "label", "add", "9", "x")
    assert code != 0 and "experiment 9 not found" in err


def test_fork_reuses_the_context_with_overrides(det: Any, tmp_path: Path) -> None:
    create(det)
    code, out, err = det("e", "fork", "1", "--config", "hyperparameters.lr=0.2")
    assert code == 0 and "Created experiment 2 (forked from experiment 1)" in out, (out, err)
    parent, child = describe(det, 1), describe(det, 2)
    assert child["experiment"]["parent_id"] == 1 and child["experiment"]["state"] == "COMPLETED"
    assert child["experiment"]["context_sha256"] == parent["experiment"]["context_sha256"]
    assert child["trials"][0]["hparams"]["lr"] == 0.2 and parent["trials"][0]["hparams"]["lr"] == 0.1
    code, _, err = det("e", "fork", "1", "--config", "searcher.name=nope")
    assert code != 0 and "searcher" in err
    # --config-file is laid over the parent's config: only the keys it names change.
    patch = tmp_path / "patch.yaml"
    patch.write_text("hyperparameters: {lr: 0.3}\n")
    code, out, err = det("e", "fork", "1", "--config-file", patch, "--paused")
    assert code == 0 and "Created experiment 3" in out, err
    hp = describe(det, 3)["trials"][0]["hparams"]
    assert (hp["lr"], hp["noise"]) == (0.3, 0.1)


def test_continue_trains_the_same_trial_on_from_its_checkpoint(det: Any) -> None:
    create(det)
    before = describe(det, 1)["trials"][0]
    assert before["batches"] == 10 and before["state"] == "COMPLETED"
    longer = "environment.environment_variables=[EXAMPLE_TOTAL_BATCHES=20]"
    code, out, err = det("e", "continue", "1", "--config", longer)
    assert code == 0 and "Continued experiment 1" in out and "Experiment 1 COMPLETED" in out, (out, err)
    (after,) = describe(det, 1)["trials"]
    # Same trial id, one more run, resumed from batch 10 (not trained again from 0).
    assert (after["id"], after["batches"], after["runs"], after["restarts"]) == (before["id"], 20, 2, 0)
    code, out, _ = det("t", "logs", str(after["id"]), "--tail", "30")
    assert "done: w=" in out and "after 20 batches" in out
    code, _, err = det("e", "create", "--local", "--paused", CORE / "adaptive.yaml", CORE)
    code, _, err = det("e", "continue", "2")
    assert code != 0 and "Unsupported searcher type provided: 'adaptive_asha'" in err


def test_downloads_and_checkpoint_delete_and_rm(det: Any, tmp_path: Path) -> None:
    # GC would keep only the best and latest (here the same one): keep both checkpoints.
    store = f"checkpoint_storage={{type: shared_fs, host_path: {tmp_path / 'ckpts'}, save_trial_latest: 5}}"
    create(det, "--config", store)
    code, out, err = det("e", "download", "1", "--top-n", "2", "-o", tmp_path / "best", "-q")
    paths = [Path(p) for p in out.split()]
    assert code == 0 and len(paths) == 2 and all((p / "state.json").is_file() for p in paths), (out, err)
    code, out, err = det("t", "download", "1", "--latest", "-q", "-o", tmp_path / "latest")
    assert code == 0 and json.loads((Path(out.strip()) / "state.json").read_text())["batch"] == 10, err
    code, _, err = det("t", "download", "1", "--best", "--latest")
    assert code == 2 and "exactly one of --best, --latest and --uuid" in err

    code, out, _ = det("c", "list", "1", "--json")
    first, last = [c["uuid"] for c in json.loads(out)][:2]
    code, out, _ = det("e", "lc", "1", "--csv")
    assert [r["UUID"] for r in csv.DictReader(io.StringIO(out))] == [first, last]
    code, out, err = det("c", "rm", first, "--glob", "state.json", "--yes")
    assert code == 0 and f"Removed 1 file(s) from checkpoint {first}" in out, err
    code, out, _ = det("c", "list", "1", "--json")
    states = {c["uuid"]: (c["state"], sorted(c["resources"])) for c in json.loads(out)}
    assert states[first] == ("PARTIALLY_DELETED", ["metadata.json"])
    storage = Path(json.loads(out)[0]["storage_path"]).parent
    assert not (storage / first / "state.json").exists() and (storage / first / "metadata.json").exists()
    code, out, err = det("c", "delete", f"{first},{last}", "--yes")
    assert code == 0 and out.count("Deleted checkpoint") == 2, err
    assert not (storage / first).exists() and not (storage / last).exists()
    code, out, _ = det("c", "list", "1", "--json")
    assert {c["state"] for c in json.loads(out) if c["uuid"] in (first, last)} == {"DELETED"}
    code, _, err = det("c", "delete", "no-such-uuid", "--yes")
    assert code != 0 and "not found" in err


def test_logs_filters_on_a_real_trial(det: Any) -> None:
    create(det)
    code, out, _ = det("t", "logs", "1")
    assert "done: w=" in out and "=== trial 1 run 1" in out
    # Plain prints count as INFO: --level WARNING hides them (and the headers).
    code, out, _ = det("t", "logs", "1", "--level", "WARNING")
    assert code == 0 and "done: w=" not in out and "=== trial" not in out
    code, out, _ = det("e", "logs", "1", "--level", "info", "--tail", "5")
    assert "done: w=" in out
    # -f on an ended trial prints what there is and returns (a running one is followed to its end).
    code, out, _ = det("e", "logs", "1", "-f", "--level", "WARNING")
    assert code == 0 and "done: w=" not in out
    code, out, _ = det("e", "logs", "1", "-f")
    assert code == 0 and "done: w=" in out
    code, out, _ = det("t", "logs", "1", "--since", "2999-01-01")
    assert code == 0 and out == ""
    code, out, _ = det("t", "logs", "1", "--until", "2000-01-01T00:00:00Z")
    assert code == 0 and out == ""
    code, out, err = det("t", "logs", "1", "--since", "yesterday")
    assert code == 2 and "expected an ISO 8601 time" in out + err


def test_log_filter_rules() -> None:
    assert line_level("[rank=0] ERROR: [12] root: boom") == "ERROR"
    assert line_level("WARN: disk") == "WARNING" and line_level("plain print") == "INFO"
    flt = LogFilter(ranks=(1,), min_level="WARNING")
    assert flt.keeps_line("[rank=1] WARNING: x") and not flt.keeps_line("[rank=0] WARNING: x")
    assert not flt.keeps_line("[rank=1] INFO: x") and not flt.keeps_line("ERROR: no rank")
    t0 = datetime(2026, 11, 23, 12, tzinfo=timezone.utc)
    window = LogFilter(since=t0, until=t0 + timedelta(hours=1))
    assert window.keeps_run(t0 - timedelta(hours=2), None)  # still running: overlaps
    assert not window.keeps_run(t0 - timedelta(hours=2), t0 - timedelta(hours=1))
    assert not window.keeps_run(t0 + timedelta(hours=2), None)
    assert window.keeps_note(t0 + timedelta(minutes=5), "INFO") and window.keeps_note(t0, "INFO")  # edges count
    assert not window.keeps_note(t0 + timedelta(hours=2), "INFO")
    assert not LogFilter(min_level="ERROR").keeps_note(t0, "WARNING")
    assert not LogFilter(ranks=(0,)).keeps_note(t0, "ERROR")  # notes have no rank
    assert parse_time("2026-11-23 12:00", "--since") == t0
    with pytest.raises(ValueError, match="--until 'soon'"):
        parse_time("soon", "--until")


def test_reads_respect_the_polling_floor(tmp_path: Path) -> None:
    from detslurm.daemon import claim_poll

    store = open_store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    assert claim_poll(store, "alice", 60)
    # A second read within the floor reuses the first one's poll; another user is not held off.
    assert not claim_poll(store, "alice", 60)
    assert claim_poll(store, "bob", 60)
    assert claim_poll(store, "alice", 0)


def test_priority_becomes_nice_in_sbatch() -> None:
    from detslurm.expconf import validate
    from detslurm.slurm.render import priority_args

    def cfg(extra: dict[str, Any]) -> Any:
        base = {"entrypoint": "python3 train.py", "searcher": {"name": "single", "metric": "m"}}
        return validate({**base, "resources": extra}, {"type": "shared_fs", "host_path": "/tmp"})

    assert priority_args(cfg({}), may_raise=False) == []
    assert priority_args(cfg({"priority": 60}), may_raise=False) == ["--nice=1800"]
    # Above the default: only operators may lower a nice below 0; everyone else gets 0.
    assert priority_args(cfg({"priority": 10}), may_raise=False) == ["--nice=0"]
    assert priority_args(cfg({"priority": 10}), may_raise=True) == ["--nice=-3200"]


def _walk(cmd: click.Command, path: str) -> list[tuple[str, click.Command]]:
    out = [(path, cmd)]
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            if sub.name == name:
                out += _walk(sub, f"{path} {name}")
    return out


def test_every_command_has_an_example_in_its_help(det: Any) -> None:
    from detslurm.cli.main import _COMMANDS

    missing = []
    for name, (module, attr, _) in _COMMANDS.items():
        group = getattr(importlib.import_module(f"detslurm.cli.{module}"), attr)
        for path, _cmd in _walk(group, name):
            code, out, _err = det(*path.split(), "--help")
            if code != 0 or not re.search(r"Example:\n +det ", out):
                missing.append(path)
    assert missing == []


class FakeCanceller:
    """Records what `det e pause/kill` asked the executor to cancel; fails when told to."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.pending: list[list[str]] = []
        self.killed: list[list[str]] = []

    def cancel_pending(self, job_ids: Any) -> None:
        if self.fail:
            raise RuntimeError("slurmctld is down")
        self.pending.append(list(job_ids))

    def kill_many(self, job_ids: Any) -> None:
        self.killed.append(list(job_ids))


def _queued_run(det_env: Path, job_id: str) -> Any:
    from detslurm import settings
    from detslurm.store import RunState, TrialRun

    store = open_store(settings.load().db_url)
    with store.tx() as s:
        s.add(
            TrialRun(
                trial_id=1,
                run_id=1,
                state=RunState.QUEUED,
                executor="slurm",
                job_id=job_id,
                run_dir=str(det_env),
                log_path=str(det_env / "log"),
            )
        )
    return store


def test_pause_marks_and_cancels_queued_runs_and_the_exit_reads_as_the_pause(det: Any, det_env: Path) -> None:
    from detslurm.controller import ops
    from detslurm.controller.decide import decide_exit
    from detslurm.controller.executor import ExitCause, JobState, JobStatus
    from detslurm.controller.reconcile import load_searcher
    from detslurm.store import Experiment, TrialRun

    assert det("e", "create", "--local", CORE / "const.yaml", CORE, "--paused")[0] == 0
    store = _queued_run(det_env, "77")
    down = FakeCanceller(fail=True)
    with pytest.raises(RuntimeError):
        ops.cancel_queued_now(store, 1, down)
    with store.read() as s:
        assert s.get(TrialRun, 1).exit_reason is None  # not reaching Slurm leaves an ordinary queued run
    up = FakeCanceller()
    assert ops.cancel_queued_now(store, 1, up) == ["77"] and up.pending == [["77"]]
    with store.tx() as s:
        exp = s.get(Experiment, 1)
        run = s.get(TrialRun, 1)
        decide_exit(
            s, exp, run.trial, run, JobStatus(JobState.EXITED, None, ExitCause.CANCELED_BY_USER), load_searcher(exp)
        )
        assert (run.trial.state, run.trial.restarts, run.exit_reason) == ("PAUSED", 0, "canceled by detslurm")
    # Kill: the trials are stopping in the same transaction, and every live job goes at once.
    assert ops.kill(store, 1) is None and ops.kill_jobs_now(store, 1, up) == []  # no live run left
    with store.read() as s:
        assert s.get(Experiment, 1).trials[0].state == "STOPPING_KILLED"


def test_a_pause_mark_gives_way_when_the_job_had_started(det: Any, det_env: Path) -> None:
    from detslurm.controller import ops
    from detslurm.controller.decide import decide_exit
    from detslurm.controller.executor import ExitCause, JobState, JobStatus
    from detslurm.controller.reconcile import load_searcher
    from detslurm.store import Experiment, TrialRun

    assert det("e", "create", "--local", CORE / "const.yaml", CORE, "--paused")[0] == 0
    store = _queued_run(det_env, "78")
    ops.cancel_queued_now(store, 1, FakeCanceller())
    with store.tx() as s:
        exp, run = s.get(Experiment, 1), s.get(TrialRun, 1)
        run.preempt_acked = True  # it started, saw the pause, checkpointed and exited
        decide_exit(s, exp, run.trial, run, JobStatus(JobState.EXITED, 0, ExitCause.COMPLETED), load_searcher(exp))
        assert (run.trial.state, run.exit_reason) == ("PAUSED", "completed")


def test_continue_of_a_037_style_trial_needs_a_longer_max_length(det: Any) -> None:
    create(det, "--config", "searcher.max_length.batches=10")
    code, _, err = det("e", "continue", "1", "--config", "searcher.max_length.batches=10")
    assert code != 0 and "give a larger searcher.max_length" in err
    longer = "environment.environment_variables=[EXAMPLE_TOTAL_BATCHES=20]"
    code, out, err = det("e", "continue", "1", "--config", "searcher.max_length.batches=20", "--config", longer)
    assert code == 0 and "Experiment 1 COMPLETED" in out, (out, err)
    assert describe(det, 1)["trials"][0]["batches"] == 20
