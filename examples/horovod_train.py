"""Train a classifier with Horovod's API on mpidp: scikit-learn's 8x8 digits, on every rank.

    mpiexec -n 2 python examples/horovod_train.py
    mpiexec -n 2 python examples/horovod_train.py --backward-passes-per-step 2 --fp16-allreduce
    mpiexec -n 2 python examples/horovod_train.py --checkpoint digits.pt            # saved by rank 0
    mpiexec -n 2 python examples/horovod_train.py --checkpoint digits.pt --resume   # goes on from it

A training script as one writes it for ``horovod.torch``: every line a one-process
script would not have is tagged "# hvd:", and the one line that differs from a
script for Horovod itself, the import, "# mpidp:". Each rank trains on its share of
the 1500 training digits (torch's ``DistributedSampler``), ``hvd.DistributedOptimizer``
averages the gradients, and the learning rate is scaled by ``hvd.size()``: n ranks at
batch size B train like one process at batch size n B (tests/mpi/check_horovod.py
checks it). ``--backward-passes-per-step K`` sums K batches' gradients on each rank
before one allreduce; ``--fp16-allreduce`` sends them as float16. Rank 0 prints the
metrics and, with ``--checkpoint``, saves the model and optimizer after every epoch;
``--resume`` loads that file on rank 0 and broadcasts it, so a requeued job ends as an
uninterrupted one would. Nothing is downloaded: the digits ship with scikit-learn.
"""

import argparse
import itertools
import os
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import mpidp.horovod as hvd  # mpidp: where a Horovod script imports horovod.torch as hvd


def digits() -> tuple[TensorDataset, TensorDataset]:
    """(1500 training, 297 validation) digits: 64 pixels in [0, 1] and a label."""
    images, labels = load_digits(return_X_y=True)
    images, labels = torch.tensor(images / 16, dtype=torch.float32), torch.tensor(labels)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, validation = order[:1500], order[1500:]
    return (TensorDataset(images[train], labels[train]),
            TensorDataset(images[validation], labels[validation]))


def evaluate(model: nn.Module, dataset: TensorDataset) -> torch.Tensor:
    """[loss sum, correct, samples] over this rank's share, every sample on one rank only."""
    share = Subset(dataset, range(hvd.rank(), len(dataset), hvd.size()))  # hvd: no padding
    images, labels = next(iter(DataLoader(share, batch_size=len(share))))
    model.eval()
    with torch.no_grad():
        output = model(images)
    model.train()
    return torch.tensor([nn.functional.cross_entropy(output, labels, reduction="sum").item(),
                         (output.argmax(1) == labels).sum().item(), len(labels)],
                        dtype=torch.float64)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by hvd.size()")
    parser.add_argument("--backward-passes-per-step", type=int, default=1,
                        help="batches whose gradients each rank sums before one allreduce")
    parser.add_argument("--fp16-allreduce", action="store_true", help="send float16 gradients")
    parser.add_argument("--checkpoint", type=Path, help="rank 0 saves here after every epoch")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint if it exists (else start afresh)")
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint")
    if args.backward_passes_per_step < 1:
        parser.error(f"--backward-passes-per-step must be >= 1, got {args.backward_passes_per_step}")
    return args


def main(argv=None) -> tuple[float, float]:
    """Train; returns the last epoch's (validation loss, validation accuracy), on every rank."""
    args = parse(argv)
    hvd.init()  # hvd
    torch.manual_seed(0)
    train_set, validation_set = digits()
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),  # hvd
                                 shuffle=True, seed=0, drop_last=True)
    # Full batches only: every rank's batch is as large, so the average of the ranks'
    # gradients is the gradient of their batches together.
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    passes = args.backward_passes_per_step
    steps = len(loader) // passes * passes  # whole optimizer steps only
    if steps == 0:  # decided from the arguments and the size: every rank raises it
        raise ValueError(f"--batch-size {args.batch_size} x --backward-passes-per-step {passes} "
                         f"is more than a rank's share of the digits ({len(sampler)})")

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)  # hvd
    start_epoch = 0
    if args.resume and hvd.rank() == 0 and args.checkpoint.exists():  # hvd: rank 0 reads
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")  # hvd
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # hvd: every rank starts alike
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # hvd: the momentum too
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none  # hvd
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),  # hvd
                                         compression=compression, backward_passes_per_step=passes)

    result = (float("nan"), float("nan"))
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # hvd: a new shuffle each epoch, the same on every rank
        losses = []
        for index, (images, labels) in enumerate(itertools.islice(loader, steps)):
            loss = nn.functional.cross_entropy(model(images), labels)
            (loss / passes).backward()  # the mean over the `passes` batches
            losses.append(loss.item())
            if (index + 1) % passes == 0:
                optimizer.step()  # hvd: waits for the averaged gradients
                optimizer.zero_grad()
        train_loss = hvd.allreduce(torch.tensor(sum(losses) / len(losses)),  # hvd: the ranks' mean
                                   name="train_loss").item()
        loss_sum, correct, samples = hvd.allreduce(evaluate(model, validation_set),  # hvd
                                                   op=hvd.Sum, name="validation").tolist()
        result = (loss_sum / samples, correct / samples)
        if hvd.rank() == 0:  # hvd: print and save once
            print(f"epoch {epoch}: train loss {train_loss:.4f} | validation loss {result[0]:.4f} "
                  f"accuracy {result[1]:.4f} ({int(samples)} digits, {hvd.size()} ranks)", flush=True)
            if args.checkpoint:
                partial = args.checkpoint.with_name(args.checkpoint.name + ".partial")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch}, partial)
                os.replace(partial, args.checkpoint)  # never half a checkpoint
    return result


if __name__ == "__main__":
    main()
