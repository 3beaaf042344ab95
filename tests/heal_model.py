"""The model, data and reference of tests/mpi/heal_train.py (no MPI here: the reference runs
in the test's own process, and in tests/heal_soak.py's)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

STEPS, GLOBAL_BATCH, SAMPLES, SEED = 24, 12, 96, 7  # 12 divides among 4, 3, 2 and 1 ranks


def dataset() -> TensorDataset:
    data = torch.Generator().manual_seed(1234)
    inputs = torch.randn(SAMPLES, 16, generator=data, dtype=torch.float64)
    targets = (inputs @ torch.randn(16, 1, generator=data, dtype=torch.float64)).tanh()
    return TensorDataset(inputs, targets)


def model(batchnorm: bool = False) -> nn.Module:
    """The MLP; with ``batchnorm``, a BatchNorm1d after its first layer (SyncBatchNorm when
    the ranks train it: its statistics are then the whole global batch's, as here)."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(32)] if batchnorm else []
    return nn.Sequential(nn.Linear(16, 32), *norm, nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 1)).double()


def optimizers(parameters) -> tuple:
    optimizer = torch.optim.Adam(parameters, lr=0.01)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)


def reference(steps: int = STEPS, batchnorm: bool = False) -> list[float]:
    """The losses of training on each whole global batch in one process.

    A DDP run at any rank count with the same global batches (mpidp's sampler
    deals the same global order) follows it within float64 summation noise.
    """
    inputs, targets = dataset().tensors
    net = model(batchnorm)
    optimizer, scheduler = optimizers(net.parameters())
    losses, epoch = [], 0
    while len(losses) < steps:
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
        for start in range(0, SAMPLES, GLOBAL_BATCH):
            batch = order[start:start + GLOBAL_BATCH]
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(net(inputs[batch]), targets[batch])
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
        epoch += 1
    return losses[:steps]


def worst_difference(losses: dict[int, float], expected: list[float]) -> float:
    """The largest relative difference of ``losses`` (step -> loss) from ``expected``."""
    return max(abs(loss - expected[step - 1]) / abs(expected[step - 1])
               for step, loss in losses.items())
