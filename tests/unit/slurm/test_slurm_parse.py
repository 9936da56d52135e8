"""Parsers on output captured from the project's real Slurm test clusters: 22.05 (Debian 12) and
24.11 (Debian 13, TEST_CLUSTER_SLURM=24.11). tests/data/capture-slurm-outputs made both sets
from the same scenario, so one test checks both versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from detslurm.slurm.client import Result, SlurmClient, SlurmCommandError
from detslurm.slurm.parse import (
    SlurmParseError,
    expand_nodelist,
    parse_comment,
    parse_config,
    parse_key_values,
    parse_sbatch,
    parse_sinfo,
    parse_sinfo_json,
    parse_squeue,
    trial_comment,
)
from detslurm.slurm.states import SLURM_STATES, SlurmState, state_from_slurm

DATA = Path(__file__).parents[2] / "data" / "slurm-22.05"
VERSIONS = ("22.05", "24.11")


def data(version: str) -> Path:
    return Path(__file__).parents[2] / "data" / f"slurm-{version}"


@pytest.mark.parametrize("version", VERSIONS)
def test_squeue_captured(version: str) -> None:
    jobs = {j.job_id: j for j in parse_squeue((data(version) / "squeue.txt").read_text())}
    # 24.11's capture also lists the scenario's finished jobs 1-4 (kept for MinJobAge).
    finished = {"1", "2", "3", "4"} & set(jobs)
    assert set(jobs) - finished == {"7", "8_0", "8_1", "8_2", "8_3", "5", "6", "9"}
    if finished:
        assert jobs["1"].state is SlurmState.FAILED and jobs["3"].state is SlurmState.CANCELLED
    trial = jobs["5"]
    assert trial.state is SlurmState.RUNNING and trial.nodelist == "c[1-2]" and trial.num_nodes == 2
    assert trial.name == "det-e1-t2-r1" and parse_comment(trial.comment) == (1, 2, 1)
    assert jobs["6"].name == "name with | pipe" and jobs["6"].gpus == 4 and jobs["6"].comment == ""
    held = jobs["8_2"]
    assert (held.array_job_id, held.array_task_id, held.state, held.reason) == (8, 2, SlurmState.PENDING, "JobHeldUser")
    assert jobs["9"].nice == 50 and jobs["9"].partition == "high" and jobs["9"].priority == 950
    assert jobs["7"].array_task_id is None


def test_squeue_bad_line() -> None:
    with pytest.raises(SlurmParseError):
        parse_squeue("garbage line")


@pytest.mark.parametrize("version", VERSIONS)
def test_sinfo_captured(version: str) -> None:
    DATA = data(version)
    parts = parse_sinfo((DATA / "sinfo.txt").read_text())
    assert {p.partition for p in parts} == {"cpu", "gpu", "high"}
    gpu = next(p for p in parts if p.partition == "gpu")
    assert gpu.gpus_per_node == 2 and gpu.cpus_total == 4 and not gpu.default
    assert any(p.default for p in parts if p.partition == "cpu")
    # Node records: 22.05's sinfo --json; from 23.02 on, scontrol show nodes --json.
    node_json = DATA / ("sinfo.json" if version == "22.05" else "show-nodes.json")
    nodes = parse_sinfo_json(node_json.read_text())
    assert [n.name for n in nodes] == ["c1", "c2", "g1", "g2"]
    assert nodes[2].gpus == 2 and nodes[2].partitions == ("gpu", "high") and nodes[0].gpus == 0
    assert nodes[3].state == "idle" and nodes[3].cpus == 2


@pytest.mark.parametrize(
    ("version", "release", "accounting"), [("22.05", "22.05.8", False), ("24.11", "24.11.5", True)]
)
def test_config_capabilities(version: str, release: str, accounting: bool) -> None:
    caps = parse_config((data(version) / "show-config.txt").read_text())
    assert caps.version == release and caps.enable_user_top and caps.preemption
    assert caps.accounting is accounting and caps.max_array_size == 1001 and caps.cluster_name == "detslurm"
    # Fields that moved or changed between the versions still read the same.
    assert caps.kill_wait_s == 5 and caps.message_timeout_s == 10 and caps.preempt_mode == "REQUEUE"
    assert not caps.rate_limited and caps.slurm_user == "root"
    with pytest.raises(SlurmParseError):
        parse_config("nothing here")


@pytest.mark.parametrize("version", VERSIONS)
def test_show_job_and_sbatch(version: str) -> None:
    DATA = data(version)
    kv = parse_key_values((DATA / "show-job-running.txt").read_text())
    assert kv["JobState"] == "RUNNING" and kv["Partition"] in ("cpu", "gpu", "high")
    assert parse_sbatch((DATA / "sbatch-parsable.txt").read_text()).isdigit()
    assert parse_sbatch("123;cluster\n") == "123"
    with pytest.raises(SlurmParseError):
        parse_sbatch("sbatch: error: Batch job submission failed")


def test_nodelists() -> None:
    assert expand_nodelist("c[1-2],g1") == ["c1", "c2", "g1"]
    assert expand_nodelist("node[01-03]") == ["node01", "node02", "node03"]
    assert expand_nodelist("") == []
    with pytest.raises(SlurmParseError):
        expand_nodelist("c[1-")


def test_state_mapping_is_total() -> None:
    assert state_from_slurm("CANCELLED by 0") is SlurmState.CANCELLED
    assert state_from_slurm("RUNNING+") is SlurmState.RUNNING
    assert state_from_slurm("SOMETHING_NEW") is SlurmState.UNKNOWN
    assert state_from_slurm("PD") is SlurmState.PENDING and state_from_slurm("OOM") is SlurmState.OUT_OF_MEMORY
    assert all(isinstance(v, SlurmState) for v in SLURM_STATES.values())
    assert {s for s in SlurmState if s.is_terminal} == {
        SlurmState.COMPLETED,
        SlurmState.FAILED,
        SlurmState.CANCELLED,
        SlurmState.TIMEOUT,
        SlurmState.PREEMPTED,
        SlurmState.NODE_FAIL,
        SlurmState.OUT_OF_MEMORY,
        SlurmState.BOOT_FAIL,
        SlurmState.DEADLINE,
    }


def test_comment_round_trip() -> None:
    assert parse_comment(trial_comment(3, 14, 2)) == (3, 14, 2)
    assert parse_comment("someone else's job") is None
    # An array's tasks share one comment; each task's trial is the base plus its task id.
    assert parse_comment(trial_comment(3, 14, 2, "ab12", array=True), 5) == (3, 19, 2)
    assert parse_comment(trial_comment(3, 14, 2, array=True)) is None  # the array, not one task


def test_squeue_array_tasks_captured() -> None:
    jobs = {j.job_id: j for j in parse_squeue((DATA / "squeue-array.txt").read_text())}
    assert set(jobs) == {"1_0", "1_1", "1_2"}
    assert jobs["1_0"].state == SlurmState.RUNNING and jobs["1_2"].reason == "JobArrayTaskLimit"
    assert [jobs[k].identity for k in sorted(jobs)] == [(1, 5, 1), (1, 6, 1), (1, 7, 1)]


class FakeRunner:
    """Behaves like the commands: records argv, answers from a table, fails like Slurm."""

    def __init__(self, answers: dict[str, Result]) -> None:
        self.answers = answers
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv, *, input=None, timeout, env=None):  # type: ignore[no-untyped-def]
        self.calls.append((list(argv), timeout))
        return self.answers.get(argv[0], Result(1, "", f"{argv[0]}: error: Invalid job id specified"))


def test_client_timeouts_and_errors() -> None:
    runner = FakeRunner({"squeue": Result(0, (DATA / "squeue.txt").read_text(), "")})
    client = SlurmClient(runner, timeout_s=7, user="alice")
    assert len(client.squeue()) == 8
    argv, timeout = runner.calls[0]
    assert timeout == 7 and argv[-2:] == ["-u", "alice"] and "-r" in argv
    with pytest.raises(SlurmCommandError, match="scancel failed \\(exit 1\\): scancel: error: Invalid job id"):
        client.scancel("999")
    assert client.calls == 2


@pytest.mark.parametrize("version", VERSIONS)
def test_sacct_captured(version: str) -> None:
    from detslurm.slurm.parse import parse_sacct

    jobs = parse_sacct((data(version) / "sacct-parsable.txt").read_text())
    assert jobs["1"].state is SlurmState.FAILED and jobs["1"].exit_code == 3
    assert jobs["3"].state is SlurmState.CANCELLED and jobs["2"].exit_code == 0 and jobs["2"].signal is None


def test_executor_falls_back_to_sacct(tmp_path: Path) -> None:
    from detslurm.controller.executor import ExitCause, JobState
    from detslurm.controller.slurm_executor import SlurmExecutor
    from detslurm.slurm.site import SiteConfig

    config = (DATA / "show-config.txt").read_text()
    accounting = config.replace("accounting_storage/none", "accounting_storage/slurmdbd")
    for cfg, expect in ((accounting, JobState.EXITED), (config, JobState.UNKNOWN)):
        runner = FakeRunner(
            {
                "squeue": Result(0, "", ""),
                "scontrol": Result(0, cfg, ""),
                "sacct": Result(0, (DATA / "sacct-parsable.txt").read_text(), ""),
            }
        )
        ex = SlurmExecutor(SlurmClient(runner), SiteConfig())
        status = ex.poll({"1": tmp_path})["1"]
        assert status.state is expect
        if expect is JobState.EXITED:
            assert (status.exit_code, status.cause, status.detail) == (3, ExitCause.FAILED, "FAILED")
        assert any(argv[0] == "sacct" for argv, _ in runner.calls) == (expect is JobState.EXITED)


def test_killing_many_tasks_is_one_scancel() -> None:
    from detslurm.controller.slurm_executor import SlurmExecutor
    from detslurm.slurm.site import SiteConfig

    runner = FakeRunner({"scancel": Result(0, "", "")})
    SlurmExecutor(SlurmClient(runner), SiteConfig()).kill_many([f"7_{i}" for i in range(256)] + ["9"])
    assert [argv for argv, _ in runner.calls] == [["scancel", *(f"7_{i}" for i in range(256)), "9"]]
    # Jobs that ended meanwhile are not an error; anything else is.
    ended = "scancel: error: Kill job error on job id 7_3: Job/step already completing or completed\n"
    runner = FakeRunner({"scancel": Result(1, "", ended)})
    SlurmExecutor(SlurmClient(runner), SiteConfig()).kill_many(["7_3", "7_4"])
    runner = FakeRunner({"scancel": Result(1, "", "scancel: error: Access/permission denied\n")})
    with pytest.raises(SlurmCommandError, match="permission denied"):
        SlurmExecutor(SlurmClient(runner), SiteConfig()).kill_many(["7_3"])


def test_sacct_array_tasks_captured_are_keyed_by_array_task() -> None:
    """Real 22.05 output (DBD test cluster): array 1 with a completed, a failed and a canceled
    task, array 4 preempted (--no-requeue), job 6 plain. The executor stores ARRAY_TASK ids."""
    from detslurm.slurm.parse import parse_sacct

    jobs = parse_sacct((DATA / "sacct-array.txt").read_text())
    assert jobs["1_0"].state is SlurmState.COMPLETED and jobs["1_0"].exit_code == 0
    assert jobs["1_1"].state is SlurmState.FAILED and jobs["1_1"].exit_code == 3
    assert jobs["1_2"].state is SlurmState.CANCELLED
    assert jobs["4_0"].state is jobs["4_1"].state is SlurmState.PREEMPTED
    assert jobs["6"].state is SlurmState.COMPLETED and "6_0" not in jobs
    # The raw ids stay keys too (a plain job's id is its raw id).
    assert jobs["3"] is jobs["1_1"]


def test_sacct_bad_lines_are_skipped() -> None:
    from detslurm.slurm.parse import parse_sacct

    good = "7|TIMEOUT|0:15|None|a|b|7"
    jobs = parse_sacct(f"garbage\n\nx|y|z\n{good}\n")
    assert list(jobs) == ["7"] and jobs["7"].state is SlurmState.TIMEOUT and jobs["7"].signal == 15


def test_squeue_control_characters_captured() -> None:
    """Real squeue output for jobs whose name or comment holds a newline, our field separator
    or our record separator (sbatch accepts all of them): the others still parse, the
    ambiguous records are skipped and counted, nothing raises."""
    from detslurm.slurm.parse import parse_squeue_counted

    jobs, skipped = parse_squeue_counted((DATA / "squeue-control-chars.txt").read_text())
    by_id = {j.job_id: j for j in jobs}
    assert set(by_id) == {"11", "12", "14"}
    assert by_id["11"].comment == "a\nb" and by_id["11"].name == "wrap" and by_id["11"].identity is None
    assert by_id["12"].name == "nm\nx" and by_id["12"].comment == ""
    assert by_id["14"].identity == (1, 1, 1) and by_id["14"].state is SlurmState.RUNNING
    # 13 (SEP in name and comment) and 15 (RS in name and comment: three fragments) are skipped.
    assert skipped == 4
    assert parse_squeue("") == []
