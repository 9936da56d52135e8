"""``det.pytorch.experimental.torch_batch_process``, run by the real determined 0.38.1 and by us.

One script, written against Determined's API, runs under both interpreters and records what it
saw; the records must be equal. Determined's torch_batch_process refuses to run off-cluster, so
the script hands both sides the same fake trial info (one slot) and an off-cluster Core API
context, through each side's private seam (named in the script): the loop itself, the hooks,
the checkpoints, the resume, the reducers and the output files are then Determined's own on
one side and ours on the other. Several slots and a real preemption run in
tests/local/test_batch_process_local.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from determined_oracle import SCRIPT_RECORD, oracle_python, record_script

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

ARGUMENTS = (
    r"""
import json, sys, torch
import determined as det
from determined.pytorch import experimental
"""
    + SCRIPT_RECORD
    + r"""
class Nothing(experimental.TorchBatchProcessor):
    def __init__(self, context):
        pass
    def process_batch(self, batch, batch_idx):
        pass

data = torch.utils.data.TensorDataset(torch.arange(10))
def run(**kw):
    return lambda: experimental.torch_batch_process(Nothing, kw.pop("dataset", data), **kw)

# Each bad argument alone, then the off-cluster refusal (every argument good).
attempt("interval_0", run(checkpoint_interval=0))
attempt("shuffle", run(dataloader_kwargs={"shuffle": True}))
attempt("sampler", run(dataloader_kwargs={"sampler": [0]}))
attempt("batch_sampler", run(dataloader_kwargs={"batch_sampler": [[0]]}))
attempt("batch_size_twice", run(batch_size=2, dataloader_kwargs={"batch_size": 2}))
attempt("shuffle_before_interval", run(checkpoint_interval=-1, dataloader_kwargs={"shuffle": True}))
attempt("not_sized", run(dataset=iter(range(3))))
attempt("off_cluster", run())
out["abstract"] = [m for m in ("__init__", "process_batch") if m in experimental.TorchBatchProcessor.__abstractmethods__]
json.dump(out, open(sys.argv[1], "w"))
"""
)


def test_arguments_are_checked_as_determined_checks_them(tmp_path: Path) -> None:
    theirs = record_script(oracle_python(), ARGUMENTS, tmp_path / "determined")
    ours = record_script(sys.executable, ARGUMENTS, tmp_path / "detslurm")
    # Determined raises a bare Exception for these two; ours name the kind of mistake.
    assert (theirs.pop("not_sized"), ours.pop("not_sized")) == ("raised Exception", "raised TypeError")
    assert (theirs.pop("off_cluster"), ours.pop("off_cluster")) == ("raised Exception", "raised RuntimeError")
    assert ours == theirs
    assert theirs["interval_0"] == theirs["shuffle"] == theirs["batch_size_twice"] == "raised ValueError"
    assert theirs["shuffle_before_interval"] == "raised ValueError"


LOOP = (
    r"""
import contextlib, importlib, json, pathlib, sys, types, warnings, torch
import determined as det
from determined import core, pytorch
from determined.pytorch import experimental
"""
    + SCRIPT_RECORD
    + r"""
CKPT = pathlib.Path("ckpt").resolve()
events, reports = [], []

# -- The seams: the same fake trial info and an off-cluster Core API context on both sides ----
state = {"info": None, "preempt_at": None, "asked": 0}

def wrapped(ctx):
    # Reports are recorded; a preemption is answered at the preempt_at-th question.
    def should_preempt(auto_ack=True):
        state["asked"] += 1
        return state["asked"] == state["preempt_at"]
    ctx.preempt.should_preempt = should_preempt
    for name in ("report_validation_metrics", "report_metrics"):
        def report(*a, _name=name, **kw):
            reports.append([_name, a, kw])
        setattr(ctx.train, name, report)
    return ctx

try:
    tbp = importlib.import_module("determined.pytorch.experimental._torch_batch_process")
    import determined._info as info_module

    def offcluster(_distributed):
        info, info_module._info = info_module._info, None
        try:
            return wrapped(core.init(checkpoint_storage=str(CKPT)))
        finally:
            info_module._info = info

    tbp._initialize_default_inference_context = offcluster

    def set_info(info):
        info_module._info = info
except ModuleNotFoundError:
    bp = importlib.import_module("detslurm.pytorch.experimental._batch_process")
    bc = importlib.import_module("detslurm.pytorch.experimental._context")

    @contextlib.contextmanager
    def offcluster(_distributed, _info):
        with core.init(checkpoint_storage=str(CKPT)) as ctx:
            yield wrapped(ctx)

    bp._core_context = offcluster

    def set_info(info):
        bp.get_cluster_info = bc.get_cluster_info = lambda: info

def fake_info(latest_checkpoint):
    trial = types.SimpleNamespace(hparams={"model": "m1"}, _config={"checkpoint_storage": {"type": "shared_fs"}})
    return types.SimpleNamespace(task_type="TRIAL", slot_ids=[0], container_addrs=["127.0.0.1"],
                                 latest_checkpoint=latest_checkpoint, trial=trial)

# -- The user's code: written for Determined only ------------------------------------------
class Summer(pytorch.MetricReducer):
    def __init__(self):
        self.reset()
    def reset(self):
        self.total = 0
    def update(self, v):
        self.total += v
    def per_slot_reduce(self):
        return self.total
    def cross_slot_reduce(self, per_slot):
        return {"total": sum(per_slot), "slots": len(per_slot)}

class Processor(experimental.TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.model = context.prepare_model_for_inference(torch.nn.Linear(1, 1))
        self.ids = context.wrap_reducer(lambda vs: sorted(vs), name="ids")
        self.sum = context.wrap_reducer(Summer())
        events.append(["init", context.get_distributed_rank(), context.get_distributed_size(),
                       context.get_hparams(), self.model.training, str(context.device)])
        self.seen = []
    def process_batch(self, batch, batch_idx):
        (x,) = self.context.to_device(batch)
        events.append(["batch", batch_idx, x.tolist()])
        self.seen.append(batch_idx)
        self.ids.update(batch_idx)
        self.sum.update(int(x.sum()))
        self.context.report_metrics("inference", batch_idx + 1, {"n": len(x)})
    def on_checkpoint_start(self):
        events.append(["checkpoint_start"])
        with self.context.upload_path() as path:
            (path / f"upto{self.seen[-1] if self.seen else 'none'}.json").write_text(json.dumps(self.seen))
    def on_finish(self):
        events.append(["finish"])

def checkpoints():
    # Every progress checkpoint on disk: its metadata and its batch_completed.json, oldest first.
    found = []
    for d in CKPT.iterdir():
        if (d / "batch_completed.json").exists():
            md = json.loads((d / "metadata.json").read_text())
            found.append([md["steps_completed"], md["default_output_uuid"], d.name,
                          json.loads((d / "batch_completed.json").read_text())])
    return sorted(found)

def outputs(uuid):
    return sorted(str(p.relative_to(CKPT / uuid)) for p in (CKPT / uuid).rglob("*.json"))

data = torch.utils.data.TensorDataset(torch.arange(23))   # 8 batches of 3 (the last of 2)

def run(name, latest=None, preempt_at=None, **kw):
    events.clear(); reports.clear()
    state.update(info=fake_info(latest), preempt_at=preempt_at, asked=0)
    set_info(state["info"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        experimental.torch_batch_process(Processor, data, **kw)
    out[name] = {"events": list(events), "reports": [[n, list(a), kw] for n, a, kw in reports],
                 "warnings": sorted({type(w.message).__name__ for w in caught if "max_batches" in str(w.message)
                                     or "iterate_length" in str(w.message)})}

# A first run, preempted at its second checkpoint (after 6 batches), then the resumed run.
run("first", preempt_at=2, batch_size=3, checkpoint_interval=3)
first = checkpoints()
out["first_checkpoints"] = [[c[0], c[3]] for c in first]
uuid = first[-1][1]
run("resumed", latest=first[-1][2], batch_size=3, checkpoint_interval=3)
both = checkpoints()
out["all_checkpoints"] = [[c[0], c[3]] for c in both]
out["one_output_uuid"] = len({c[1] for c in both}) == 1
out["outputs"] = outputs(uuid)

# max_batches: within the shard, and out of it (ignored, with a warning); batch_size from the
# loader's kwargs; a checkpoint interval that does not divide the length.
for name, kw in {"max_5": {"max_batches": 5}, "max_0": {"max_batches": 0}, "max_99": {"max_batches": 99},
                 "kwargs_batch_size": {"dataloader_kwargs": {"batch_size": 10, "drop_last": True}}}.items():
    CKPT_BEFORE = {d.name for d in CKPT.iterdir()}
    run(name, **kw)
    out[name]["checkpoints"] = [[c[0], c[3]] for c in checkpoints() if c[2] not in CKPT_BEFORE]

# The context's other methods, on a context built by hand (as Determined's unit tests do).
set_info(None)
with core.init(checkpoint_storage=str(CKPT)) as ctx:
    c = experimental.TorchBatchProcessorContext(ctx, "u/rank_0")
    moved = c.to_device({"a": [torch.ones(2)], "b": (3, "s")})
    out["to_device"] = [type(moved).__name__, type(moved["a"]).__name__, type(moved["b"]).__name__,
                        moved["a"][0].tolist(), list(moved["b"])]
    out["rank_size"] = [c.get_distributed_rank(), c.get_distributed_size()]
    out["reduce_metrics_1_slot"] = [c.wrap_reducer(lambda v: len(v), name="n").update(1), c.reduce_metrics(False)]
    attempt("wrap_twice", lambda: [c.wrap_reducer(r := Summer()), c.wrap_reducer(r)])
    out["default_device"] = str(experimental.get_default_device(ctx))
json.dump(out, open(sys.argv[1], "w"))
"""
)


def test_the_loop_checkpoints_resumes_and_reduces_as_determined(tmp_path: Path) -> None:
    theirs = record_script(oracle_python(), LOOP, tmp_path / "determined")
    ours = record_script(sys.executable, LOOP, tmp_path / "detslurm")
    # wrap_reducer of an already wrapped reducer: Determined raises an AssertionError.
    assert (theirs.pop("wrap_twice"), ours.pop("wrap_twice")) == ("raised AssertionError", "raised ValueError")
    for key in sorted(theirs):
        assert ours.get(key) == theirs[key], key
    assert ours == theirs
    _what_determined_does(theirs)


def _what_determined_does(rec: dict[str, Any]) -> None:
    """The record read as facts, so that a change on both sides at once is seen too."""
    first, resumed = rec["first"]["events"], rec["resumed"]["events"]
    assert [e[1] for e in first if e[0] == "batch"] == [0, 1, 2, 3, 4, 5]
    assert [e[1] for e in resumed if e[0] == "batch"] == [6, 7]  # no batch processed twice
    assert resumed[-3:] == [["batch", 7, [21, 22]], ["checkpoint_start"], ["finish"]]
    assert rec["first_checkpoints"] == [[3, {"batch_completed": 3}], [6, {"batch_completed": 6}]]
    assert rec["all_checkpoints"][-1] == [8, {"batch_completed": 8}] and rec["one_output_uuid"]
    assert rec["outputs"] == ["rank_0/upto2.json", "rank_0/upto5.json", "rank_0/upto7.json"]
    # The reducers of each run: reported as validation metrics where it stopped.
    valid = [r for r in rec["resumed"]["reports"] if r[0] == "report_validation_metrics"]
    assert valid == [
        [
            "report_validation_metrics",
            [],
            {"steps_completed": 8, "metrics": {"ids": [6, 7], "total": 21 + 22 + 18 + 19 + 20, "slots": 1}},
        ]
    ]
    assert [e[1] for e in rec["max_5"]["events"] if e[0] == "batch"] == [0, 1, 2, 3, 4]
    assert rec["max_0"]["warnings"] == rec["max_99"]["warnings"] == ["UserWarning"]
    assert [e[2] for e in rec["kwargs_batch_size"]["events"] if e[0] == "batch"] == [
        list(range(10)),
        list(range(10, 20)),
    ]
