"""Train an MLP on real images with mpidp: Fashion-MNIST, or scikit-learn's digits.

    mpiexec -n 2 python examples/train_digits.py                       # 8x8 digits, bundled
    mpiexec -n 2 python examples/train_digits.py --data ~/fashion-mnist # IDX files
    mpiexec -n 2 python examples/train_digits.py --checkpoint ck.pt --resume  # start or requeue
    mpiexec -n 2 python examples/train_digits.py --workers 2 --start-method forkserver
    mpiexec -n 2 python examples/train_digits.py --zero 2    # ZeRO: optimizer state and gradients sharded

With ``--data DIR`` it reads Fashion-MNIST's four IDX files (``train-images-
idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-...``, optionally ``.gz``)
from DIR; otherwise it uses the 1797 8x8 digits that ship inside scikit-learn.
Nothing is downloaded. Train and validation loss and accuracy are summed over
all ranks; rank 0 shows a progress bar, prints the metrics, and saves a
checkpoint after every epoch (written to a temporary file, then renamed, so a
crash never leaves half a checkpoint). ``--resume`` continues from it and ends
with exactly the result of an uninterrupted run; without a checkpoint yet it
starts afresh, so one job line serves for the first start and every requeue.
The progress bar updates every 30 s when stderr is not a terminal (a log file,
or MPICH's mpiexec, which hands ranks a pipe). ``--workers N`` loads batches in
N DataLoader worker processes per rank, started by ``--start-method``.
``--comm-hook fp16|bf16|powersgd`` sends compressed gradients (``mpidp.hooks``).
``--zero 1`` shards the optimizer's momentum across the ranks (ZeRO stage 1),
``--zero 2`` the gradients too; the results are the same, and the checkpoint
holds a plain SGD state either way. Every mpidp-specific line is tagged
"# mpidp:".
"""

import argparse
import gzip
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from tqdm import tqdm

import mpidp  # mpidp: initialises MPI (never in a DataLoader worker); an error on any rank ends the job


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (the MNIST format), gzipped or not."""
    if not path.exists() and path.with_suffix(path.suffix + ".gz").exists():
        path = path.with_suffix(path.suffix + ".gz")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as stream:
        data = stream.read()
    dims = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(data_dir):
    """Return (train, validation) TensorDatasets of flattened images in [0, 1]."""
    if data_dir:
        root = Path(data_dir).expanduser()
        parts = []
        for prefix in ("train", "t10k"):
            images = read_idx(root / f"{prefix}-images-idx3-ubyte")
            labels = read_idx(root / f"{prefix}-labels-idx1-ubyte")
            parts.append(TensorDataset(torch.tensor(images, dtype=torch.float32).flatten(1) / 255,
                                       torch.tensor(labels, dtype=torch.int64)))
        return parts[0], parts[1]
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, validation = order[:1500], order[1500:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[validation], labels[validation])


def evaluate(model, loader, loss_fn):
    """Sum of loss, correct predictions and samples over this rank's share."""
    totals = torch.zeros(3, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for images, labels in loader:
            output = model(images)
            totals += torch.tensor([loss_fn(output, labels).item() * len(labels),
                                    (output.argmax(1) == labels).sum().item(), len(labels)])
    model.train()
    return totals


def save_atomically(state, path: Path):
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)  # a reader sees the old checkpoint or the new one, never half


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="folder with Fashion-MNIST IDX files (default: sklearn digits)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--checkpoint", type=Path, help="save here after every epoch")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint if it exists (else start afresh)")
    parser.add_argument("--zero", type=int, choices=[0, 1, 2], default=0,
                        help="shard the optimizer state (1) and the gradients (2) with ZeRO")
    parser.add_argument("--comm-hook", choices=["fp16", "bf16", "powersgd"],
                        help="compress the gradients on the wire (mpidp.hooks)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    parser.add_argument("--start-method", choices=["fork", "spawn", "forkserver"],
                        help="how workers are started (default: the platform's, fork on Linux)")
    parser.add_argument("--persistent-workers", action="store_true",
                        help="keep the workers from one epoch to the next")
    args = parser.parse_args()
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint")

    rank, size = mpidp.rank(), mpidp.size()  # mpidp
    train_set, validation_set = load(args.data)
    sampler = mpidp.DistributedSampler(train_set, shuffle=True, seed=0)  # mpidp: this rank's share
    if args.start_method == "forkserver":  # workers fork from a server that imports these once
        multiprocessing.set_forkserver_preload(["torch", "mpidp"])  # mpidp: safe, MPI stays off there
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, multiprocessing_context=args.start_method,
                              persistent_workers=args.persistent_workers and args.workers > 0)
    # Validation: every sample exactly once over all ranks (no padding), so the
    # summed metrics equal those of one process.
    validation_loader = DataLoader(Subset(validation_set, range(rank, len(validation_set), size)),  # mpidp
                                   batch_size=256)

    torch.manual_seed(0)
    features = train_set.tensors[0].shape[1]
    model = nn.Sequential(nn.Linear(features, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    start_epoch = 0
    resume = torch.tensor([int(args.resume and args.checkpoint.exists())])
    resume = bool(mpidp.comm.broadcast(resume).item())  # mpidp: rank 0 looked, so every rank agrees
    if args.resume and not resume and rank == 0:  # mpidp: print once
        print(f"no checkpoint at {args.checkpoint} yet: starting from epoch 0", flush=True)
    if resume:
        state = torch.load(args.checkpoint, map_location="cpu")  # every rank reads the same file
        model.load_state_dict(state["model"])
    model = mpidp.DistributedDataParallel(model)  # mpidp: the one-line change
    if args.comm_hook == "powersgd":  # mpidp: send low-rank factors (after 10 exact steps)
        model.register_comm_hook(mpidp.hooks.PowerSGDState(None, matrix_approximation_rank=4,
                                                            start_powerSGD_iter=10),
                                 mpidp.hooks.powerSGD_hook)
    elif args.comm_hook:  # mpidp: send 16-bit gradients
        model.register_comm_hook(None, getattr(mpidp.hooks, f"{args.comm_hook}_compress_hook"))
    if args.zero:  # mpidp: each rank keeps 1/N of the momentum (stage 2: of the gradients too)
        optimizer = mpidp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=args.zero,
                                                  lr=args.lr, momentum=0.9)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if resume:
        optimizer.load_state_dict(state["optimizer"])  # ZeRO: every rank keeps its shard of it
        start_epoch = state["epoch"] + 1
    loss_fn = nn.CrossEntropyLoss()

    # A terminal gets a live bar; a log file an update every 30 s instead of a flood.
    refresh = 0.1 if sys.stderr.isatty() else 30
    for epoch in range(start_epoch, args.epochs):
        start = time.perf_counter()
        sampler.set_epoch(epoch)  # mpidp: a new shuffle each epoch, the same on every rank
        totals = torch.zeros(3, dtype=torch.float64)
        bar = tqdm(train_loader, desc=f"epoch {epoch}", disable=rank != 0, leave=False,  # mpidp: rank 0 only
                   mininterval=refresh)
        for images, labels in bar:
            optimizer.zero_grad()
            output = model(images)
            loss = loss_fn(output, labels)
            loss.backward()  # gradients are averaged across ranks during backward
            optimizer.step()
            totals += torch.tensor([loss.item() * len(labels),
                                    (output.argmax(1) == labels).sum().item(), len(labels)])
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        validation = evaluate(model, validation_loader, loss_fn)
        mpidp.comm.allreduce(totals)  # mpidp: sum over ranks
        mpidp.comm.allreduce(validation)  # mpidp: sum over ranks
        if args.zero and args.checkpoint:
            optimizer.consolidate_state_dict(to=0)  # mpidp: the whole state on rank 0 (collective)
        if rank == 0:  # mpidp: print and save once
            print(f"epoch {epoch}: train loss {totals[0] / totals[2]:.4f} acc {totals[1] / totals[2]:.4f} | "
                  f"validation loss {validation[0] / validation[2]:.4f} acc {validation[1] / validation[2]:.4f} "
                  f"({int(validation[2])} samples, {size} ranks), {time.perf_counter() - start:.2f} s",
                  flush=True)
            if args.checkpoint:
                save_atomically({"model": model.module.state_dict(),  # mpidp: the wrapped model
                                 "optimizer": optimizer.state_dict(), "epoch": epoch}, args.checkpoint)
        mpidp.barrier()  # mpidp: the checkpoint is complete before anyone goes on
    if rank == 0:  # mpidp: print once
        checksum = sum(p.double().sum().item() for p in model.module.parameters())
        print(f"final parameter checksum {checksum!r}")


if __name__ == "__main__":
    main()
