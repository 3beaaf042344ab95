"""Uneven data per rank: join() and SyncBatchNorm, on scikit-learn's digits.

    mpiexec -n 3 python examples/train_uneven.py

Each rank trains on its own shard, as when every rank reads its own files, and
the shards differ in size (rank r's is proportional to r + 2: at 3 ranks 298,
449 and 598 images, so 10, 15 and 19 batches of 32). Ranks that run out first
wait inside ``join()``, standing in for the others' collectives, so nobody
hangs and every rank ends with the same model. The BatchNorm layer is a
``mpidp.SyncBatchNorm``: its statistics are those of the global batch of the
ranks still training.

``--sampler`` shows the other common source of uneven batch counts instead:
``mpidp.DistributedSampler(dataset, pad=False)`` gives every sample exactly
once, so the ranks' shares differ by one sample. With 1,346 images at 3 ranks
that is 449, 449 and 448: 15, 15 and 14 batches, ranks 0 and 1's last
batches holding one image each (BatchNorm needs two values per channel in a
training batch, so that step's global batch of 2 works; on one rank alone it
could not). Every line that mpidp adds or changes is tagged "# mpidp:".
"""

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import mpidp  # mpidp: initialises MPI; an uncaught error on any rank ends the job


def shard(dataset, rank: int, size: int) -> Subset:
    """Rank ``rank``'s contiguous share, of a size proportional to ``rank + 2``."""
    weights = [r + 2 for r in range(size)]
    bounds = [len(dataset) * sum(weights[:r]) // sum(weights) for r in range(size + 1)]
    return Subset(dataset, range(bounds[rank], bounds[rank + 1]))


def digits(train_size: int):
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels)
    return (TensorDataset(x[:train_size], y[:train_size]),
            TensorDataset(x[train_size:], y[train_size:]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sampler", action="store_true",
                        help="DistributedSampler(pad=False) over 1,346 images instead of shards")
    args = parser.parse_args()

    torch.manual_seed(0)
    train, test = digits(1346 if args.sampler else 1345)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
    model = mpidp.SyncBatchNorm.convert_sync_batchnorm(model)  # mpidp: global batch statistics
    model = mpidp.DistributedDataParallel(model)  # mpidp: average gradients across ranks
    sampler = None
    if args.sampler:
        sampler = mpidp.DistributedSampler(train, pad=False)  # mpidp: each sample once
        loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    else:
        mine = shard(train, mpidp.rank(), mpidp.size())  # mpidp: this rank's files
        loader = DataLoader(mine, batch_size=args.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(mpidp.rank()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        steps = 0
        with model.join():  # mpidp: ranks out of data shadow the others until all are done
            for x, y in loader:
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()
                steps += 1
        counts = mpidp.allgather_object(steps)  # mpidp: every rank's step count, for the log
        model.eval()
        with torch.no_grad():
            correct = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
        if mpidp.rank() == 0:
            print(f"epoch {epoch}: steps per rank {counts}, test accuracy {correct:.3f}")

    checksum = sum(p.double().sum().item() for p in model.parameters())
    sums = mpidp.allgather_object(round(checksum, 9))  # mpidp: the same model everywhere?
    if mpidp.rank() == 0:
        print(f"final parameter checksums per rank: {sums}")
    model.close()  # mpidp: release the communicators


if __name__ == "__main__":
    main()
