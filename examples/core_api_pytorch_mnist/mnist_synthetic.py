"""MNIST-shaped synthetic data (downloads are unavailable here) and the tutorial's Net."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def datasets(n_train: int = 512, n_test: int = 128) -> tuple[TensorDataset, TensorDataset]:
    w = torch.randn(28 * 28, 10, generator=torch.Generator().manual_seed(0))

    def make(n: int, seed: int) -> TensorDataset:
        x = torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))
        return TensorDataset(x, (x.flatten(1) @ w).argmax(1))

    return make(n_train, 1), make(n_test, 2)


class Net(nn.Module):
    def __init__(self, hparams: dict) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, hparams.get("n_filters1", 8), 3, 1)
        self.conv2 = nn.Conv2d(hparams.get("n_filters1", 8), hparams.get("n_filters2", 16), 3, 1)
        self.dropout1 = nn.Dropout(hparams.get("dropout1", 0.25))
        self.dropout2 = nn.Dropout(hparams.get("dropout2", 0.5))
        self.fc1 = nn.Linear(144 * hparams.get("n_filters2", 16), 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)
