"""DataLoader workers under fork, spawn and forkserver, with ``import mpidp`` at the top.

    mpiexec -n 2 python tests/mpi/train_with_workers.py fork spawn forkserver
    mpiexec -n 3 python tests/mpi/train_with_workers.py forkserver-preload

spawn and forkserver re-import this script in every worker, so the import of
mpidp below runs there too: it must not touch MPI. ``forkserver-preload`` also
has the fork server import torch and mpidp itself (``set_forkserver_preload``,
which makes workers start fast); it must come before any other forkserver use.
Each start method trains a small DDP model with 2 persistent workers per rank
and must end with exactly the parameters of ``num_workers=0``; every worker
checks that MPI is untouched there and that mpidp refuses MPI calls with a
clear error.
"""

from __future__ import annotations

import functools
import multiprocessing
import sys

import mpidp  # first, as in a user's script: a worker re-imports it

import torch
from mpi4py import MPI  # after mpidp: must not initialise MPI in a worker either
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WORKERS = 2


def check_worker(method: str, worker_id: int) -> None:
    """worker_init_fn: runs in every worker process."""
    if method == "forkserver-preload":
        method = "forkserver"
    if not mpidp.runtime.in_multiprocessing_child():
        raise AssertionError(f"{method} worker {worker_id}: not recognised as a child")
    if method != "fork" and MPI.Is_initialized():  # a fork child inherits the parent's state
        raise AssertionError(f"{method} worker {worker_id}: importing mpidp initialised MPI")
    if method != "fork" and sys.excepthook is mpidp.exits._abort_excepthook:
        raise AssertionError(f"{method} worker {worker_id}: mpidp's start-up ran in a worker")
    for call in (mpidp.rank, mpidp.barrier, lambda: mpidp.comm.allreduce(torch.ones(1))):
        try:
            call()
        except RuntimeError as err:
            if "not available in a multiprocessing child" not in str(err):
                raise
        else:
            raise AssertionError(f"{method} worker {worker_id}: an MPI call worked in a worker")


def train(workers: int, method: str | None) -> torch.Tensor:
    """Two epochs of DDP training; return the final parameters, flattened."""
    name = method
    if method == "forkserver-preload":
        method = "forkserver"
        multiprocessing.set_forkserver_preload(["torch", "mpidp"])
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(96, 8, generator=gen), torch.randint(0, 4, (96,), generator=gen))
    sampler = mpidp.DistributedSampler(dataset, seed=1)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=workers,
                        multiprocessing_context=method, persistent_workers=workers > 0,
                        worker_init_fn=functools.partial(check_worker, name) if workers else None)
    torch.manual_seed(0)
    model = mpidp.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    expected = train(0, None)
    for method in sys.argv[1:]:
        got = train(WORKERS, method)
        if not torch.equal(got, expected):
            raise AssertionError(f"{method}: parameters differ from num_workers=0 by "
                                 f"{(got - expected).abs().max().item()}")
        if mpidp.rank() == 0:
            print(f"{method}: {WORKERS} workers per rank on {mpidp.size()} ranks, parameters equal "
                  f"to num_workers=0", flush=True)


if __name__ == "__main__":
    main()
