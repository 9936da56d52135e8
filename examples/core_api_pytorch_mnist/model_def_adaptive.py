"""Seed 004 step 4: hyperparameter search. Trains op by op (0.37 style, searcher.max_length in
epochs) and reports each op's searcher metric; hparams come from the cluster info."""

import logging

import determined as det
import torch
from torch import optim
from torch.utils.data import DataLoader

from mnist_synthetic import Net, datasets
from model_def_checkpoints import load_state, test, train


def main(core_context):
    info = det.get_cluster_info()
    # NEW: Get hparams chosen for this trial from cluster info object.
    hparams = info.trial.hparams
    torch.manual_seed(1)
    device = torch.device("cpu")
    train_set, test_set = datasets(256, 64)
    train_loader = DataLoader(train_set, batch_size=32, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=64)
    # NEW: Pass relevant hparams to model and optimizer.
    model = Net(hparams).to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=hparams["learning_rate"])
    epochs_completed = 0
    if info.latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(info.latest_checkpoint) as path:
            model_sd, epochs_completed = load_state(path, info.trial.trial_id)
            model.load_state_dict(model_sd)
    epoch_idx = epochs_completed
    for op in core_context.searcher.operations():
        while epoch_idx < op.length:
            train(model, device, train_loader, optimizer, core_context, epoch_idx)
            epoch_idx += 1
            op.report_progress(epoch_idx)
        test_loss = test(model, device, test_loader, core_context, epoch_idx * len(train_loader), epoch_idx)
        with core_context.checkpoint.store_path({"steps_completed": epoch_idx * len(train_loader)}) as (path, _):
            torch.save(model.state_dict(), path / "checkpoint.pt")
            path.joinpath("state").write_text(f"{epoch_idx},{info.trial.trial_id}")
        op.report_completed(test_loss)
        if core_context.preempt.should_preempt():
            return


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    with det.core.init() as core_context:
        main(core_context=core_context)
