"""What preemption costs while nothing happens, and what a save costs: mpidp.Checkpointer.

    mpiexec -n 2 python bench/preempt_bench.py

1. ``Checkpointer.step()`` after a step of mpidp DDP (the flag rode in the step's own bookkeeping
   allreduce), timed alone, beside an empty call timed at the same point;
2. ``mpidp.preemption.agree_stop()``, the 4-byte allreduce a loop without mpidp DDP pays;
3. ``Checkpointer.save()`` and ``resume()`` of a 25.2 M-parameter model (six Linear(2048, 2048))
   with Adam, and with ``ZeroRedundancyOptimizer(Adam)``, into a temporary directory.
Rank 0 prints the medians.
"""

import shutil
import statistics
import tempfile
import time

import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp import preemption

COMM = MPI.COMM_WORLD


def _directory() -> str:
    return COMM.bcast(tempfile.mkdtemp() if COMM.rank == 0 else None)


def _us(values) -> str:
    return f"{statistics.median(values) * 1e6:.1f} us"


def per_step_cost(steps: int = 2000) -> None:
    torch.manual_seed(0)
    ddp = mpidp.DistributedDataParallel(nn.Sequential(nn.Linear(256, 256), nn.ReLU(),
                                                      nn.Linear(256, 10)))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    directory = _directory()
    checkpointer = mpidp.Checkpointer(directory, model=ddp, optimizer=optimizer,
                                      exit_on_stop=False)
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
    called, empty, agreed = [], [], []
    for index in range(steps + 30):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        start = time.perf_counter()
        middle = time.perf_counter()
        checkpointer.step()
        end = time.perf_counter()
        if index >= 30:
            empty.append(middle - start)
            called.append(end - middle)
    for _ in range(steps):
        COMM.Barrier()
        start = time.perf_counter()
        preemption.agree_stop()
        agreed.append(time.perf_counter() - start)
    if COMM.rank == 0:
        print(f"Checkpointer.step() after an mpidp DDP step: {_us(called)} "
              f"(an empty pair of clock reads there: {_us(empty)})")
        print(f"preemption.agree_stop(): {_us(agreed)}")
        shutil.rmtree(directory)
    checkpointer.close()


def save_cost(saves: int = 5) -> None:
    torch.manual_seed(0)
    ddp = mpidp.DistributedDataParallel(nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)]))
    for zero in (False, True):
        optimizer = (mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3)
                     if zero else torch.optim.Adam(ddp.parameters(), lr=1e-3))
        optimizer.zero_grad()
        ddp(torch.randn(8, 2048)).sum().backward()
        optimizer.step()
        directory = _directory()
        checkpointer = mpidp.Checkpointer(directory, model=ddp, optimizer=optimizer,
                                          exit_on_stop=False, signals=())
        times = []
        for step in range(1, saves + 1):
            checkpointer.steps = step
            checkpointer.save()
            times.append(checkpointer.last_save_seconds)
        start = time.perf_counter()
        checkpointer.resume()
        loaded = time.perf_counter() - start
        if COMM.rank == 0:
            print(f"{'ZeroRedundancyOptimizer(Adam)' if zero else 'Adam'}: saves "
                  f"{[round(t, 2) for t in times]} s, median {statistics.median(times):.2f} s; "
                  f"resume {loaded:.2f} s")
            shutil.rmtree(directory)
        checkpointer.close()


if __name__ == "__main__":
    per_step_cost()
    save_cost()
