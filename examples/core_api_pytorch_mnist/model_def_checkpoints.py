"""Seed 004 steps 2-3: report metrics, checkpoint, pause/activate and "continue trial"."""

import logging
import pathlib

import determined as det
import torch
import torch.nn.functional as F
from torch import optim
from torch.utils.data import DataLoader

from mnist_synthetic import Net, datasets


def train(model, device, train_loader, optimizer, core_context, epoch_idx, op_length=None):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if (batch_idx + 1) % 4 == 0:
            # NEW: Report epoch-based training metrics to Determined master via core_context.
            core_context.train.report_training_metrics(
                steps_completed=batch_idx + 1 + epoch_idx * len(train_loader),
                metrics={"train_loss": loss.item(), "epoch": epoch_idx},
            )


def test(model, device, test_loader, core_context, steps_completed, epoch):
    model.eval()
    test_loss = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            test_loss += F.nll_loss(model(data.to(device)), target.to(device), reduction="sum").item()
    test_loss /= len(test_loader.dataset)
    core_context.train.report_validation_metrics(
        steps_completed=steps_completed,
        metrics={"test_loss": test_loss, "epoch": epoch},
    )
    return test_loss


# NEW: Define load_state function for restarting model training from existing checkpoint.
def load_state(checkpoint_directory, trial_id):
    checkpoint_directory = pathlib.Path(checkpoint_directory)
    with checkpoint_directory.joinpath("checkpoint.pt").open("rb") as f:
        model = torch.load(f, weights_only=True)
    with checkpoint_directory.joinpath("state").open("r") as f:
        epochs_completed, ckpt_trial_id = [int(field) for field in f.read().split(",")]
    # If trial ID does not match our current trial ID, we'll ignore epochs completed and start
    # training from epoch_idx = 0 ("Continue Trial" from another experiment).
    if ckpt_trial_id != trial_id:
        epochs_completed = 0
    return model, epochs_completed


def main(core_context):
    info = det.get_cluster_info()
    hparams = info.trial.hparams if info else {"learning_rate": 1.0, "epochs": 3}
    torch.manual_seed(1)
    device = torch.device("cpu")
    train_set, test_set = datasets()
    train_loader = DataLoader(train_set, batch_size=32, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=64)
    model = Net(hparams).to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=hparams["learning_rate"])
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    epochs_completed = 0
    latest_checkpoint = info.latest_checkpoint if info else None
    # NEW: If checkpoint exists, load it and assign it to model state prior to resuming training.
    if latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(latest_checkpoint) as path:
            model_sd, epochs_completed = load_state(path, info.trial.trial_id)
            model.load_state_dict(model_sd)
    for epoch_idx in range(epochs_completed, hparams["epochs"]):
        steps_completed = (epoch_idx + 1) * len(train_loader)
        train(model, device, train_loader, optimizer, core_context, epoch_idx)
        test(model, device, test_loader, core_context, steps_completed, epoch_idx)
        scheduler.step()
        # NEW: Save checkpoint.
        checkpoint_metadata_dict = {"steps_completed": steps_completed}
        with core_context.checkpoint.store_path(checkpoint_metadata_dict) as (path, storage_id):
            torch.save(model.state_dict(), path / "checkpoint.pt")
            with path.joinpath("state").open("w") as f:
                f.write(f"{epoch_idx + 1},{info.trial.trial_id if info else 0}")
        # NEW: Detect when the experiment is paused by the WebUI.
        if core_context.preempt.should_preempt():
            return


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    with det.core.init() as core_context:
        main(core_context=core_context)
