"""``context.configure_apex_amp``: NVIDIA apex used as Determined 0.38.1 uses it, and without apex
a one-line error that names what to install and torch's own AMP.

NVIDIA apex cannot be installed for the tests (it is built from source against CUDA, and the
tests run without a GPU), so a stand-in ``apex`` package records the calls it gets: the same
script, run under the real Determined and under ours, must make the same calls with the same
arguments. ``torch.cuda.is_available`` is made to say yes after the model is wrapped on the CPU,
because both refuse apex without a GPU."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from determined_oracle import SCRIPT_RECORD, oracle_python, record_script

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

STAND_IN_AMP = """
import contextlib
CALLS = []

def _shown(v):
    return v if isinstance(v, (type(None), bool, int, float, str)) else repr(v)

def initialize(models, optimizers, **kwargs):
    CALLS.append(["initialize", type(models).__name__, type(optimizers).__name__,
                  {k: _shown(v) for k, v in sorted(kwargs.items())}])
    return models, optimizers

@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, **kwargs):
    CALLS.append(["scale_loss", len(optimizers), loss_id])
    yield loss * 2.0  # a loss scale of 2: the gradients show it

def master_params(optimizer):
    CALLS.append(["master_params"])
    for group in optimizer.param_groups:
        yield from group["params"]
"""

SCRIPT = (
    r"""
import json, sys, warnings
import torch
from determined import pytorch
from apex import amp
"""
    + SCRIPT_RECORD
    + r"""
conf = {"searcher": {"name": "single", "metric": "x"}}
with pytorch.init(hparams={"global_batch_size": 1}, exp_conf=conf) as ctx:
    torch.manual_seed(0)
    model = ctx.wrap_model(torch.nn.Linear(2, 1))
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    m, o = ctx.configure_apex_amp(model, opt, enabled=False)
    out["disabled_untouched"] = [m is model, o is opt, amp.CALLS == []]
    torch.cuda.is_available = lambda: True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m, o = ctx.configure_apex_amp(model, opt, opt_level="O2", loss_scale="dynamic", max_loss_scale=1024.0)
    out["warnings"] = [w.category.__name__ for w in caught]
    out["returned"] = [m is model, o is opt]
    try:
        ctx.configure_apex_amp(model, opt)
        out["twice"] = "accepted"
    except BaseException as e:  # Determined's InvalidExperimentException is not an Exception
        out["twice"] = str(e)
    ctx.backward(m(torch.ones(1, 2)).sum())
    out["grads"] = [p.grad.tolist() for p in model.parameters()]
    out["calls"] = amp.CALLS
json.dump(out, open(sys.argv[1], "w"), sort_keys=True)
"""
)


def stand_in(tmp_path: Path) -> Path:
    pkg = tmp_path / "stand-in" / "apex"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("from . import amp\n")
    (pkg / "amp.py").write_text(STAND_IN_AMP)
    return pkg.parent


def test_apex_is_driven_as_determined_drives_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(stand_in(tmp_path)), "HOME": str(tmp_path)}
    theirs = record_script(oracle_python(), SCRIPT, tmp_path / "determined", env=env)
    ours = record_script(sys.executable, SCRIPT, tmp_path / "detslurm", env=env)
    assert theirs["calls"][0][3]["opt_level"] == "O2" and theirs["grads"] == [[[2.0, 2.0]], [2.0]]
    assert ours == theirs


@pytest.fixture
def apex_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.syspath_prepend(str(stand_in(tmp_path)))
    for name in ("apex", "apex.amp"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from detslurm.pytorch._context import CheckpointLoadContext

    yield CheckpointLoadContext({"global_batch_size": 1})
    for name in ("apex", "apex.amp"):
        sys.modules.pop(name, None)  # the stand-in stays out of the tests that follow


def test_the_optimizer_steps_and_clips_apexs_master_params(apex_context: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = apex_context
    model = ctx.wrap_model(torch.nn.Linear(2, 1))
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(FutureWarning, match="deprecated"):
        model, opt = ctx.configure_apex_amp(model, opt)
    from apex import amp

    before = [p.detach().clone() for p in model.parameters()]
    ctx.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(Exception, match="once per batch while using apex.amp"):
        ctx.backward(model(torch.ones(1, 2)).sum())
    clipped: list[Any] = []
    ctx.step_optimizer(opt, clip_grads=clipped.extend)
    assert [c[0] for c in amp.CALLS] == ["initialize", "scale_loss", "master_params"]
    assert all(a is b for a, b in zip(clipped, model.parameters(), strict=True))
    # The scaled gradient (the stand-in's scale of 2) stepped: weight - lr * 2 * 1.
    assert all(torch.allclose(p, b - 1.0) for p, b in zip(model.parameters(), before, strict=True))
    with pytest.raises(Exception, match="Do not mix APEX with PyTorch AMP"):
        ctx.wrap_scaler(torch.amp.GradScaler("cpu"))


def test_without_apex_the_error_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from detslurm.errors import DetSlurmError
    from detslurm.pytorch._context import CheckpointLoadContext

    for name in ("apex", "apex.amp"):
        monkeypatch.setitem(sys.modules, name, None)  # not importable, even if a site has it
    ctx = CheckpointLoadContext({"global_batch_size": 1})
    model = ctx.wrap_model(torch.nn.Linear(2, 1))
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    assert ctx.configure_apex_amp(model, opt, enabled=False) == (model, opt)
    with pytest.warns(FutureWarning), pytest.raises(DetSlurmError) as e:
        ctx.configure_apex_amp(model, opt)
    assert "needs NVIDIA apex" in str(e.value) and "use_amp()" in str(e.value) and "wrap_scaler" in str(e.value)


MODEL_DEF = """
import torch
from determined import pytorch

class ApexTrial(pytorch.PyTorchTrial):
    def __init__(self, context):
        self.context = context
        model = context.wrap_model(torch.nn.Linear(1, 1))
        opt = context.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        self.model, self.opt = context.configure_apex_amp(model, opt, opt_level="O1")

    def train_batch(self, batch, epoch_idx, batch_idx):
        raise AssertionError("not reached: configure_apex_amp refused in __init__")

    def build_training_data_loader(self):
        return pytorch.DataLoader(torch.zeros(4, 1), batch_size=1)

    def build_validation_data_loader(self):
        return pytorch.DataLoader(torch.zeros(4, 1), batch_size=1)
"""


@pytest.mark.e2e
def test_a_trial_without_apex_fails_in_one_line(det: Any, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "model_def.py").write_text(MODEL_DEF)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "hyperparameters: {global_batch_size: 1}\nentrypoint: model_def:ApexTrial\nmax_restarts: 0\n"
        "searcher: {name: single, metric: loss, max_length: {batches: 1}}\n"
    )
    det("e", "create", "--local", str(cfg), str(ctx))
    code, out, err = det("t", "logs", "1")
    assert code == 0, err
    assert "detslurm harness: context.configure_apex_amp() needs NVIDIA apex" in out
    assert "Traceback" not in out
