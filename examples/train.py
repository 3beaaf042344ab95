"""Train an MLP classifier with mpidp on every rank of an MPI job.

    mpiexec -n 2 python examples/train.py

This is a plain PyTorch training script; every line that mpidp adds or changes
is tagged "# mpidp:". Without them it trains on one process.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpidp  # mpidp: initialises MPI; an uncaught error on any rank ends the job


def spirals(samples: int, classes: int = 3, seed: int = 0) -> TensorDataset:
    """Interleaved 2-d spirals, a small dataset that needs a non-linear model."""
    gen = torch.Generator().manual_seed(seed)
    label = torch.randint(0, classes, (samples,), generator=gen)
    radius = torch.rand(samples, generator=gen)
    angle = radius * 4.0 + label * (2 * torch.pi / classes) + 0.2 * torch.randn(samples, generator=gen)
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return TensorDataset(points, label)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    torch.manual_seed(0)
    dataset = spirals(6000)
    sampler = mpidp.DistributedSampler(dataset, shuffle=True, seed=0)  # mpidp: this rank's share
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Linear(2, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 3))
    model = mpidp.DistributedDataParallel(model)  # mpidp: the one-line change
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # mpidp: a new shuffle each epoch, the same on every rank
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples
        for points, label in loader:
            optimizer.zero_grad()
            output = model(points)
            loss = loss_fn(output, label)
            loss.backward()  # gradients are averaged across ranks during backward
            optimizer.step()
            totals += torch.tensor([loss.item() * len(label),
                                    (output.argmax(1) == label).sum().item(), len(label)])
        mpidp.comm.allreduce(totals)  # mpidp: sum the statistics of every rank
        if mpidp.rank() == 0:  # mpidp: print once
            print(f"epoch {epoch}: train loss {totals[0] / totals[2]:.4f}, "
                  f"accuracy {totals[1] / totals[2]:.3f} over {int(totals[2])} samples "
                  f"on {mpidp.size()} ranks", flush=True)
    if mpidp.rank() == 0:  # mpidp: print once
        print(f"final train loss {totals[0] / totals[2]:.4f}")


if __name__ == "__main__":
    main()
