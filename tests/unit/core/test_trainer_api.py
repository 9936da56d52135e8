"""The PyTorchTrial surface real code uses, in one process: batch sizes, gradient aggregation,
schedulers, a GradScaler under CPU autocast, reducers, callbacks, checkpoint layout and loading,
resuming mid-epoch, and clear errors for what is not built."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any, Optional

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from torch import nn  # noqa: E402

from detslurm import pytorch  # noqa: E402
from detslurm.core import DummyDistributedContext  # noqa: E402


def dataset(n: int = 64) -> Any:
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g))


class Linear(pytorch.PyTorchTrial):
    """Plain SGD regression; knobs set per test through class attributes of subclasses."""

    lr = 0.1
    shuffle = True

    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        torch.manual_seed(0)
        self.model = context.wrap_model(nn.Linear(6, 1))
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=self.lr))
        self.setup()

    def setup(self) -> None:
        pass

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}

    def evaluate_batch(self, batch: Any) -> dict[str, Any]:
        x, y = batch
        return {"validation_loss": nn.functional.mse_loss(self.model(x), y)}

    def build_training_data_loader(self) -> Any:
        return pytorch.DataLoader(dataset(), batch_size=self.context.get_per_slot_batch_size(), shuffle=self.shuffle)

    def build_validation_data_loader(self) -> Any:
        return pytorch.DataLoader(dataset(16), batch_size=4)


def fit(
    cls: type[Linear],
    batches: int,
    gbs: int = 8,
    agg: int = 1,
    conf: Optional[dict[str, Any]] = None,
    **kw: Any,
) -> Linear:
    with pytorch.init(hparams={"global_batch_size": gbs}, exp_conf=conf or {}, aggregation_frequency=agg) as ctx:
        trial = cls(ctx)
        pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(batches), **kw)
    return trial


def weights(trial: Linear) -> Any:
    return torch.cat([p.detach().flatten() for p in trial.model.parameters()])


class Slots(DummyDistributedContext):
    """A context that only reports a number of slots (batch-size arithmetic needs no peers)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size


def test_batch_sizes_follow_determined(caplog: pytest.LogCaptureFixture) -> None:
    def ctx(gbs: Any, slots: int) -> pytorch.PyTorchTrialContext:
        return pytorch.PyTorchTrialContext(None, {"global_batch_size": gbs}, {}, Slots(slots))

    assert (ctx(32, 4).get_per_slot_batch_size(), ctx(32, 4).get_global_batch_size()) == (8, 32)
    with caplog.at_level(logging.WARNING):
        assert ctx(10, 4).get_global_batch_size() == 8  # rounded down to divide across the slots
    assert "global_batch_size changed from 10 to 8" in caplog.text
    with pytest.raises(ValueError, match=r"global_batch_size \(2\) must be >= the number of slots \(4\)"):
        ctx(2, 4).get_per_slot_batch_size()
    with pytest.raises(ValueError, match="positive integer"):
        ctx("8", 1).get_per_slot_batch_size()


def test_aggregation_frequency_equals_the_larger_batch(det_env: Path) -> None:
    Linear.shuffle = False  # the same records in the same order for both runs
    try:
        big = fit(Linear, 4, gbs=8, checkpoint_policy="none")
        accumulated = fit(Linear, 8, gbs=4, agg=2, checkpoint_policy="none")
        summed = fit(Linear, 8, gbs=4, agg=2, conf={"optimizations": {"average_aggregated_gradients": False}})

        class DoubleLr(Linear):
            lr = 0.2

        big_double = fit(DoubleLr, 4, gbs=8, checkpoint_policy="none")
    finally:
        Linear.shuffle = True
    assert torch.allclose(weights(accumulated), weights(big), atol=1e-6)
    assert torch.allclose(weights(summed), weights(big_double), atol=1e-6)  # a sum is twice the mean


def test_lr_scheduler_step_modes(det_env: Path) -> None:
    class Scheduled(Linear):
        def setup(self) -> None:
            sched = torch.optim.lr_scheduler.StepLR
            mode = pytorch.LRScheduler.StepMode
            self.per_batch = self.context.wrap_lr_scheduler(sched(self.opt, 100), mode.STEP_EVERY_BATCH, frequency=2)
            self.per_epoch = self.context.wrap_lr_scheduler(sched(self.opt, 100), mode.STEP_EVERY_EPOCH)
            self.manual = self.context.wrap_lr_scheduler(sched(self.opt, 100), mode.MANUAL_STEP)
            self.where: list[tuple[int, int, bool, bool]] = []
            self.lengths = 0

        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
            c = self.context
            self.where.append((c.current_train_batch(), c.current_train_epoch(), c.is_epoch_start(), c.is_epoch_end()))
            return super().train_batch(batch, epoch_idx, batch_idx)

        def get_batch_length(self, batch: Any) -> int:
            self.lengths += 1  # asked once per batch when profiling
            return super().get_batch_length(batch)

    t = fit(Scheduled, 20, checkpoint_policy="none", profiling_enabled=True)  # 8 batches per epoch
    assert (t.per_batch.last_epoch, t.per_epoch.last_epoch, t.manual.last_epoch) == (10, 2, 0)
    assert t.where[7] == (7, 0, False, True) and t.where[8] == (8, 1, True, False) and t.lengths == 20
    with pytest.raises(TypeError, match="StepMode"):
        pytorch.LRScheduler(None, "STEP_EVERY_BATCH")  # type: ignore[arg-type]


def test_grad_scaler_under_cpu_autocast(det_env: Path) -> None:
    class Amp(Linear):
        def setup(self) -> None:
            self.scaler = self.context.wrap_scaler(torch.amp.GradScaler("cpu", init_scale=4.0))

        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
            x, y = batch
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(self.model(x).float(), y)
            # Determined's wrap_scaler usage: the trial scales, unscales before clipping, passes
            # the scaler to step_optimizer and updates it.
            self.context.backward(self.scaler.scale(loss))

            def clip(ps: Any) -> None:
                self.scaler.unscale_(self.opt)
                nn.utils.clip_grad_norm_(ps, 1.0)

            self.context.step_optimizer(self.opt, clip_grads=clip, scaler=self.scaler)
            self.scaler.update()
            return {"loss": loss}

    t = fit(Amp, 6)
    assert torch.isfinite(weights(t)).all() and not torch.equal(weights(t), weights(fit(Linear, 0)))
    ckpt = latest_checkpoint(det_env)
    # growth_interval's default is 2000 steps: 6 finite steps leave the scale where it started.
    assert torch.load(ckpt / "state_dict.pth", weights_only=False)["scaler_state_dict"]["scale"] == 4.0


class Recorder(pytorch.PyTorchCallback):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.loaded: dict[str, Any] = {}

    def on_training_start(self) -> None:
        self.calls.append("training_start")

    def on_training_epoch_start(self, epoch_idx: int) -> None:
        self.calls.append(f"epoch_start{epoch_idx}")

    def on_training_epoch_end(self, epoch_idx: int) -> None:
        self.calls.append(f"epoch_end{epoch_idx}")

    def on_validation_start(self) -> None:
        self.calls.append("validation_start")

    def on_validation_end(self, metrics: dict[str, Any]) -> None:
        self.calls.append(f"validation_end{sorted(metrics)}")

    def on_checkpoint_save_start(self, checkpoint: dict[str, Any]) -> None:
        self.calls.append("save_start")

    def on_checkpoint_upload_end(self, uuid: str) -> None:
        self.calls.append("upload_end")

    def on_checkpoint_load_start(self, checkpoint: dict[str, Any]) -> None:
        self.calls.append("load_start")

    def state_dict(self) -> dict[str, Any]:
        return {"n": len(self.calls)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict


class Biggest(pytorch.MetricReducer):
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.best = float("-inf")

    def update(self, v: float) -> None:
        self.best = max(self.best, v)

    def per_slot_reduce(self) -> float:
        return self.best

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> dict[str, Any]:
        return {"biggest_target": max(per_slot_metrics)}


class Reporting(Linear):
    def setup(self) -> None:
        self.count = self.context.wrap_reducer(lambda vals: sum(vals), name="val_records")
        self.biggest = self.context.wrap_reducer(Biggest())
        self.recorder = Recorder()

    def evaluate_batch(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        self.count.update(len(x))  # type: ignore[attr-defined]
        self.biggest.update(float(y.max()))  # type: ignore[attr-defined]
        return {"validation_loss": nn.functional.mse_loss(self.model(x), y), "n": float(len(x))}

    def evaluation_reducer(self) -> Any:
        return {"n": pytorch.Reducer.SUM}

    def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
        return {"rec": self.recorder}


def test_reducers_and_callback_hooks(det_env: Path) -> None:
    seen: list[dict[str, Any]] = []

    class Spy(Recorder):
        def on_validation_end(self, metrics: dict[str, Any]) -> None:
            seen.append(metrics)

    class WithSpy(Reporting):
        def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
            return {"rec": self.recorder, "spy": Spy()}

    t = fit(WithSpy, 8, validation_period=pytorch.Batch(4))
    assert [m["val_records"] for m in seen] == [16, 16] and [m["n"] for m in seen] == [16.0, 16.0]
    assert seen[0]["biggest_target"] == float(dataset(16).tensors[1].max())
    assert t.recorder.calls[:3] == ["training_start", "epoch_start0", "validation_start"]
    assert "epoch_end0" in t.recorder.calls and "save_start" in t.recorder.calls
    # At batch 8 the epoch ends before the checkpoint is taken (so it holds the stepped schedulers).
    calls = t.recorder.calls
    assert calls.index("epoch_end0") < len(calls) - 1 - calls[::-1].index("save_start")


def latest_checkpoint(det_env: Path) -> Path:
    dirs = [p for p in (det_env / "ckpts").iterdir() if not p.name.startswith(".")]
    return max(dirs, key=lambda p: json.loads((p / "metadata.json").read_text())["steps_completed"])


def test_checkpoint_layout_and_load_trial_from_checkpoint_path(det_env: Path) -> None:
    t = fit(Reporting, 5)
    path = latest_checkpoint(det_env)
    state = torch.load(path / "state_dict.pth", weights_only=False)
    assert {"models_state_dict", "optimizers_state_dict", "lr_schedulers_state_dict", "callbacks", "rng_state"} <= set(
        state
    )
    assert {"cpu_rng_state", "random_rng_state"} <= set(state["rng_state"]) and "rec" in state["callbacks"]
    md = json.loads((path / "metadata.json").read_text())
    assert set(md) == {"determined_version", "steps_completed", "framework", "format"} and md["steps_completed"] == 5
    trial_state = pickle.loads((path / "trial_state.pkl").read_bytes())
    assert trial_state["batches_trained"] == 5 and "trial_id" in trial_state
    spec = json.loads((path / "load_data.json").read_text())["trial_cls_spec"]
    assert spec == f"{__name__}:Reporting"
    loaded = pytorch.load_trial_from_checkpoint_path(path)  # the class found from load_data.json
    assert isinstance(loaded, Reporting) and torch.equal(weights(loaded), weights(t))
    assert loaded.context.get_hparams() == {"global_batch_size": 8}
    with pytest.raises(FileNotFoundError, match="not a Trainer checkpoint"):
        pytorch.load_trial_from_checkpoint_path(det_env)


def test_resume_mid_epoch_equals_the_uninterrupted_run(det_env: Path) -> None:
    whole = weights(fit(Linear, 20, checkpoint_policy="none"))
    fit(Linear, 11, checkpoint_policy="none", checkpoint_period=pytorch.Batch(11))  # 8 per epoch: mid-epoch
    uuid = latest_checkpoint(det_env).name
    resumed = fit(Linear, 20, checkpoint_policy="none", latest_checkpoint=uuid)
    assert torch.equal(weights(resumed), whole)


def test_full_dataset_evaluation_and_a_plain_torch_loader(det_env: Path) -> None:
    got: list[dict[str, Any]] = []

    class Full(Linear):
        def build_training_data_loader(self) -> Any:
            return torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=True)

        def evaluate_full_dataset(self, data_loader: Any) -> dict[str, Any]:
            n = sum(len(x) for x, _ in data_loader)
            return {"validation_loss": 1.0, "records": n}

        def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
            class Cb(pytorch.PyTorchCallback):
                def on_validation_end(self, metrics: dict[str, Any]) -> None:
                    got.append(dict(metrics))  # a copy: the report adds to the same dict after

            return {"cb": Cb()}

    fit(Full, 4, checkpoint_policy="none")
    # As in Determined, on_validation_end sees the trial's metrics only (batches and epochs are
    # added to the report after it).
    assert got[-1] == {"validation_loss": 1.0, "records": 16}


def test_what_is_not_built_fails_at_once_naming_itself() -> None:
    # configure_apex_amp is built now (tests/unit/compat/test_determined_oracle_apex.py).
    ctx = pytorch.CheckpointLoadContext({"global_batch_size": 4})
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(NotImplementedError, match="backward_passes_per_step"):
        ctx.wrap_optimizer(opt, backward_passes_per_step=2)
    with pytest.raises(ValueError, match="not passed to context.wrap_optimizer"):
        ctx.step_optimizer(opt)
    with pytest.raises(NotImplementedError, match="get_tensorboard_writer"):
        ctx.get_tensorboard_writer()
    # A function wrapped without a name is Determined's way to return a dict of metrics: only
    # its result is checked, and a reducer that is neither function nor MetricReducer fails.
    with pytest.raises(TypeError, match="takes a function or a det.pytorch.MetricReducer"):
        ctx.wrap_reducer(3)  # type: ignore[arg-type]
    reducer = ctx.wrap_reducer(sum)
    reducer.update(2.0)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"sum\(\) was wrapped without a name but returned float"):
        ctx.reduce_metrics(for_training=True)
    with pytest.raises(ValueError, match="already wrapped"):
        ctx.wrap_reducer(reducer)


def test_compat_import_path_has_the_new_names() -> None:
    import subprocess
    import sys

    from conftest import ROOT

    probe = "from determined.pytorch import DataLoader, MetricReducer, load_trial_from_checkpoint_path; print('ok')"
    r = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(ROOT / "detslurm" / "_compat"), "PATH": "/usr/bin"},
        capture_output=True,
        text=True,
    )
    assert r.stdout.strip() == "ok", r.stderr


def test_batch_metrics_become_numbers_once_per_window(det_env: Path) -> None:
    """train_batch's tensors are converted at each report, all at once (no host sync per batch),
    to the numbers .item() would give: ints stay ints, bools bools, a vector its list of values
    (Determined keeps it per batch too; the window's average is over all of its values)."""
    windows: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []

    class Spy(pytorch.PyTorchCallback):
        def on_training_workload_end(self, avg: dict[str, Any], batch_metrics: list[dict[str, Any]]) -> None:
            windows.append((avg, batch_metrics))

    class Typed(Linear):
        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
            out = super().train_batch(batch, epoch_idx, batch_idx)
            x, _ = batch
            return {
                **out,
                "n": torch.tensor(len(x)),
                "big": torch.tensor(batch_idx >= 2),
                "vec": torch.tensor([1.0, 3.0 + batch_idx]),
                "label": "plain",
            }

        def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
            return {"spy": Spy()}

    fit(Typed, 4, reporting_period=pytorch.Batch(2))
    rows = [row for _, batch in windows for row in batch]
    assert len(rows) == 4
    assert all(type(r["loss"]) is float and type(r["n"]) is int and r["n"] == 8 for r in rows)
    assert [r["big"] for r in rows] == [False, False, True, True] and all(type(r["big"]) is bool for r in rows)
    assert [r["vec"] for r in rows] == [[1.0, 3.0], [1.0, 4.0], [1.0, 5.0], [1.0, 6.0]] and rows[0]["label"] == "plain"
    assert windows[0][0]["n"] == 8.0 and windows[1][0]["vec"] == 3.25
