"""What differs between Slurm 22.05 and 24.11, on output captured from both test clusters
(tests/data/capture-slurm-outputs): how a run ended (squeue and sacct), node listings, partition
limits, the --json schemas, and per-user rate limiting (a fake that answers like slurmctld)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import pytest
from fake_runner import FakeRunner

from detslurm.controller.executor import ExitCause, JobState, JobStatus, SchedulerUnavailable
from detslurm.controller.slurm_executor import SlurmExecutor
from detslurm.slurm.client import Result, SlurmClient, SlurmCommandError
from detslurm.slurm.parse import json_lists_nodes, parse_config, parse_sacct, parse_squeue
from detslurm.slurm.partitions import parse_partitions
from detslurm.slurm.site import SiteConfig
from detslurm.slurm.states import SlurmState

VERSIONS = ("22.05", "24.11")
# The scenario's four endings (capture-slurm-outputs): job id -> Slurm state, our cause.
ENDINGS = {
    "10": (SlurmState.TIMEOUT, ExitCause.TIME_LIMIT),
    "11": (SlurmState.PREEMPTED, ExitCause.PREEMPTED),
    "12": (SlurmState.NODE_FAIL, ExitCause.NODE_FAILURE),
    "13": (SlurmState.CANCELLED, ExitCause.CANCELED_BY_USER),
}


def data(version: str) -> Path:
    return Path(__file__).parents[2] / "data" / f"slurm-{version}"


class Slurm(FakeRunner):
    """Answers each command (matched on its longest listed argv prefix) from a table, and
    records what was asked; unlisted commands fail as Slurm would."""

    def __init__(self, answers: Mapping[str, Result | list[Result]]) -> None:
        self.answers = {k: list(v) if isinstance(v, list) else v for k, v in answers.items()}
        super().__init__()

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        for n in (3, 2, 1):
            answer = self.answers.get(" ".join(argv[:n]))
            if isinstance(answer, list):
                return answer.pop(0) if len(answer) > 1 else answer[0]
            if answer is not None:
                return answer
        return Result(1, "", f"{argv[0]}: error: not in this fake")


def config(version: str, accounting: bool) -> str:
    """The captured show config, with accounting switched as the test needs."""
    text = (data(version) / "show-config.txt").read_text()
    if accounting:
        return text.replace("accounting_storage/none", "accounting_storage/slurmdbd")
    return text.replace("accounting_storage/slurmdbd", "accounting_storage/none")


@pytest.mark.parametrize("version", VERSIONS)
def test_endings_captured_in_squeue_and_sacct(version: str) -> None:
    queued = {j.job_id: j for j in parse_squeue((data(version) / "squeue-causes.txt").read_text())}
    accounted = parse_sacct((data(version) / "sacct-causes.txt").read_text())
    for job, (state, _) in ENDINGS.items():
        assert queued[job].state is state and accounted[job].state is state
    assert queued["10"].reason == "TimeLimit" and queued["12"].reason == "NodeDown"
    # 24.11 records exit code 1 for a job lost with its node, 22.05 records 0: only the state counts.
    assert accounted["12"].exit_code in (0, 1)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("accounting", [True, False], ids=["sacct", "no-accounting"])
def test_executor_tells_the_four_endings_apart(version: str, accounting: bool, tmp_path: Path) -> None:
    """With accounting the jobs have left the queue and one sacct call names all four; without
    it squeue still shows them (MinJobAge) and sacct is never asked."""
    squeue = "" if accounting else (data(version) / "squeue-causes.txt").read_text()
    slurm = Slurm(
        {
            "squeue": Result(0, squeue, ""),
            "scontrol show config": Result(0, config(version, accounting), ""),
            "sacct": Result(0, (data(version) / "sacct-causes.txt").read_text(), ""),
        }
    )
    got = SlurmExecutor(SlurmClient(slurm, user="root"), SiteConfig()).poll({j: tmp_path / j for j in ENDINGS})
    for job, (state, cause) in ENDINGS.items():
        assert got[job].state is JobState.EXITED and got[job].cause is cause, job
        assert got[job].detail == state.value
    assert slurm.asked("squeue") == 1
    sacct_calls = [argv for argv in slurm.calls if argv[0] == "sacct"]
    if accounting:
        (argv,) = sacct_calls  # one batched call, never one per job
        assert sorted(argv[argv.index("-j") + 1].split(",")) == sorted(ENDINGS)
    else:
        assert sacct_calls == []


def test_without_accounting_a_job_gone_from_the_queue_is_lost(tmp_path: Path) -> None:
    slurm = Slurm({"squeue": Result(0, "", ""), "scontrol show config": Result(0, config("24.11", False), "")})
    got = SlurmExecutor(SlurmClient(slurm, user="root"), SiteConfig()).poll({"10": tmp_path})
    assert got["10"] == JobStatus(JobState.UNKNOWN, None, ExitCause.LOST)
    assert slurm.asked("sacct") == 0


@pytest.mark.parametrize(("version", "commands"), [("22.05", ["sinfo"]), ("24.11", ["sinfo", "scontrol", "scontrol"])])
def test_node_listing_is_probed_once(version: str, commands: list[str]) -> None:
    """22.05's sinfo --json lists nodes; 24.11's groups them, so the client switches to
    scontrol show nodes --json after looking at the first answer, and stays there."""
    slurm = Slurm(
        {
            "sinfo": Result(0, (data(version) / "sinfo.json").read_text(), ""),
            "scontrol show nodes": Result(0, (data("24.11") / "show-nodes.json").read_text(), ""),
        }
    )
    client = SlurmClient(slurm, user="root")
    first = client.nodes()
    if version == "24.11":
        client.nodes()
    assert [argv[0] for argv in slurm.calls] == commands
    assert [n.name for n in first] == ["c1", "c2", "g1", "g2"] and first[2].gpus == 2
    assert json_lists_nodes((data(version) / "sinfo.json").read_text()) is (version == "22.05")


@pytest.mark.parametrize("version", VERSIONS)
def test_partitions_captured(version: str) -> None:
    parts = {p.name: p for p in parse_partitions((data(version) / "show-partition.txt").read_text())}
    assert sorted(parts) == ["cpu", "gpu", "high"]
    assert parts["cpu"].default and parts["high"].priority_tier == 10 and parts["high"].total_nodes == 4
    assert parts["gpu"].preempt_mode == "REQUEUE" and parts["high"].preempt_mode == "OFF"
    assert parts["cpu"].max_time_s is None and parts["cpu"].grace_time_s == 0


def test_json_schemas_differ_and_the_text_formats_do_not() -> None:
    """Why the client reads squeue/sacct as text: 22.05's --json is the openapi v0.0.38 shape,
    24.11's the data_parser v0.0.42 one (states become lists, numbers {set, infinite, number})."""
    old = json.loads((data("22.05") / "squeue.json").read_text())
    new = json.loads((data("24.11") / "squeue.json").read_text())
    assert "data_parser" not in json.dumps(old["meta"]) and new["meta"]["plugin"]["data_parser"].startswith(
        "data_parser/"
    )
    job5_old = next(j for j in old["jobs"] if j["job_id"] == 5)
    job5_new = next(j for j in new["jobs"] if j["job_id"] == 5)
    assert job5_old["job_state"] == "RUNNING" and job5_new["job_state"] == ["RUNNING"]
    text = {v: {j.job_id: j.state for j in parse_squeue((data(v) / "squeue.txt").read_text())} for v in VERSIONS}
    assert {k: s for k, s in text["24.11"].items() if k in text["22.05"]} == text["22.05"]


RATE_LIMITED = Result(1, "", "squeue: error: Rate limit exceeded, please retry later\n")


def test_rate_limited_commands_are_resent_with_back_off() -> None:
    slurm = Slurm({"squeue": [RATE_LIMITED, RATE_LIMITED, Result(0, "", "")]})
    slept: list[float] = []
    client = SlurmClient(slurm, user="root", retry_budget_s=10, sleep=slept.append)
    assert client.squeue() == []
    assert slept == [1.0, 2.0] and slurm.asked("squeue") == 3 and client.rate_limited_calls == 2


def test_rate_limiting_past_the_budget_is_an_unavailable_scheduler(tmp_path: Path) -> None:
    """Still limited when the budget is spent: the tick gives up as if slurmctld were down (the
    controller retries next tick and charges the trials nothing), never a crash."""
    slurm = Slurm({"squeue": RATE_LIMITED})
    slept: list[float] = []
    client = SlurmClient(slurm, user="root", retry_budget_s=5, sleep=slept.append)
    with pytest.raises(SlurmCommandError) as err:
        client.squeue()
    assert err.value.rate_limited and err.value.unreachable and not err.value.reply_lost
    assert slept == [1.0, 2.0] and sum(slept) <= 5
    with pytest.raises(SchedulerUnavailable):
        SlurmExecutor(SlurmClient(slurm, user="root", retry_budget_s=0), SiteConfig()).poll({"5": tmp_path})


def test_try_again_from_slurmctld_is_resent() -> None:
    """24.11 answers EAGAIN to an update of a job it just released (test_queue_as_root)."""
    eagain = Result(1, "", "Resource temporarily unavailable for job 32\n")
    slurm = Slurm({"scontrol": [eagain, Result(0, "", "")]})
    slept: list[float] = []
    SlurmClient(slurm, user="root", retry_budget_s=10, sleep=slept.append).update("32", Partition="gpu")
    assert slept == [1.0] and slurm.asked("scontrol") == 2


def test_other_errors_are_not_resent() -> None:
    slurm = Slurm({"scancel": Result(1, "", "scancel: error: Access/permission denied\n")})
    slept: list[float] = []
    with pytest.raises(SlurmCommandError, match="permission denied"):
        SlurmClient(slurm, user="root", sleep=slept.append).scancel("5")
    assert slept == [] and slurm.asked("scancel") == 1


def test_rate_limiting_is_probed_from_the_config() -> None:
    text = (data("24.11") / "show-config.txt").read_text()
    assert not parse_config(text).rate_limited
    limited = text.replace("SlurmctldParameters     = (null)", "SlurmctldParameters     = rl_enable,rl_bucket_size=3")
    assert parse_config(limited).rate_limited
