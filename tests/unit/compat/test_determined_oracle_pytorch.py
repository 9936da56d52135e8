"""PyTorchTrialContext pieces that Determined's API has and detslurm built to match: mixed
precision of the forward pass, the Trainer's profiler and TensorBoard switches, batches left
where the loader made them, and Determined's older ``load_trial_from_checkpoint_path(**kwargs)``.
(Their names and signatures are compared with determined 0.38.1 by the surface test; these
tests show what they do. Determined's autocast is CUDA's, a no-op on a CPU, so its numbers are
not compared here.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from torch import nn  # noqa: E402

from detslurm import pytorch  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.seen: list[tuple[bool, Any]] = []

    def forward(self, x: Any) -> Any:
        y = self.fc(x)
        self.seen.append((torch.is_autocast_enabled("cpu"), y.dtype))
        return {"y": y, "parts": [y, y.detach()]}


def test_autocast_forward_pass_runs_forward_in_autocast_and_returns_float32() -> None:
    ctx = pytorch.CheckpointLoadContext()
    net = Net()
    wrapped = ctx.autocast_forward_pass(net)
    out = wrapped(torch.randn(3, 4))
    assert net.seen == [(True, torch.bfloat16)]  # inside: the CPU's autocast dtype
    assert out["y"].dtype == torch.float32 and [p.dtype for p in out["parts"]] == [torch.float32] * 2
    # The same model in every other respect.
    assert isinstance(wrapped, Net) and wrapped.fc is net.fc
    assert list(wrapped.state_dict()) == ["fc.weight", "fc.bias"]
    assert [id(p) for p in wrapped.parameters()] == [id(p) for p in net.parameters()]
    wrapped.extra = 3
    assert net.extra == 3  # type: ignore[attr-defined]
    # The model itself is untouched: called directly it runs in float32.
    net(torch.randn(1, 4))
    assert net.seen[-1] == (False, torch.float32)


class AmpTrial(pytorch.PyTorchTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        context.experimental.use_amp()
        torch.manual_seed(0)
        self.net = Net()
        self.model = context.wrap_model(self.net)
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x)["y"], y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}

    def evaluate_batch(self, batch: Any) -> dict[str, Any]:
        x, y = batch
        return {"validation_loss": nn.functional.mse_loss(self.model(x)["y"], y)}

    def build_training_data_loader(self) -> Any:
        return pytorch.DataLoader(dataset(), batch_size=self.context.get_per_slot_batch_size())

    def build_validation_data_loader(self) -> Any:
        return pytorch.DataLoader(dataset(), batch_size=4)


def dataset() -> Any:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g))


def test_use_amp_trains_models_wrapped_after_it_in_autocast() -> None:
    with pytorch.init(hparams={"global_batch_size": 4}) as ctx:
        trial = AmpTrial(ctx)
        before = trial.net.fc.weight.detach().clone()
        pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(3), checkpoint_policy="none")
    assert trial.net.seen[:3] == [(True, torch.bfloat16)] * 3
    assert not torch.equal(before, trial.net.fc.weight)  # it trained
    assert trial.net.fc.weight.dtype == torch.float32  # the weights stay float32


def test_use_amp_after_wrap_model_is_refused() -> None:
    ctx = pytorch.CheckpointLoadContext()
    ctx.wrap_model(Net())
    with pytest.raises(RuntimeError, match="before context.wrap_model"):
        ctx.experimental.use_amp()


class DeviceTrial(AmpTrial):
    """Records what train_batch is handed."""

    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        self.model = context.wrap_model(nn.Linear(4, 2))
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))
        self.batches: list[Any] = []
        self.setup()

    def setup(self) -> None:
        pass

    def build_training_data_loader(self) -> Any:
        return torch.utils.data.DataLoader(dataset(), batch_size=4)

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        self.batches.append(batch)
        return {"loss": torch.tensor(0.0)}

    def evaluate_batch(self, batch: Any) -> dict[str, Any]:
        return {"validation_loss": torch.tensor(0.0)}


def test_disable_auto_to_device_hands_batches_over_as_the_loader_made_them(monkeypatch: pytest.MonkeyPatch) -> None:
    moved: list[Any] = []
    real = pytorch.PyTorchTrialContext.to_device

    def spy(self: Any, data: Any) -> Any:
        moved.append(data)
        return real(self, data)

    monkeypatch.setattr(pytorch.PyTorchTrialContext, "to_device", spy)

    class Off(DeviceTrial):
        def setup(self) -> None:
            self.context.experimental.disable_auto_to_device()

    for cls, expect_moved in ((DeviceTrial, True), (Off, False)):
        moved.clear()
        with pytorch.init(hparams={"global_batch_size": 4}) as ctx:
            trial = cls(ctx)
            pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(2), checkpoint_policy="none")
        assert len(trial.batches) == 2
        assert bool(moved) is expect_moved, cls.__name__


PROFILED = """
import sys, pathlib, torch
import determined as det
from determined import pytorch
sys.path.insert(0, sys.argv[2])
from test_determined_oracle_pytorch import DeviceTrial

steps = []

class Profiled(DeviceTrial):
    def setup(self):
        self.context.set_profiler(
            activities=[torch.profiler.ProfilerActivity.CPU],
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1),
        )
        real_step = self.context.profiler.step
        def step():
            steps.append(1)
            real_step()
        self.context.profiler.step = step

with pytorch.init(hparams={"global_batch_size": 4}) as ctx:
    ctx.get_tensorboard_path = lambda: pathlib.Path(sys.argv[1])
    trial = Profiled(ctx)
    pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(6), checkpoint_policy="none")
    try:
        ctx.set_profiler(on_trace_ready=print)
    except ValueError as e:
        print("refused:", e)
print("steps:", len(steps))
"""


def test_set_profiler_profiles_training_into_the_tensorboard_path(tmp_path: Path) -> None:
    # In a process of its own, as a trial runs: torch's profiler crashes at stop inside this
    # test session (not in a plain process, nor under a bare pytest).
    script = tmp_path / "profiled.py"
    script.write_text(PROFILED)
    tb = tmp_path / "tb"
    r = subprocess.run(
        [sys.executable, str(script), str(tb), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "steps: 6" in r.stdout  # stepped after every batch
    assert "refused: set_profiler(): on_trace_ready is set by the Trainer" in r.stdout
    traces = list(tb.glob("*.pt.trace.json"))
    assert len(traces) == 1, "one active window of the schedule, one trace for TensorBoard's profiler plugin"


def test_tensorboard_logging_switch_stops_the_upload_of_the_chiefs_files() -> None:
    with pytorch.init(hparams={"global_batch_size": 4}, enable_tensorboard_logging=False) as ctx:
        assert ctx.get_enable_tensorboard_logging() is False
        ctx.set_enable_tensorboard_logging(True)
        assert ctx.get_enable_tensorboard_logging() is True
        with pytest.raises(TypeError, match="takes a bool"):
            ctx.set_enable_tensorboard_logging("no")  # type: ignore[arg-type]


def test_tensorboard_switch_reaches_the_core_upload(tmp_path: Path) -> None:
    from detslurm.core._train import TrainContext
    from detslurm.protocol import RunPaths

    class Writer:
        def emit(self, event: Any) -> None:
            pass

        def flush(self) -> None:
            pass

    train = TrainContext(Writer(), 1, RunPaths(tmp_path / "exp", 4, 1), rank=0, tb_auto=True)
    (train.get_tensorboard_path() / "events.out").write_bytes(b"x")
    train._set_auto_upload(False)
    train.final_tensorboard_upload()
    uploaded = tmp_path / "exp"
    assert not [p for p in uploaded.rglob("events.out") if "rank-0" not in str(p)]
    train._set_auto_upload(True)
    train.final_tensorboard_upload()
    assert [p for p in uploaded.rglob("events.out") if "rank-0" not in str(p)]


def test_load_trial_from_checkpoint_path_takes_determineds_older_kwargs(tmp_path: Path) -> None:
    with pytorch.init(hparams={"global_batch_size": 4}) as ctx:
        trial = DeviceTrial(ctx)
        trainer = pytorch.Trainer(trial, ctx)
        trainer.fit(max_length=pytorch.Batch(2), checkpoint_policy="all")
    ckpts = sorted(p for p in ctx._core.checkpoint.base.iterdir() if (p / "state_dict.pth").is_file())  # type: ignore[union-attr]
    path = ckpts[-1]
    with pytest.warns(FutureWarning, match="torch_load_kwargs"):
        loaded = pytorch.load_trial_from_checkpoint_path(path, trial_class=DeviceTrial, map_location="cpu")
    assert isinstance(loaded, DeviceTrial)
    with pytest.raises(ValueError, match="pass torch.load's arguments once"):
        pytorch.load_trial_from_checkpoint_path(
            path, trial_class=DeviceTrial, torch_load_kwargs={"map_location": "cpu"}, mmap=False
        )
