"""A small torch model on synthetic data with the Core API (no downloads, CPU is fine).

Regression of y = X @ w_true + noise with a 2-layer MLP. Reports training/validation metrics,
checkpoints model + optimizer with torch.save, resumes from the latest checkpoint, and stops
cleanly when preempted (pause, early stop, Slurm preemption).
"""

import logging

import determined as det
import torch
from torch import nn

STEPS = 60
VALIDATE_EVERY = 10


def make_data(seed: int, n: int = 512):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.arange(1.0, 9.0) / 8
    return x, x @ w + 0.05 * torch.randn(n, generator=g)


def main(ctx: det.core.Context) -> None:
    info = det.get_cluster_info()
    hp = info.trial.hparams if info else {"lr": 0.01, "hidden": 16}
    torch.manual_seed(info.trial.trial_seed if info else 0)
    model = nn.Sequential(nn.Linear(8, hp["hidden"]), nn.ReLU(), nn.Linear(hp["hidden"], 1))
    opt = torch.optim.Adam(model.parameters(), lr=hp["lr"])
    step = 0
    latest = info.latest_checkpoint if info else None
    if latest:
        with ctx.checkpoint.restore_path(latest) as path:
            state = torch.load(path / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    x_train, y_train = make_data(0)
    x_val, y_val = make_data(1, 128)
    while step < STEPS:
        idx = torch.randint(0, len(x_train), (32,), generator=torch.Generator().manual_seed(step))
        loss = nn.functional.mse_loss(model(x_train[idx]).squeeze(-1), y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        ctx.train.report_training_metrics(steps_completed=step, metrics={"loss": loss.item()})
        if step % VALIDATE_EVERY == 0:
            with torch.no_grad():
                val = nn.functional.mse_loss(model(x_val).squeeze(-1), y_val).item()
            ctx.train.report_validation_metrics(steps_completed=step, metrics={"validation_loss": val})
            with ctx.checkpoint.store_path({"steps_completed": step}) as (path, _):
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, path / "state.pt")
            ctx.train.report_progress(step / STEPS)
            if ctx.preempt.should_preempt():
                return


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    with det.core.init() as core_context:
        main(core_context)
