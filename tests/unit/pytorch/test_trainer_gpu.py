"""The Trainer on one CUDA GPU: where the model, the batches and the optimizer state live, training
equal to a hand-written loop on the same GPU over the same batches, AMP with a CUDA GradScaler
(inf steps skipped, scaler state checkpointed and restored), and GPU checkpoints loaded back on the
GPU, on the CPU (map_location) and resumed exactly.

CI's machines have no GPU: these tests are skipped there. scripts/gpu-check runs them on a GPU
machine (it installs what the machine lacks, then runs this file and the Trainer benchmark)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.torch,
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (run scripts/gpu-check on a GPU machine)"
    ),
]

from torch import nn  # noqa: E402

from detslurm import pytorch  # noqa: E402
from detslurm.pytorch._data import Shard, ShardedLoader  # noqa: E402

# The Trainer puts a lone rank on cuda:0 (local rank 0) whenever CUDA is visible.
DEV = torch.device("cuda", 0)
# fp16 is what CUDA AMP runs in and the dtype whose overflows GradScaler exists for.
AMP_DTYPE = torch.float16 if DEV.type == "cuda" else torch.bfloat16
N_RECORDS, GBS = 64, 8  # 8 batches per epoch
# A small scale that doubles every 3 clean steps, so growth, backoff and the growth tracker all show
# within 12 batches; far from fp16's overflow for this model, so only the poisoned step is skipped.
INIT_SCALE, GROWTH_INTERVAL, POISONED = 64.0, 3, frozenset({7})
# The scale each of 12 batches starts with: x2 after batches 2 and 5, /2 after the inf at 7, x2 after 10.
SCALES = [64.0] * 3 + [128.0] * 3 + [256.0] * 2 + [128.0] * 3 + [256.0]


def dataset(n: int = N_RECORDS) -> Any:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    return torch.utils.data.TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def net(dropout: float) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights (and GPU RNG stream) for the Trainer and a hand loop
    drop: nn.Module = nn.Dropout(dropout) if dropout else nn.Identity()
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), drop, nn.Linear(64, 1))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Momentum: an optimizer state that lives on the GPU and must come back from a checkpoint.
    return torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)


def amp_loss(model: nn.Module, x: Any, y: Any) -> Any:
    with torch.autocast(DEV.type, dtype=AMP_DTYPE):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y)


def poison(model: nn.Module) -> None:
    """One gradient made inf after backward: GradScaler must skip this optimizer step."""
    first = next(model.parameters())
    assert first.grad is not None
    first.grad.view(-1)[0] = float("inf")


def flat(model: nn.Module) -> Any:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


class Regress(pytorch.PyTorchTrial):
    dropout = 0.0

    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        self.model = context.wrap_model(net(self.dropout))
        self.opt = context.wrap_optimizer(optimizer(self.model))
        self.devices: set[torch.device] = set()
        self.setup()

    def setup(self) -> None:
        pass

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        self.devices |= {x.device, y.device}
        loss = nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}

    def evaluate_batch(self, batch: Any) -> dict[str, Any]:
        x, y = batch
        self.devices |= {x.device, y.device}
        return {"validation_loss": nn.functional.mse_loss(self.model(x), y)}

    def build_training_data_loader(self) -> Any:
        return pytorch.DataLoader(dataset(), batch_size=self.context.get_per_slot_batch_size(), shuffle=True)

    def build_validation_data_loader(self) -> Any:
        return pytorch.DataLoader(dataset(16), batch_size=8)


class Amp(Regress):
    """AMP as Determined documents it: autocast in train_batch, the scaler wrapped by the context."""

    dropout = 0.1  # dropout on the GPU draws from the CUDA RNG, which a resume must restore

    def setup(self) -> None:
        scaler = torch.amp.GradScaler(DEV.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        self.scaler = self.context.wrap_scaler(scaler)
        self.scales: list[float] = []
        self.stepped: list[bool] = []
        self.losses: list[float] = []

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        self.scales.append(self.scaler.get_scale())  # update() after each batch moved it
        loss = amp_loss(self.model, x, y)
        # Determined's wrap_scaler usage: the trial scales the loss, passes the scaler to
        # step_optimizer and updates it (only use_amp() does these itself).
        self.context.backward(self.scaler.scale(loss))
        if batch_idx in POISONED:
            poison(self.model)
        before = flat(self.model)
        self.context.step_optimizer(self.opt, scaler=self.scaler)
        self.scaler.update()
        self.stepped.append(not torch.equal(before, flat(self.model)))
        self.losses.append(loss.item())
        return {"loss": loss}


class Losses(pytorch.PyTorchCallback):
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_training_workload_end(self, avg_metrics: dict[str, Any], batch_metrics: list[dict[str, Any]]) -> None:
        self.rows.extend(batch_metrics)


def fit(cls: type[Regress], batches: int, **kw: Any) -> Regress:
    with pytorch.init(hparams={"global_batch_size": GBS}) as ctx:
        trial = cls(ctx)
        pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(batches), **kw)
    return trial


def hand_loop(batches: int, amp: bool = False) -> tuple[nn.Module, dict[str, list[Any]]]:
    """The same training written out by hand on DEV: the same initial weights, and the batches in
    the Trainer's order (a det.pytorch.DataLoader's order is drawn from (trial seed, epoch); the
    seed is 0 off-cluster)."""
    model = net(Amp.dropout if amp else 0.0).to(DEV)
    opt = optimizer(model)
    scaler = torch.amp.GradScaler(DEV.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    loader = ShardedLoader(pytorch.DataLoader(dataset(), batch_size=GBS, shuffle=True), Shard(), seed=0)
    batches_in_order = itertools.chain.from_iterable(loader.epoch(e) for e in itertools.count())
    seen: dict[str, list[Any]] = {"losses": [], "scales": [], "stepped": []}
    for i, (x, y) in enumerate(itertools.islice(batches_in_order, batches)):
        x, y = x.to(DEV), y.to(DEV)
        before = flat(model)
        if amp:
            seen["scales"].append(scaler.get_scale())
            loss = amp_loss(model, x, y)
            scaler.scale(loss).backward()
            if i in POISONED:
                poison(model)
            scaler.step(opt)
            scaler.update()
        else:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        opt.zero_grad()
        seen["stepped"].append(not torch.equal(before, flat(model)))
        seen["losses"].append(loss.item())
    return model, seen


def checkpoint_at(det_env: Path, steps: int) -> Path:
    dirs = [p for p in (det_env / "ckpts").iterdir() if not p.name.startswith(".")]
    (path,) = [p for p in dirs if json.loads((p / "metadata.json").read_text())["steps_completed"] == steps]
    return path


def assert_on_dev(trial: Regress) -> None:
    assert trial.context.device == DEV
    assert {p.device for p in trial.model.parameters()} == {DEV}
    state = [t for s in trial.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state and {t.device for t in state} == {DEV}  # the momentum buffers


def test_trains_on_the_gpu_like_a_hand_written_loop(det_env: Path) -> None:
    class Reporting(Regress):
        def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
            self.seen = Losses()
            return {"losses": self.seen}

    t = fit(Reporting, 32, checkpoint_policy="none", reporting_period=pytorch.Batch(8))  # 4 epochs
    assert_on_dev(t)
    assert t.devices == {DEV}  # every training and validation batch went through to_device
    losses = [row["loss"] for row in t.seen.rows]
    assert len(losses) == 32 and all(type(v) is float for v in losses)  # GPU tensors made numbers at reports
    assert sum(losses[-8:]) < 0.5 * sum(losses[:8]), losses
    model, hand = hand_loop(32)
    # Same GPU, same kernels, same batches: only a different kernel choice could move the last bits.
    assert losses == pytest.approx(hand["losses"], rel=1e-5, abs=1e-6)
    assert torch.allclose(flat(t.model), flat(model), rtol=1e-5, atol=1e-6)


def test_to_device_moves_nested_batches_and_leaves_the_rest() -> None:
    ctx = pytorch.CheckpointLoadContext({"global_batch_size": GBS})
    a, b = torch.ones(2), torch.zeros(3, dtype=torch.int64)
    out = ctx.to_device({"x": a, "pair": (b, "label"), "list": [a, 3]})
    assert out["x"].device == DEV and out["pair"][0].device == DEV and out["list"][0].device == DEV
    assert out["pair"][1] == "label" and out["list"][1] == 3 and isinstance(out["pair"], tuple)
    assert out["pair"][0].dtype == torch.int64 and torch.equal(out["x"].cpu(), a)


def test_amp_grad_scaler_skips_inf_steps_like_grad_scaler_and_is_checkpointed(det_env: Path) -> None:
    t = fit(Amp, 12, checkpoint_policy="none")
    assert_on_dev(t)
    assert t.scales == SCALES and t.scaler.get_scale() == 256.0
    assert t.stepped == [i not in POISONED for i in range(12)]  # only the inf step left the weights alone
    assert torch.isfinite(flat(t.model)).all()
    model, hand = hand_loop(12, amp=True)
    assert hand["scales"] == t.scales and hand["stepped"] == t.stepped
    assert t.losses == pytest.approx(hand["losses"], rel=1e-5, abs=1e-6)
    assert torch.allclose(flat(t.model), flat(model), rtol=1e-5, atol=1e-6)
    state = torch.load(checkpoint_at(det_env, 12) / "state_dict.pth", map_location="cpu", weights_only=False)
    saved = state["scaler_state_dict"]
    assert saved["scale"] == 256.0 and saved["_growth_tracker"] == 1  # one clean step since the last growth


def test_gpu_checkpoint_resumes_exactly_with_scaler_optimizer_and_rng(det_env: Path) -> None:
    whole = fit(Amp, 12, checkpoint_policy="none")
    fit(Amp, 4, checkpoint_policy="none")  # ends with a checkpoint at batch 4: scale 128, tracker 1
    resumed = fit(Amp, 12, checkpoint_policy="none", latest_checkpoint=checkpoint_at(det_env, 4).name)
    assert_on_dev(resumed)
    # A scaler that came back at its init scale, or with its growth tracker reset, would differ here
    # (it would grow after batch 6, not 5); a lost CUDA RNG state would change the dropout masks.
    assert resumed.scales == whole.scales[4:] == SCALES[4:]
    assert resumed.stepped == whole.stepped[4:]
    assert resumed.losses == pytest.approx(whole.losses[4:], rel=1e-5, abs=1e-6)
    assert torch.allclose(flat(resumed.model), flat(whole.model), rtol=1e-5, atol=1e-6)


def load_elsewhere(path: Path, cuda_visible: Optional[str]) -> dict[str, Any]:
    """load_trial_from_checkpoint_path in a fresh process, e.g. one that sees no GPU (a login node)."""
    probe = (
        "import json, sys, torch\nfrom detslurm import pytorch\n"
        f"t = pytorch.load_trial_from_checkpoint_path({str(path)!r})\n"
        "p = torch.cat([q.detach().flatten() for q in t.model.parameters()])\n"
        "print(json.dumps({'device': str(next(t.model.parameters()).device), 'weights': p.cpu().tolist()}))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    result: dict[str, Any] = json.loads(r.stdout.splitlines()[-1])
    return result


def test_gpu_checkpoint_loads_on_the_gpu_and_on_a_cpu(det_env: Path) -> None:
    t = fit(Regress, 5)
    path = checkpoint_at(det_env, 5)
    state = torch.load(path / "state_dict.pth", weights_only=False)
    assert {v.device for v in state["models_state_dict"][0].values()} == {DEV}  # saved as it lived
    assert ("gpu_rng_state" in state["rng_state"]) == (DEV.type == "cuda")
    on_cpu = torch.load(path / "state_dict.pth", map_location="cpu", weights_only=False)
    assert {v.device.type for v in on_cpu["models_state_dict"][0].values()} == {"cpu"}
    assert torch.equal(on_cpu["models_state_dict"][0]["0.weight"], t.model[0].weight.detach().cpu())
    for kwargs in (None, {"map_location": "cpu"}):
        loaded = pytorch.load_trial_from_checkpoint_path(path, torch_load_kwargs=kwargs)
        assert isinstance(loaded, Regress) and loaded.context.device == DEV
        assert {p.device for p in loaded.model.parameters()} == {DEV}  # the context's device, whatever the map
        assert torch.equal(flat(loaded.model), flat(t.model))
        assert {v.device for s in loaded.opt.state.values() for v in s.values()} == {DEV}
    elsewhere = load_elsewhere(path, cuda_visible="")
    assert elsewhere["device"] == "cpu"  # a GPU checkpoint on a machine without one: mapped to the CPU
    assert torch.equal(torch.tensor(elsewhere["weights"]), flat(t.model).cpu())
