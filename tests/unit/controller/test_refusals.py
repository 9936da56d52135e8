"""Refusing what can never run (docs/user/refusals.md), without a cluster: the pure check over a job's
shape and Slurm's partitions/nodes, the pending-reason table, and the executor's use of both
(one ``sbatch --test-only`` per job shape; jobs pending for a permanent reason are cancelled
and their trial ends)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import pytest
from fake_runner import FakeRunner

from detslurm.controller.decide import SPENDS_NO_RESTART
from detslurm.controller.executor import ExitCause, JobState, RunSpec
from detslurm.controller.slurm_executor import SlurmExecutor
from detslurm.expconf import ExperimentConfig, validate
from detslurm.slurm.client import Result, SlurmClient
from detslurm.slurm.parse import NodeInfo, parse_sinfo_json
from detslurm.slurm.partitions import PartitionInfo, parse_partitions
from detslurm.slurm.reasons import REASONS, describe_reason, pending_reason
from detslurm.slurm.refusals import (
    Refusal,
    RefusalKind,
    RequestRefused,
    check_shape,
    fmt_duration,
    job_shape,
    nodes_away,
)
from detslurm.slurm.render import resource_plan
from detslurm.slurm.site import SiteConfig, load_site_config
from detslurm.views import pending_words

ROOT = Path(__file__).resolve().parents[3]
DATA = Path(__file__).parents[2] / "data" / "slurm-22.05"
SITE = load_site_config(ROOT / "site-configs" / "test-cluster.yaml")
STORAGE = {"type": "shared_fs", "host_path": "/shared/ckpt"}


def config(**over: Any) -> ExperimentConfig:
    raw: dict[str, Any] = {
        "name": "refuse",
        "entrypoint": "python3 train.py",
        "searcher": {"name": "single", "metric": "loss"},
        "hyperparameters": {"lr": 0.1},
    }
    raw.update(over)
    return validate(raw, STORAGE)


def partitions(**changes: str) -> list[PartitionInfo]:
    """The test cluster's partitions as captured, with ``Key=Value`` changes applied to all."""
    text = (DATA / "show-partition.txt").read_text()
    for key, value in changes.items():
        text = "\n".join(
            " ".join(f"{key}={value}" if w.startswith(f"{key}=") else w for w in line.split())
            for line in text.splitlines()
        )
    return parse_partitions(text)


NODES = parse_sinfo_json((DATA / "sinfo.json").read_text())


def refusals(cfg: ExperimentConfig, parts: Optional[list[PartitionInfo]] = None, site: SiteConfig = SITE) -> list[str]:
    return [str(r) for r in check_shape(job_shape(cfg, site, resource_plan(cfg, site)), parts or partitions(), NODES)]


def test_the_test_cluster_nodes_are_what_the_messages_assume() -> None:
    # c1 c2: 2 CPUs; g1 g2: 2 CPUs and 2 GPUs (the numbers in the messages below).
    assert {(n.name, n.cpus, n.gpus) for n in NODES} == {("c1", 2, 0), ("c2", 2, 0), ("g1", 2, 2), ("g2", 2, 2)}


def test_what_fits_is_not_refused() -> None:
    assert refusals(config(resources={"slots_per_trial": 4})) == []
    assert refusals(config(resources={"slots_per_trial": 0, "resource_pool": "gpu"})) == []
    assert refusals(config(resources={"slots_per_trial": 3, "resource_pool": "gpu"})) == []


def test_more_slots_than_the_pool_has_names_the_numbers() -> None:
    assert refusals(config(resources={"slots_per_trial": 100})) == [
        "<config>.resources.slots_per_trial: slots_per_trial=100 needs 50 nodes; pool cpu has 2 nodes x 2 slots"
    ]
    assert refusals(config(resources={"slots_per_trial": 6, "resource_pool": "gpu"})) == [
        "<config>.resources.slots_per_trial: slots_per_trial=6 needs 3 nodes; pool gpu has 2 nodes x 2 slots"
    ]


def test_more_slots_on_one_node_than_any_node_holds() -> None:
    # slots_per_node set by the user: 4 per node, nodes hold 2, so the path is slurm.slots_per_node.
    out = refusals(config(resources={"slots_per_trial": 8}, slurm={"slots_per_node": 4}))
    assert out == [
        "<config>.slurm.slots_per_node: slots_per_trial=8 puts 4 slots on each node; pool cpu has 2 nodes x 2 slots"
    ]
    # The high pool has GPU and CPU nodes: a GPU site config on it counts GPUs only.
    gpu_high = SiteConfig.model_validate(
        {"default_pool": "h", "pools": {"h": {"partition": "cpu", "slot_type": "gpu", "slots_per_node": 2}}}
    )
    out = refusals(config(resources={"slots_per_trial": 1}), site=gpu_high)
    assert out == [
        "<config>.resources.slots_per_trial: slots_per_trial=1 puts 1 slots on each node; "
        "pool h has 2 nodes x 0 slots (no GPUs at all)"
    ]


def test_slots_of_a_gres_sinfo_does_not_count_are_left_to_sbatch() -> None:
    shards = SiteConfig.model_validate(
        {"default_pool": "s", "pools": {"s": {"partition": "gpu", "slot_type": "gpu", "gres_name": "shard"}}}
    )
    assert refusals(config(resources={"slots_per_trial": 8}), site=shards) == []


def test_partition_max_nodes_and_max_cpus_per_node() -> None:
    out = refusals(config(resources={"slots_per_trial": 4}), partitions(MaxNodes="1", MaxCPUsPerNode="1"))
    assert out == [
        "<config>.resources.slots_per_trial: slots_per_trial=4 needs 2 nodes; partition cpu allows at most 1 "
        "per job (MaxNodes)",
        "<config>.resources.slots_per_trial: slots_per_trial=4 puts 2 CPUs on each node; partition cpu allows "
        "at most 1 (MaxCPUsPerNode)",
    ]


def test_time_limit_over_max_time_names_the_argument_that_set_it() -> None:
    parts = partitions(MaxTime="01:00:00")
    cfg = config(slurm={"sbatch_args": ["--mem=1G", "--time=2:00:00"]})
    assert refusals(cfg, parts) == [
        "<config>.slurm.sbatch_args[1]: --time=2:00:00 (02:00:00) is longer than partition cpu allows: MaxTime=01:00:00"
    ]
    assert refusals(config(slurm={"sbatch_args": ["-t", "30"]}), parts) == []
    # No --time at all: Slurm gives the job the partition's default or its MaxTime, never more.
    assert refusals(config(), parts) == []
    # The pool's own limit, unless the user's --time overrides it (sbatch keeps the last value).
    site = SiteConfig.model_validate(
        {"default_pool": "cpu", "pools": {"cpu": {"partition": "cpu", "slots_per_node": 2, "time_limit_min": 120}}}
    )
    assert refusals(config(), parts, site) == [
        "<site-config>.pools.cpu.time_limit_min: --time=120 (02:00:00) is longer than partition cpu allows: "
        "MaxTime=01:00:00"
    ]
    assert refusals(config(slurm={"sbatch_args": ["--time=59"]}), parts, site) == []


def test_account_and_qos_the_partition_does_not_allow() -> None:
    parts = partitions(AllowAccounts="ml,vision", AllowQos="normal")
    cfg = config(slurm={"sbatch_args": ["--account=physics", "--qos=debug"]})
    assert refusals(cfg, parts) == [
        "<config>.slurm.sbatch_args[0]: account 'physics' may not use partition cpu (allowed: ml, vision)",
        "<config>.slurm.sbatch_args[1]: QOS 'debug' may not use partition cpu (allowed: normal)",
    ]
    assert refusals(config(slurm={"sbatch_args": ["-A", "ml", "--qos=normal"]}), parts) == []


def test_a_pool_whose_partition_does_not_exist() -> None:
    site = SiteConfig.model_validate({"default_pool": "x", "pools": {"x": {"partition": "nosuch"}}})
    assert refusals(config(), site=site) == [
        "<site-config>.pools.x.partition: partition 'nosuch' does not exist on this cluster (partitions: cpu, gpu, high)"
    ]


def test_the_refusal_error_is_a_config_error_with_one_line_each() -> None:
    err = RequestRefused([Refusal(RefusalKind.MAX_TIME, "<config>.x", "too long")])
    assert err.exit_code == 1 and err.errors == ["<config>.x: too long"]
    assert "can never run here" in str(err)


def test_durations_in_slurm_notation() -> None:
    assert (fmt_duration(59), fmt_duration(3600), fmt_duration(90061)) == ("00:00:59", "01:00:00", "1-01:01:01")


# -- pending reasons ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "code,shown,permanent",
    [
        ("Priority", "waiting for higher-priority jobs (Priority)", False),
        ("Resources", "waiting for free nodes (Resources)", False),
        (
            "ReqNodeNotAvail, UnavailableNodes:c1",
            "waiting for nodes that are down, drained or reserved (ReqNodeNotAvail)",
            False,
        ),
        (
            "Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority partitions",
            "waiting for nodes that are down, drained or reserved (Nodes required for job are DOWN)",
            False,
        ),
        ("PartitionNodeLimit", "never runs: more nodes than the partition allows per job (PartitionNodeLimit)", True),
        ("PartitionConfig", "never runs: the request does not fit the partition's nodes (PartitionConfig)", True),
        (
            "QOSMaxWallDurationPerJobLimit",
            "never runs: the job asks for more than a per-job limit allows (QOSMaxWallDurationPerJobLimit)",
            True,
        ),
        ("QOSGrpCpuLimit", "waiting: a limit of the QOS shared with other jobs is reached (QOSGrpCpuLimit)", False),
        ("SomethingNewInSlurm25", "waiting (SomethingNewInSlurm25)", False),
    ],
)
def test_reasons_in_words_with_the_code(code: str, shown: str, permanent: bool) -> None:
    assert describe_reason(code) == shown
    assert pending_reason(code).permanent is permanent


def test_a_trials_noted_queue_state_in_words() -> None:
    assert pending_words("queued: Priority") == "waiting for higher-priority jobs (Priority)"
    assert pending_words("queued: waiting") == "waiting to be scheduled"  # Slurm gave no reason
    assert pending_words(None) is None and pending_words("test_done") is None


def test_only_reasons_that_never_clear_are_permanent() -> None:
    permanent = {c for c, r in REASONS.items() if r.permanent}
    assert permanent == {
        "PartitionConfig",
        "PartitionNodeLimit",
        "PartitionTimeLimit",
        "AccountNotAllowed",
        "QOSNotAllowed",
        "InvalidAccount",
        "InvalidQOS",
        "BadConstraints",
        "DependencyNeverSatisfied",
    }
    assert all(r.words for r in REASONS.values())


def test_an_unschedulable_end_is_never_free_of_restarts() -> None:
    # Not in SPENDS_NO_RESTART (which resubmits), and decide_exit ends the trial on it instead.
    assert ExitCause.UNSCHEDULABLE not in SPENDS_NO_RESTART
    assert ExitCause.parse("unschedulable") is ExitCause.UNSCHEDULABLE and ExitCause.UNSCHEDULABLE.text


# -- the executor: probes, sbatch --test-only per shape, cancelling doomed jobs -------------


class FakeSlurm(FakeRunner):
    """Answers like the test cluster's commands, and records every call."""

    def __init__(self, test_only: Result = Result(0, "", "sbatch: Job 3 to start"), scancel: int = 0) -> None:
        self.test_only = test_only
        self.scancel = scancel
        self.queue = ""
        super().__init__()

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        head = " ".join(argv[:3])
        if head == "scontrol show partition":
            return Result(0, (DATA / "show-partition.txt").read_text(), "")
        if head == "scontrol show config":
            return Result(0, (DATA / "show-config.txt").read_text(), "")
        if argv[:2] == ["sinfo", "--json"]:
            return Result(0, (DATA / "sinfo.json").read_text(), "")
        if argv[:2] == ["sbatch", "--test-only"]:
            return self.test_only
        if argv[0] == "squeue":
            return Result(0, self.queue, "")
        if argv[0] == "scancel":
            return Result(
                self.scancel, "", "scancel: error: Unable to contact slurm controller" if self.scancel else ""
            )
        return Result(1, "", f"{argv[0]}: unexpected")

    def count(self, *prefix: str) -> int:
        return sum(1 for c in self.calls if c[: len(prefix)] == list(prefix))


def specs(tmp_path: Path, cfg: ExperimentConfig, n: int) -> list[RunSpec]:
    exp = tmp_path / "exp-1-abcd"
    return [
        RunSpec(
            name=f"t{i}",
            argv=[],
            env={"DET_TRIAL_ID": str(i)},
            run_dir=exp / "trials" / str(i) / "runs" / "1",
            log_path=exp / "trials" / str(i) / "runs" / "1" / "output.log",
            exp_dir=exp,
            identity=(1, i, 1),
            config=cfg,
        )
        for i in range(1, n + 1)
    ]


def test_a_256_trial_grid_costs_one_test_only_call(tmp_path: Path) -> None:
    fake = FakeSlurm()
    ex = SlurmExecutor(SlurmClient(fake, user="alice"), SITE)
    subs = ex.plan_many(specs(tmp_path, config(resources={"slots_per_trial": 1}), 256))
    assert ex.refusals(subs) == []
    # Two probes (partitions, nodes) and one sbatch --test-only for the one job shape.
    assert (fake.count("scontrol", "show", "partition"), fake.count("sinfo", "--json")) == (1, 1)
    assert fake.count("sbatch", "--test-only") == 1
    assert fake.count("sbatch", "--parsable") == 0  # nothing was queued


def test_sbatch_test_only_refusal_carries_sbatchs_message(tmp_path: Path) -> None:
    fake = FakeSlurm(test_only=Result(1, "", "allocation failure: Invalid feature specification\n"))
    ex = SlurmExecutor(SlurmClient(fake, user="alice"), SITE)
    cfg = config(slurm={"sbatch_args": ["--constraint=nosuch"]})
    (refusal,) = ex.refusals(ex.plan_many(specs(tmp_path, cfg, 3)))
    assert refusal.kind is RefusalKind.SBATCH
    assert str(refusal) == (
        "<config>.slurm.sbatch_args: sbatch --test-only refused the job: allocation failure: Invalid feature specification"
    )


@pytest.mark.parametrize("sbatch_takes_it", [True, False])
def test_a_partition_scontrol_does_not_show_is_left_to_sbatch(tmp_path: Path, sbatch_takes_it: bool) -> None:
    # scontrol hides Hidden partitions that sbatch still accepts: "no such partition" stands
    # only when sbatch --test-only refuses the job too.
    answer = Result(0, "", "sbatch: Job 3 to start") if sbatch_takes_it else Result(1, "", "invalid partition")
    fake = FakeSlurm(test_only=answer)
    site = SiteConfig.model_validate({"default_pool": "x", "pools": {"x": {"partition": "hidden"}}})
    ex = SlurmExecutor(SlurmClient(fake, user="alice"), site)
    got = ex.refusals(ex.plan_many(specs(tmp_path, config(), 1)))
    assert fake.count("sbatch", "--test-only") == 1
    assert [r.kind for r in got] == ([] if sbatch_takes_it else [RefusalKind.NO_PARTITION])


def test_a_shape_our_check_refuses_is_not_sent_to_sbatch(tmp_path: Path) -> None:
    fake = FakeSlurm()
    ex = SlurmExecutor(SlurmClient(fake, user="alice"), SITE)
    (refusal,) = ex.refusals(ex.plan_many(specs(tmp_path, config(resources={"slots_per_trial": 100}), 2)))
    assert refusal.kind is RefusalKind.TOO_MANY_NODES and fake.count("sbatch") == 0


def test_without_sinfo_json_the_size_is_left_to_sbatch(tmp_path: Path) -> None:
    class NoJson(FakeSlurm):
        def __call__(self, argv: Sequence[str], **kw: Any) -> Result:
            if list(argv[:2]) == ["sinfo", "--json"]:
                self.calls.append(list(argv))
                return Result(1, "", "sinfo: error: unrecognized option '--json'")
            return super().__call__(argv, **kw)

    fake = NoJson(test_only=Result(1, "", "allocation failure: Requested node configuration is not available"))
    ex = SlurmExecutor(SlurmClient(fake, user="alice"), SITE)
    (refusal,) = ex.refusals(ex.plan_many(specs(tmp_path, config(resources={"slots_per_trial": 100}), 1)))
    assert refusal.kind is RefusalKind.SBATCH and "Requested node configuration is not available" in refusal.message


NOT_AVAILABLE = Result(1, "", "allocation failure: Requested node configuration is not available")


def drained(*names: str) -> str:
    """The captured ``sinfo --json`` with ``names`` drained, as 22.05 prints it."""
    data = json.loads((DATA / "sinfo.json").read_text())
    for node in data["nodes"]:
        if node["name"] in names:
            node["state_flags"] = ["DRAIN"]
    return json.dumps(data)


class DrainedSlurm(FakeSlurm):
    def __init__(self, sinfo: str) -> None:
        super().__init__(test_only=NOT_AVAILABLE)
        self.sinfo = sinfo

    def answer(self, argv: list[str], input: Optional[str]) -> Result:
        return Result(0, self.sinfo, "") if argv[:2] == ["sinfo", "--json"] else super().answer(argv, input)


def test_sbatch_tests_no_while_a_partition_node_is_drained_is_no_refusal(tmp_path: Path) -> None:
    # sbatch --test-only answers "not available" for a job that needs a drained node (c1 by
    # name, or both cpu nodes), though sbatch queues it (ReqNodeNotAvail) until c1 is back.
    ex = SlurmExecutor(SlurmClient(DrainedSlurm(drained("c1")), user="alice"), SITE)
    cfg = config(resources={"slots_per_trial": 4})
    assert ex.refusals(ex.plan_many(specs(tmp_path, cfg, 1))) == [] and ex.nodes_away == ["c1"]


def test_a_drained_node_of_another_partition_leaves_the_refusal_standing(tmp_path: Path) -> None:
    ex = SlurmExecutor(SlurmClient(DrainedSlurm(drained("g1", "g2")), user="alice"), SITE)
    (refusal,) = ex.refusals(ex.plan_many(specs(tmp_path, config(resources={"slots_per_trial": 4}), 1)))
    assert refusal.kind is RefusalKind.SBATCH and ex.nodes_away == []


def test_another_sbatch_refusal_stands_while_a_node_is_drained(tmp_path: Path) -> None:
    fake = DrainedSlurm(drained("c1"))
    fake.test_only = Result(1, "", "allocation failure: Invalid feature specification")
    ex = SlurmExecutor(SlurmClient(fake, user="alice"), SITE)
    (refusal,) = ex.refusals(ex.plan_many(specs(tmp_path, config(slurm={"sbatch_args": ["-C", "x"]}), 1)))
    assert "Invalid feature specification" in refusal.message


@pytest.mark.parametrize(
    ("state", "away"),
    [
        ("idle", False),
        ("mixed", False),
        ("allocated", False),
        ("idle+drain", True),
        ("down", True),
        ("down+not_responding", True),
        ("mixed+draining", True),
        ("idle+power_down", True),
    ],
)
def test_which_node_states_take_no_new_jobs(state: str, away: bool) -> None:
    nodes = [NodeInfo("c1", ("cpu",), state, 2, 0, 0, 0), NodeInfo("g1", ("gpu",), "down", 2, 0, 2, 0)]
    cfg = config()
    shape = job_shape(cfg, SITE, resource_plan(cfg, SITE))
    assert nodes_away(shape, partitions(), nodes) == (["c1"] if away else [])


def test_an_offline_dry_run_checks_nothing_when_slurm_is_away(tmp_path: Path) -> None:
    def away(argv: Sequence[str], **_: Any) -> Result:
        return Result(1, "", "slurm_load_partitions: Unable to contact slurm controller (connect failure)")

    ex = SlurmExecutor(SlurmClient(away, user="alice"), SITE, offline=True)
    assert ex.refusals(ex.plan_many(specs(tmp_path, config(resources={"slots_per_trial": 100}), 1))) == []
    assert ex.unchecked is not None and "Unable to contact slurm controller" in ex.unchecked


def queued(job_id: str, reason: str) -> str:
    """One squeue record of ours (the captured format), pending for ``reason``."""
    fields = (DATA / "squeue.txt").read_text().splitlines()[0].split("\x1f")
    fields[0] = fields[1] = job_id
    fields[8] = reason
    fields[18] = "detslurm:exp=1,trial=1,run=1,tag=abc"
    return "\x1f".join(fields) + "\x1e\n"


def test_a_job_pending_for_a_permanent_reason_is_cancelled_and_ends(tmp_path: Path) -> None:
    fake = FakeSlurm()
    fake.queue = queued("41", "PartitionNodeLimit") + queued("42", "Resources")
    ex = SlurmExecutor(SlurmClient(fake, user="alice"), SITE)
    out = ex.poll({"41": tmp_path / "a", "42": tmp_path / "b"})
    assert (out["41"].state, out["41"].cause, out["41"].detail) == (
        JobState.EXITED,
        ExitCause.UNSCHEDULABLE,
        "more nodes than the partition allows per job (PartitionNodeLimit)",
    )
    assert (out["42"].state, out["42"].detail) == (JobState.QUEUED, "Resources")
    assert [c for c in fake.calls if c[0] == "scancel"] == [["scancel", "41"]]


def test_a_doomed_job_stays_queued_until_its_scancel_succeeds(tmp_path: Path) -> None:
    fake = FakeSlurm(scancel=1)
    fake.queue = queued("41", "BadConstraints")
    ex = SlurmExecutor(SlurmClient(fake, user="alice"), SITE)
    st = ex.poll({"41": tmp_path / "a"})["41"]
    assert (st.state, st.cause, st.detail) == (JobState.QUEUED, None, "BadConstraints")


def test_the_controller_ends_an_unschedulable_trial_once_and_never_resubmits(det_env: Path, tmp_path: Path) -> None:
    from sqlalchemy import select

    from detslurm import settings as settings_mod
    from detslurm.controller.controller import Controller
    from detslurm.controller.create import execute_create, plan_create
    from detslurm.store import Trial, TrialRun, open_store

    class Submits(FakeSlurm):
        def __call__(self, argv: Sequence[str], **kw: Any) -> Result:
            if list(argv[:2]) == ["sbatch", "--parsable"]:
                self.calls.append(list(argv))
                return Result(0, "77\n", "")
            return super().__call__(argv, **kw)

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text("pass\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: u\nentrypoint: python3 train.py\nmax_restarts: 3\nsearcher: {name: single, metric: m}\n")
    settings = settings_mod.load()
    store = open_store(settings.db_url)
    exp_id = execute_create(store, settings, plan_create(settings, cfg, ctx), "slurm")
    fake = Submits()
    ctl = Controller(store, SlurmExecutor(SlurmClient(fake, user="alice"), SITE))
    ctl.tick([exp_id])  # submits job 77
    fake.queue = queued("77", "PartitionTimeLimit")
    for _ in range(3):  # later ticks must neither resubmit nor cancel again
        ctl.tick([exp_id])
    with store.read() as s:
        (trial,) = s.scalars(select(Trial)).all()
        runs = [(r.run_id, r.exit_reason) for r in s.scalars(select(TrialRun))]
        assert trial.state == "ERROR" and runs == [(1, "unschedulable")]
        assert trial.exit_reason == (
            "the job can never start: a longer time limit than the partition allows (PartitionTimeLimit); "
            "it was canceled"
        )
    assert fake.count("sbatch", "--parsable") == 1 and fake.count("scancel") == 1


def test_the_refusal_check_plans_a_sample_of_the_runs_the_create_submits(det_env: Path, tmp_path: Path) -> None:
    """`det e create`'s refusal check plans two of a 256-trial grid's first runs, not 256: they
    are the first two of the full plan, run for run, and their sbatch has the full plan's shape."""
    from detslurm import settings as settings_mod
    from detslurm.controller.create import dry_run, plan_create
    from detslurm.controller.slurm_plan import _shape_key
    from detslurm.store import open_store

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text("pass\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "name: g\nentrypoint: python3 train.py\n"
        "hyperparameters: {x: {type: int, minval: 0, maxval: 255, count: 256}}\n"
        "searcher: {name: grid, metric: m, max_length: {batches: 1}, max_concurrent_trials: 256}\n"
    )
    settings = settings_mod.load()
    store = open_store(settings.db_url)
    plan = plan_create(settings, cfg, ctx)
    ex = SlurmExecutor(SlurmClient(FakeSlurm(), user="alice"), SITE)
    full = dry_run(store, settings, plan, ex)
    sample = dry_run(store, settings, plan, ex, sample=True)
    assert len(full) == 256 and len(sample) == 2

    # The same runs (rolled back both times, so the same ids), planned alike; only what is drawn
    # afresh per create differs (the experiment dir's random part, the trials' seeds).
    def planned(s: RunSpec) -> tuple[object, ...]:
        return (s.identity, s.env["DET_HPARAMS"], sorted(s.env), s.run_dir.relative_to(s.exp_dir), s.argv)

    assert [planned(s) for s in sample] == [planned(s) for s in full[:2]]
    (whole,), (sampled,) = ex.plan_many(full), ex.plan_many(sample)
    assert "--array=0-255" in whole.request.args and "--array=0-1" in sampled.request.args
    assert _shape_key(whole.request.args) == _shape_key(sampled.request.args)
    fake = FakeSlurm()
    assert SlurmExecutor(SlurmClient(fake, user="alice"), SITE).refusals([sampled]) == []
    assert fake.count("sbatch", "--test-only") == 1
