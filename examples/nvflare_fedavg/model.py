"""The example's model and data, shared by the job (server side) and the client script.

Data: scikit-learn's digits (offline), split over the sites by a Dirichlet(0.5) partition per
class. Model: a 64-32-10 MLP.
"""

from __future__ import annotations

import torch

from aggsrv.data import load_dataset
from aggsrv.data.partitions import partition

SEED = 0


class DigitsMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.hidden = torch.nn.Linear(64, 32)
        self.out = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def site_data(site: int, sites: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training examples of site ``site`` (0-based) of ``sites``."""
    data = load_dataset("digits", seed=SEED)
    x = data.x_train.reshape(len(data.x_train), -1)
    parts = partition(data.y_train.numpy(), sites, "dirichlet_per_class:beta=0.5", SEED)
    index = torch.as_tensor(parts[site], dtype=torch.long)
    return x[index], data.y_train[index]


def test_accuracy(model: torch.nn.Module) -> float:
    """Accuracy on the digits test split."""
    data = load_dataset("digits", seed=SEED)
    x = data.x_test.reshape(len(data.x_test), -1)
    with torch.no_grad():
        return float((model(x).argmax(1) == data.y_test).float().mean())
