"""Refuse what can never run, on the real test cluster (docs/user/refusals.md).

``det e create`` refuses, with the numbers and before anything exists, a request bigger than
its pool, a time limit over the partition's MaxTime and an option sbatch rejects; a job made
impossible while it waits ends its trial with Slurm's reason (and is cancelled), and a waiting
job's reason is shown in words by ``det e describe``, ``det t describe`` and ``det job list``.

Partition limits are changed with ``scontrol update`` as root and always restored: the test
cluster has none.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conftest import EXAMPLES, write

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_env")]
CORE = EXAMPLES / "core_api"
T = TypeVar("T")


def config(tmp_path: Path, resources: str = "{slots_per_trial: 1}", sbatch_args: str = "[]") -> Path:
    return write(
        tmp_path / "c.yaml",
        "name: refuse\nentrypoint: python3 train.py\nmax_restarts: 3\n"
        "searcher: {name: single, metric: validation_loss, max_length: 1}\n"
        f"resources: {resources}\nslurm: {{sbatch_args: {sbatch_args}}}\n",
    )


def assert_nothing_created(det: Any, env: Path) -> None:
    code, out, _ = det("e", "list", "--json")
    assert code == 0 and json.loads(out) == []
    exps = env / "exps"
    assert not exps.exists() or list(exps.iterdir()) == []
    assert subprocess.run(["squeue", "-h"], capture_output=True, text=True, check=True).stdout == ""


def refused(det: Any, *args: Any) -> str:
    """The dry run, a paused create and the create refuse the same way; the error text (no
    traceback)."""
    messages = []
    for dry in (["--dry-run"], ["--paused"], []):
        code, out, err = det("e", "create", *dry, *args)
        assert code == 1, (out, err)
        assert "Traceback" not in err and "Created experiment" not in out
        messages.append(err)
    assert messages[0] == messages[1] == messages[2]
    return messages[0]


# What the test cluster's partitions have: no limit, everyone allowed.
UNSET = {"MaxTime": "UNLIMITED", "MaxNodes": "UNLIMITED", "AllowAccounts": "ALL", "AllowQos": "ALL"}


@contextmanager
def partition_limit(name: str, **limits: str) -> Iterator[None]:
    """Set partition limits as root for one test, and put them back however it ends."""
    fields = [f"{k}={v}" for k, v in limits.items()]
    subprocess.run(["scontrol", "update", f"PartitionName={name}", *fields], check=True)
    try:
        yield
    finally:
        undo = [f"{k}={UNSET[k]}" for k in limits]
        subprocess.run(["scontrol", "update", f"PartitionName={name}", *undo], check=True)


def until(what: str, probe: Callable[[], T | None], timeout: float = 40) -> T:
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = probe()
        if got is not None:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slurm24_smoke
def test_more_slots_than_the_pool_is_refused_with_the_numbers(det: Any, slurm_env: Path, tmp_path: Path) -> None:
    err = refused(det, config(tmp_path, "{slots_per_trial: 100}"), CORE)
    assert ": resources.slots_per_trial: slots_per_trial=100 needs 50 nodes; pool cpu has 2 nodes x 2 slots" in err
    err = refused(det, config(tmp_path, "{slots_per_trial: 6, resource_pool: gpu}"), CORE)
    assert "slots_per_trial=6 needs 3 nodes; pool gpu has 2 nodes x 2 slots" in err
    assert_nothing_created(det, slurm_env)


@pytest.mark.slurm24_smoke
def test_bad_sbatch_args_are_refused_with_sbatchs_message(det: Any, slurm_env: Path, tmp_path: Path) -> None:
    # Not an sbatch option at all: refused while the config is validated, naming the argument.
    err = refused(det, config(tmp_path, sbatch_args="[--thisisnotavalidslurmoption]"), CORE)
    assert ": slurm.sbatch_args[0]: --thisisnotavalidslurmoption is not an sbatch option" in err
    # A valid option that slurmctld refuses: only sbatch --test-only can tell, in its own words.
    err = refused(det, config(tmp_path, sbatch_args="[--constraint=nosuchfeature]"), CORE)
    assert ": slurm.sbatch_args: sbatch --test-only refused the job:" in err
    assert "Invalid feature specification" in err
    assert_nothing_created(det, slurm_env)


def test_time_over_the_partitions_max_time_is_refused(det: Any, slurm_env: Path, tmp_path: Path) -> None:
    with partition_limit("cpu", MaxTime="00:10:00"):
        err = refused(det, config(tmp_path, sbatch_args="['--time=1:00:00']"), CORE)
        assert (
            ": slurm.sbatch_args[0]: --time=1:00:00 (01:00:00) is longer than partition cpu allows: "
            "MaxTime=00:10:00" in err
        )
        # Within the limit it is accepted (dry run: nothing is queued).
        code, out, err = det("e", "create", "--dry-run", config(tmp_path, sbatch_args="['--time=5']"), CORE)
        assert code == 0 and "--time=5" in out, err
    assert_nothing_created(det, slurm_env)


def test_account_and_qos_the_partition_does_not_allow_are_refused(det: Any, slurm_env: Path, tmp_path: Path) -> None:
    with partition_limit("gpu", AllowAccounts="ml,vision", AllowQos="normal"):
        cfg = config(tmp_path, "{slots_per_trial: 1, resource_pool: gpu}", "[-A, physics, '--qos=debug']")
        err = refused(det, cfg, CORE)
        assert ": slurm.sbatch_args[0]: account 'physics' may not use partition gpu (allowed: ml, vision)" in err
        assert ": slurm.sbatch_args[2]: QOS 'debug' may not use partition gpu (allowed: normal)" in err
    assert_nothing_created(det, slurm_env)


def trial_view(det: Any) -> dict[str, Any]:
    code, out, err = det("t", "describe", "1", "--json")
    assert code == 0, err
    d: dict[str, Any] = json.loads(out)
    return d


def test_a_job_made_impossible_while_queued_ends_its_trial(det: Any, tmp_path: Path) -> None:
    # The whole cpu pool (2 nodes x 2 slots) for the trial, one node taken by a blocker job: the
    # trial's job waits for Resources until the partition's MaxNodes drops below its 2 nodes.
    blocker = subprocess.run(
        ["sbatch", "--parsable", "-p", "cpu", "-N1", "-c2", "--output=/dev/null", "--wrap", "sleep 120"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    until("the blocker to run", lambda: "R" if _state(blocker) == "RUNNING" else None)
    code, out, err = det("e", "create", config(tmp_path, "{slots_per_trial: 4}"), CORE)
    assert code == 0 and "Created experiment 1" in out, err

    words = "waiting for free nodes (Resources)"
    until("the reason in words", lambda: trial_view(det)["trial"]["pending_reason"] == words or None)
    assert words in det("t", "describe", "1")[1]
    assert words in det("e", "describe", "1")[1]
    job = trial_view(det)["runs"][0]["job_id"]
    code, out, _ = det("job", "list")
    # The row whose ID column is the job: a bare `job in line` also matched another job's row
    # whose Slurm priority happened to equal this job's id.
    row = next(line for line in out.splitlines() if line.count("|") > 1 and line.split("|")[1].strip() == job)
    assert code == 0 and words in row

    with partition_limit("cpu", MaxNodes="1"):
        d = until("the trial to end", lambda: ended(trial_view(det)))
    assert d["trial"]["exit_reason"] == (
        "the job can never start: more nodes than the partition allows per job (PartitionNodeLimit); it was canceled"
    )
    # Ended once, not restarted (max_restarts: 3 would resubmit the same impossible job).
    assert [(r["run_id"], r["exit_reason"]) for r in d["runs"]] == [(1, "unschedulable")]
    until("the job to be cancelled", lambda: "gone" if _state(job) in ("", "CANCELLED") else None, timeout=15)
    assert "PartitionNodeLimit" in det("e", "describe", "1")[1]


def test_a_job_that_needs_a_drained_node_is_queued_to_wait_for_it(det: Any, tmp_path: Path) -> None:
    # sbatch --test-only answers "Requested node configuration is not available" for a job that
    # needs a drained node, though sbatch queues that job (ReqNodeNotAvail): the create goes on,
    # names the node, and the trial runs once the node is back.
    subprocess.run(["scontrol", "update", "NodeName=c1", "State=DRAIN", "Reason=detslurm-test"], check=True)
    try:
        only_c1 = ["--config", "slurm.sbatch_args=[--nodelist=c1]", "--config", "hyperparameters.sleep=0"]
        code, out, err = det("e", "create", CORE / "const.yaml", CORE, *only_c1)
        assert code == 0 and "Created experiment 1" in out, err
        assert "Note: nodes c1 take no jobs now (down or drained); the jobs may wait for them" in err
        words = "waiting for nodes that are down, drained or reserved ("
        reason = until("a reason", lambda: trial_view(det)["trial"]["pending_reason"] or None)
        assert reason.startswith(words), reason
    finally:
        subprocess.run(["scontrol", "update", "NodeName=c1", "State=RESUME"], check=True)
    done = until("the trial to end", lambda: settled(trial_view(det)), 300)
    assert done["trial"]["state"] == "COMPLETED", done


def ended(view: dict[str, Any]) -> dict[str, Any] | None:
    return view if view["trial"]["state"] == "ERROR" else None


def settled(view: dict[str, Any]) -> dict[str, Any] | None:
    return view if view["trial"]["state"] != "ACTIVE" else None


def _state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout
    return out.strip()
