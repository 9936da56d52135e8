"""Core API pieces that user code builds by hand, run by the real determined 0.38.1 and by us.

One script, written against Determined's API only, builds the ``Dummy*`` contexts, the info
types and the enums the way a user's unit tests do, exercises them, and prints what it saw as
JSON. It runs under the oracle's interpreter and under ours (where ``import determined`` is
detslurm's compatibility package); the two records must be equal. What only detslurm can show
(a trial's ClusterInfo decoded from the job's environment, alerts as events) is tested below.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from determined_oracle import SCRIPT_RECORD, oracle_python, record_script

from detslurm.core._context import Context
from detslurm.core._distributed import DummyDistributedContext
from detslurm.core._preempt import DummyPreemptContext
from detslurm.core._searcher import DummySearcherContext
from detslurm.core._train import DummyTrainContext
from detslurm.protocol import trial_env
from detslurm.protocol.events import Alert, Event

SCRIPT = (
    r"""
import json, sys, tempfile, pathlib
import determined as det
from determined import core
"""
    + SCRIPT_RECORD
    + r"""
# The enums' values, which code stores and compares.
out["unit"] = {u.name: u.value for u in core.Unit}
out["searcher_mode"] = {m.name: m.value for m in core.SearcherMode}
out["unit_from_value"] = core.Unit("EPOCHS").name
out["chief_only_from_value"] = core.SearcherMode("CHEIF_ONLY").name

# InvalidHP: an optional message string.
out["invalid_hp"] = [str(det.InvalidHP()), str(det.InvalidHP("lr too big")), det.InvalidHP("x").msg]
attempt("invalid_hp_not_str", lambda: det.InvalidHP(3))

# The info types, built by hand as a launch layer or a test does.
trial = det.TrialInfo(trial_id=7, experiment_id=3, trial_seed=11, hparams={"lr": 0.1},
                      config={"data": {"url": "u"}}, steps_completed=40, trial_run_id=2,
                      debug=False, inter_node_network_interface=None)
rdzv = det.RendezvousInfo(container_addrs=["a", "b"], container_rank=1, container_slot_counts=[2, 2])
res = det.ResourcesInfo(gpu_uuids=["GPU-1"])
info = det.ClusterInfo(master_url="http://m:8080", cluster_id="c", agent_id="n1", slot_ids=[0, 1],
                       task_id="t", allocation_id="al", session_token="s", task_type="TRIAL",
                       latest_checkpoint="ck", trial_info=trial, rendezvous_info=rdzv, resources_info=res)
out["trial_info"] = [trial.trial_id, trial.experiment_id, trial.trial_seed, trial.hparams,
                     trial._config, trial._steps_completed, trial._trial_run_id, trial._debug]
out["cluster_info"] = [info.container_addrs, info.container_rank, info.container_slot_counts,
                       info.gpu_uuids, info.latest_checkpoint, info.user_data, info.trial.trial_id,
                       info.slot_ids, info.task_type]
cmd = det.ClusterInfo(master_url="http://m:8080", cluster_id="c", agent_id="n1", slot_ids=[0],
                      task_id="t", allocation_id="al", session_token="s", task_type="COMMAND",
                      latest_checkpoint="ck")
out["command_info"] = [cmd.container_addrs, cmd.container_rank, cmd.container_slot_counts,
                       cmd.latest_checkpoint, cmd.user_data]
attempt("command_info_trial", lambda: cmd.trial)
out["no_cluster_info"] = det.get_cluster_info() is None

# The Dummy contexts a user's unit tests build.
dist = core.DummyDistributedContext()
out["dist"] = [dist.get_rank(), dist.get_size(), dist.get_local_rank(), dist.get_num_agents(),
               dist.broadcast(5), dist.allgather(6), dist.gather(7)]

preempt = core.DummyPreemptContext(dist, preempt_mode=core.PreemptMode.WorkersAskChief)
attempt("preempt_before_start", lambda: preempt.should_preempt())
preempt.start()
out["preempt"] = preempt.should_preempt()
preempt.close()

searcher = core.DummySearcherContext(dist, length=4)
ops = []
for op in searcher.operations():
    op.report_progress(2)
    op.report_completed(0.5)
    attempt("op_completed_twice", lambda: op.report_completed(0.5))
    ops.append(op.length)
out["ops"] = ops
out["units"] = searcher.get_configured_units().name
def unfinished():
    for op in core.DummySearcherContext(dist).operations():
        pass
attempt("op_not_completed", unfinished)
worker = core.DummySearcherOperation(3, is_chief=False)
attempt("worker_reports", lambda: worker.report_completed(1.0))

missing = core.SearcherContextMissing()
attempt("missing_operations", lambda: list(missing.operations()))
attempt("missing_units", lambda: missing.get_configured_units())
attempt("missing_ack", lambda: missing.acknowledge_out_of_ops())

tb = pathlib.Path(tempfile.mkdtemp()) / "tb"
train = core.DummyTrainContext(tensorboard_path=tb)
train.report_training_metrics(steps_completed=1, metrics={"loss": 1.0})
train.report_validation_metrics(steps_completed=1, metrics={"loss": 1.0})
train.report_progress(0.5)
train.set_status("training")
out["train"] = [train.get_tensorboard_path() == tb, train.get_experiment_best_validation()]

base = tempfile.mkdtemp()
try:  # what a Determined user passes; detslurm has no storage managers and takes the directory
    from determined.common.storage import SharedFSStorageManager
    storage = SharedFSStorageManager(base)
except ImportError:
    storage = base
ckpt = core.DummyCheckpointContext(dist, storage)
with ckpt.store_path({"steps_completed": 3}) as (path, uuid):
    (path / "w.txt").write_text("weights")
with ckpt.restore_path(uuid) as path:
    out["ckpt_restored"] = (path / "w.txt").read_text()
dl = pathlib.Path(tempfile.mkdtemp()) / "dl"
ckpt.download(uuid, dl)
out["ckpt_downloaded"] = (dl / "w.txt").read_text()
ckpt.delete(uuid)
out["ckpt_deleted"] = not (pathlib.Path(base) / uuid).exists()

profiler = core.DummyProfilerContext()
profiler.on(sampling_interval=1, samples_per_report=10)
profiler.off()
experimental = core.DummyExperimentalCoreContext()
out["experimental"] = experimental.report_task_using_checkpoint(None)

from determined import pytorch
out["should_stop"] = [
    [pytorch.Batch(3).should_stop(n) for n in range(7)],
    [pytorch.Epoch([2, 5]).should_stop(n) for n in range(7)],
    [pytorch.Batch(0).should_stop(n) for n in range(3)],
]
json.dump(out, open(sys.argv[1], "w"), sort_keys=True)
"""
)


@pytest.mark.torch
def test_dummy_contexts_info_types_and_enums_behave_as_determined(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # the script imports determined.pytorch on both sides
    theirs = record_script(oracle_python(), SCRIPT, tmp_path / "determined")
    ours = record_script(sys.executable, SCRIPT, tmp_path / "detslurm")
    assert ours == theirs, "\n".join(
        f"{k}: Determined {theirs.get(k)!r}, detslurm {ours.get(k)!r}"
        for k in sorted({*theirs, *ours})
        if theirs.get(k) != ours.get(k)
    )


# What only detslurm has: the job's environment and the event file behind these objects.
def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = trial_env(
        experiment_id=3,
        trial_id=7,
        run_id=2,
        seed=11,
        hparams={"lr": 0.1},
        config={"data": {"url": "u"}},
        latest_checkpoint="ck",
        steps_completed=40,
        run_dir=tmp_path / "run",
        trial_dir=tmp_path / "trial",
        exp_dir=tmp_path / "exp",
        checkpoint_base=str(tmp_path / "ckpts"),
        resources_type="slurm",
        slot_ids=[0, 1],
        container_addrs=["n1", "n2"],
        user="me",
    )
    return {**env, **extra}


def test_a_trials_cluster_info_is_determineds_type_fed_by_the_job_env(tmp_path: Path) -> None:
    import detslurm as det
    from detslurm.protocol import from_env

    info = from_env(_env(tmp_path, SLURM_NODEID="1", CUDA_VISIBLE_DEVICES="GPU-aa,GPU-bb"))
    assert info is not None
    assert isinstance(info, det.ClusterInfo) and isinstance(info.trial, det.TrialInfo)
    assert (info.container_addrs, info.container_rank, info.container_slot_counts) == (["n1", "n2"], 1, [2, 2])
    assert info.gpu_uuids == ["GPU-aa", "GPU-bb"]
    assert (info.trial.trial_id, info.trial._steps_completed, info.trial._trial_run_id) == (7, 40, 2)
    assert info.user_data == {"url": "u"} and info.latest_checkpoint == "ck"
    # Indices, not UUIDs: nothing to report without asking the driver.
    assert from_env(_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1")).gpu_uuids == []  # type: ignore[union-attr]


class _Events:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def flush(self) -> None:
        pass


def _trial_context(tmp_path: Path, writer: _Events) -> Context:
    from detslurm.protocol import from_env

    dist = DummyDistributedContext()
    return Context(
        distributed=dist,
        train=DummyTrainContext(),
        checkpoint=None,  # type: ignore[arg-type]  # not used by alert()
        preempt=DummyPreemptContext(dist),
        searcher=DummySearcherContext(dist),
        info=from_env(_env(tmp_path)),
        writer=writer,
    )


def test_alert_defaults_to_info_and_checks_the_level(tmp_path: Path) -> None:
    writer = _Events()
    ctx = _trial_context(tmp_path, writer)
    ctx.alert()
    ctx.alert(title="diverged", description="loss is nan", level="error")
    assert writer.events == [
        Alert(title="", description="", level="info", time=writer.events[0].time),
        Alert(title="diverged", description="loss is nan", level="error", time=writer.events[1].time),
    ]
    with pytest.raises(ValueError, match="level must be one of warn, info, debug, error"):
        ctx.alert(level="warning")


def test_alert_off_cluster_says_where_it_works() -> None:
    import detslurm.core as core

    with core.init() as ctx, pytest.raises(ValueError, match="only in a trial"):
        ctx.alert(title="x")


def test_off_cluster_init_hands_out_the_dummy_contexts() -> None:
    import detslurm.core as core

    with core.init() as ctx:
        assert isinstance(ctx.train, core.DummyTrainContext)
        assert isinstance(ctx.checkpoint, core.DummyCheckpointContext)
        assert isinstance(ctx.searcher, core.DummySearcherContext)
        assert isinstance(ctx.profiler, core.DummyProfilerContext)
        assert isinstance(ctx.experimental, core.DummyExperimentalCoreContext)
        assert [op.length for op in _completed(ctx.searcher.operations())] == [1]


def _completed(ops: Any) -> list[Any]:
    done = []
    for op in ops:
        op.report_completed(0.0)
        done.append(op)
    return done


def test_profiler_on_a_trial_says_once_that_nothing_is_collected(caplog: pytest.LogCaptureFixture) -> None:
    from detslurm.core import ProfilerContext

    profiler = ProfilerContext()
    profiler.on()
    profiler.on(sampling_interval=2)
    assert profiler.is_on
    assert [r.getMessage() for r in caplog.records].count(
        "core_context.profiler.on(): detslurm collects no system metrics; use Slurm's `sstat -j JOBID` / "
        "`sacct -j JOBID` (or the site's monitoring) for the job's use"
    ) == 1
    with pytest.raises(ValueError, match="must be >= 1"):
        profiler.on(sampling_interval=0)


def test_the_dummy_train_context_checks_reports_as_a_trial_does() -> None:
    """Determined's dummy logs anything; its trial context refuses a progress outside [0, 1].
    Ours refuses it off-cluster too, so a unit test finds what would fail on the cluster."""
    with pytest.raises(ValueError, match="progress must be between 0 and 1"):
        DummyTrainContext().report_progress(2.0)
    with pytest.raises(ValueError, match="metric group"):
        DummyTrainContext().report_metrics("a.b", 1, {"x": 1})
