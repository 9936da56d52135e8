"""DeepSpeedTrial under det.pytorch.deepspeed's Trainer, off-cluster in one process with a real
DeepSpeed engine on the CPU: micro batches and gradient accumulation, evaluation through the
micro-batch iterator, the engines' checkpoints and resuming from them, the data-loader checks,
and the config helpers compared with the real determined 0.38.1 (whose DeepSpeedTrial needs a
GPU, so the Trainer itself is not run there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
deepspeed = pytest.importorskip("deepspeed")
# DeepSpeed builds its CPU communication op at the first initialize: wait for scripts/test's build.
pytestmark = [pytest.mark.torch, pytest.mark.late_build]

from determined_oracle import SCRIPT_RECORD, oracle_python, record_script  # noqa: E402
from torch import nn  # noqa: E402

from detslurm import pytorch  # noqa: E402
from detslurm.pytorch import deepspeed as det_ds  # noqa: E402

MICRO, GAS, LR = 2, 3, 0.05


@pytest.fixture(autouse=True)
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # deepspeed.initialize joins a torch.distributed group: a group of one, on this host.
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WORLD_SIZE", "1")


def dataset(n: int) -> Any:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


class Regression(det_ds.DeepSpeedTrial):
    manual = False

    def __init__(self, context: det_ds.DeepSpeedTrialContext) -> None:
        self.context = context
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        self.engine = context.wrap_model_engine(engine)
        if self.manual:
            context.disable_auto_grad_accumulation()
        self.calls: list[tuple[int, int]] = []
        self.seen: list[Any] = []

    def _micro(self, it: Any) -> Any:
        x, y = next(it)
        self.seen.append(x)
        loss = nn.functional.mse_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def train_batch(self, dataloader_iter: Any, epoch_idx: int, batch_idx: int) -> Any:
        self.calls.append((epoch_idx, batch_idx))
        if self.manual:
            return {"loss": sum(self._micro(dataloader_iter) for _ in range(GAS)) / GAS}
        return self._micro(dataloader_iter)  # a bare loss tensor is reported as "loss"

    def evaluate_batch(self, dataloader_iter: Any, batch_idx: int) -> dict[str, Any]:
        x, y = next(dataloader_iter)
        return {"val_loss": nn.functional.mse_loss(self.engine(x), y), "idx": batch_idx}

    def build_training_data_loader(self) -> Any:
        return pytorch.DataLoader(dataset(24), batch_size=self.context.get_train_micro_batch_size_per_gpu())

    def build_validation_data_loader(self) -> Any:
        return pytorch.DataLoader(dataset(8), batch_size=MICRO)


def fit(cls: type[Regression], batches: int, **kw: Any) -> Regression:
    with det_ds.init(hparams={"global_batch_size": MICRO * GAS}) as ctx:
        trial = cls(ctx)
        det_ds.Trainer(trial, ctx).fit(max_length=pytorch.Batch(batches), **kw)
    return trial


def weights(trial: Regression) -> Any:
    return torch.cat([p.detach().flatten() for p in trial.engine.module.parameters()])


def by_hand(batches: int) -> Any:
    """The same regression as a hand-written DeepSpeed loop: GAS micro batches per batch, in
    the data's order."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    x, y = dataset(24).tensors
    for step in range(batches * GAS):
        i = (step * MICRO) % 24
        engine.backward(nn.functional.mse_loss(engine(x[i : i + MICRO]), y[i : i + MICRO]))
        engine.step()
    return torch.cat([p.detach().flatten() for p in engine.module.parameters()])


def test_a_batch_is_the_engines_accumulation_steps_of_micro_batches(det_env: Path) -> None:
    t = fit(Regression, 5, checkpoint_policy="none")  # 12 micro batches per epoch: 4 batches
    assert t.calls == [(0, 0)] * 3 + [(0, 1)] * 3 + [(0, 2)] * 3 + [(0, 3)] * 3 + [(1, 4)] * 3
    x = dataset(24).tensors[0]
    assert torch.equal(torch.cat(t.seen), torch.cat([x, x[:6]]))  # in order, and on into epoch 2
    assert t.engine.global_steps == 5
    assert torch.allclose(weights(t), by_hand(5), atol=1e-6)


def test_disable_auto_grad_accumulation_calls_train_batch_once_per_batch(det_env: Path) -> None:
    class Manual(Regression):
        manual = True

    t = fit(Manual, 3, checkpoint_policy="none")
    assert t.calls == [(0, 0), (0, 1), (0, 2)]
    assert torch.allclose(weights(t), by_hand(3), atol=1e-6)


def test_validation_hands_evaluate_batch_the_micro_batch_iterator(det_env: Path) -> None:
    seen: list[dict[str, Any]] = []

    class Cb(pytorch.PyTorchCallback):
        def on_validation_end(self, metrics: dict[str, Any]) -> None:
            seen.append(metrics)

    class Validated(Regression):
        def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
            return {"cb": Cb()}

    t = fit(Validated, 2, checkpoint_policy="none", validation_period=pytorch.Batch(1))
    assert len(seen) == 2
    assert seen[0]["idx"] == pytest.approx(1.5)  # 8 records in micro batches of 2: idx 0..3
    x, y = dataset(8).tensors
    with torch.no_grad():
        expected = sum(nn.functional.mse_loss(t.engine(x[i : i + 2]), y[i : i + 2]).item() for i in (0, 2, 4, 6)) / 4
    assert seen[1]["val_loss"] == pytest.approx(expected, rel=1e-5)


def checkpoints(det_env: Path) -> list[Path]:
    root = det_env / "ckpts"
    return sorted((p for p in root.iterdir() if not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)


def test_checkpoints_are_the_engines_and_resume_to_the_uninterrupted_weights(det_env: Path) -> None:
    whole = weights(fit(Regression, 6, checkpoint_policy="none"))
    fit(Regression, 3, checkpoint_policy="none", checkpoint_period=pytorch.Batch(3))  # mid-epoch
    ckpt = checkpoints(det_env)[-1]
    assert (ckpt / "model0").is_dir()  # DeepSpeed's own layout, tag model0
    assert json.loads((ckpt / "load_data.json").read_text())["trial_type"] == "DeepSpeedTrial"
    resumed = fit(Regression, 6, checkpoint_policy="none", latest_checkpoint=ckpt.name)
    assert resumed.calls[0] == (0, 3)  # resumed at batch 3
    assert torch.allclose(weights(resumed), whole, atol=1e-6)


def test_a_plain_torch_loader_needs_the_reproducibility_checks_off(det_env: Path) -> None:
    class Plain(Regression):
        def build_training_data_loader(self) -> Any:
            return torch.utils.data.DataLoader(dataset(24), batch_size=MICRO)

    with pytest.raises(TypeError, match="disable_dataset_reproducibility_checks"):
        fit(Plain, 1, checkpoint_policy="none")

    class Allowed(Plain):
        def __init__(self, context: det_ds.DeepSpeedTrialContext) -> None:
            super().__init__(context)
            context.disable_dataset_reproducibility_checks()

    assert fit(Allowed, 2, checkpoint_policy="none").engine.global_steps == 2


def test_the_context_without_an_engine_and_set_mpu(det_env: Path) -> None:
    with det_ds.init(hparams={"global_batch_size": 4}) as ctx:
        with pytest.raises(ValueError, match="wrap_model_engine"):
            ctx.get_num_micro_batches_per_slot()
        with pytest.raises(ValueError, match="wrap_model_engine"):
            ctx.set_mpu(det_ds.ModelParallelUnit(0, 1, True, True))
        assert ctx.get_per_slot_batch_size() == 4 and ctx.get_initial_batch() == 0


SCRIPT = (
    r"""
import json, sys
from determined import core
from determined.pytorch import deepspeed as det_ds
"""
    + SCRIPT_RECORD
    + r"""
base = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.1, "eps": 1e-8}}, "fp16": {"enabled": False}}
src = {"optimizer": {"params": {"lr": 0.01}}, "fp16": True, "new": {"a": 1}}
out["merged"] = det_ds.overwrite_deepspeed_config(base, src)
out["base_unchanged"] = base
open("ds.json", "w").write(json.dumps(base))
out["from_file"] = det_ds.overwrite_deepspeed_config("ds.json", {"train_batch_size": 16})
open("dup.json", "w").write('{"a": 1, "a": 2}')
attempt("duplicate_keys", lambda: det_ds.overwrite_deepspeed_config("dup.json", {}))
attempt("not_a_config", lambda: det_ds.overwrite_deepspeed_config(3, {}))
mpu = det_ds.make_data_parallel_mpu(core.DummyDistributedContext())
out["mpu"] = [mpu.data_parallel_rank, mpu.data_parallel_world_size, mpu.should_report_metrics, mpu.should_build_data_loader]
out["mpu_eq"] = det_ds.ModelParallelUnit(0, 1, True, True) == mpu

class Grid:
    def __init__(self, stage, stages, slice_rank):
        self.s, self.n, self.sl = stage, stages, slice_rank
    def get_pipe_parallel_rank(self): return self.s
    def get_pipe_parallel_world_size(self): return self.n
    def get_slice_parallel_rank(self): return self.sl
    def get_data_parallel_rank(self): return 1
    def get_data_parallel_world_size(self): return 2
out["pipeline_mpus"] = [[m.data_parallel_rank, m.data_parallel_world_size, m.should_build_data_loader]
                        for m in (det_ds.make_deepspeed_mpu(Grid(s, 3, sl)) for s in range(3) for sl in (0, 1))]
json.dump(out, open(sys.argv[1], "w"), sort_keys=True)
"""
)


def test_config_helpers_and_mpus_behave_as_determined(tmp_path: Path) -> None:
    theirs = record_script(oracle_python(), SCRIPT, tmp_path / "determined")
    ours = record_script(sys.executable, SCRIPT, tmp_path / "detslurm")
    assert ours == theirs


MODEL_DEF = """
import deepspeed, torch
from torch import nn
from determined import pytorch
from determined.pytorch import deepspeed as det_ds


class Regression(det_ds.DeepSpeedTrial):
    def __init__(self, context):
        self.context = context
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        self.engine = context.wrap_model_engine(engine)

    def train_batch(self, it, epoch_idx, batch_idx):
        x, y = next(it)
        loss = nn.functional.mse_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        return {"loss": loss}

    def evaluate_batch(self, it, batch_idx):
        x, y = next(it)
        return {"validation_loss": nn.functional.mse_loss(self.engine(x), y)}

    def _data(self):
        g = torch.Generator().manual_seed(5)
        return torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))

    def build_training_data_loader(self):
        return pytorch.DataLoader(self._data(), batch_size=self.context.get_train_micro_batch_size_per_gpu())

    def build_validation_data_loader(self):
        return pytorch.DataLoader(self._data(), batch_size=2)
"""

LEGACY_CONFIG = """name: ds-legacy
hyperparameters: {global_batch_size: 4}
searcher: {name: single, metric: validation_loss, max_length: {batches: 6}}
min_validation_period: {batches: 3}
entrypoint: model_def:Regression
"""


@pytest.mark.e2e
def test_a_legacy_entrypoint_runs_a_deepspeed_trial_as_a_local_experiment(
    det: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy import select

    from detslurm import settings
    from detslurm.store import Checkpoint, Metric, open_store

    # The trial runs without this process's group variables (its port is held by this process's
    # group): the Trainer's init makes a group of one with a port of its own.
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "model_def.py").write_text(MODEL_DEF)
    (tmp_path / "ds.yaml").write_text(LEGACY_CONFIG)
    code, out, err = det("e", "create", "--local", tmp_path / "ds.yaml", ctx)
    assert code == 0, out + err
    with open_store(settings.load().db_url).tx() as s:
        steps = s.scalars(select(Metric.steps_completed).where(Metric.group == "validation")).all()
        ck = s.scalars(select(Checkpoint).where(Checkpoint.state == "COMPLETED")).first()
        assert sorted(steps) == [3, 6]
        assert ck is not None and (Path(ck.storage_path) / "model0").is_dir()
