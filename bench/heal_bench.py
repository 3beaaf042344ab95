"""What mpidp.Healer costs while nothing is lost: the copy of the state that ``guard()`` makes.

    mpirun --with-ft ulfm --mca pml ob1 --mca btl tcp,self -n 2 python bench/heal_bench.py

Under ULFM every step inside ``guard()`` starts with a copy of the model, the
optimizer (Adam: two more tensors per parameter), the scheduler, the
generators and the position. Timed for a 68 k-parameter MLP and a 25.2
M-parameter model (six Linear(2048, 2048)), beside the step itself, and a
whole-step A/B of the MLP with and without ``guard()`` (blocks of 50 steps,
interleaved). Without ULFM (``Healer.active`` False) ``guard()`` copies
nothing. Then the partner copy of a ``ZeroRedundancyOptimizer`` (stage 1,
Adam; what a Healer starts where it can heal): whole steps with and without it,
blocks interleaved, for both models; this part needs no ULFM. Rank 0 prints
the medians.
"""

import shutil
import statistics
import tempfile
import time

import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpidp

COMM = MPI.COMM_WORLD


def _setup(model: nn.Module, width: int, directory: str):
    dataset = TensorDataset(torch.randn(64 * COMM.size, width), torch.randn(64 * COMM.size, 1))
    sampler = mpidp.DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    ddp = mpidp.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    checkpointer = mpidp.Checkpointer(directory, model=ddp, optimizer=optimizer, sampler=sampler,
                                      batch_size=8, signals=())
    return loader, ddp, optimizer, checkpointer, mpidp.Healer(checkpointer)


def _step(ddp, optimizer, x, y) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(ddp(x).sum(1, keepdim=True), y).backward()
    optimizer.step()


def measure(name: str, model: nn.Module, width: int, steps: int) -> None:
    directory = COMM.bcast(tempfile.mkdtemp() if COMM.rank == 0 else None)
    loader, ddp, optimizer, checkpointer, healer = _setup(model, width, directory)
    x, y = next(iter(loader))
    _step(ddp, optimizer, x, y)  # Adam's state exists from here
    copies, plain = [], []
    for _ in range(steps):
        began = time.perf_counter()
        healer._copies.capture()
        copies.append(time.perf_counter() - began)
        began = time.perf_counter()
        _step(ddp, optimizer, x, y)
        plain.append(time.perf_counter() - began)
    if COMM.rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{name} ({params / 1e6:.3f} M parameters, Adam): the copy "
              f"{statistics.median(copies) * 1e3:.3f} ms, the step "
              f"{statistics.median(plain) * 1e3:.3f} ms (median of {steps}); active={healer.active}",
              flush=True)
    checkpointer.close()
    ddp.close()
    COMM.Barrier()
    if COMM.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)


def ab(blocks: int = 10, block: int = 50) -> None:
    directory = COMM.bcast(tempfile.mkdtemp() if COMM.rank == 0 else None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    loader, ddp, optimizer, checkpointer, healer = _setup(model, 256, directory)
    x, y = next(iter(loader))
    times = {"guard": [], "plain": []}
    for _ in range(blocks):
        for kind in times:
            began = time.perf_counter()
            for _ in range(block):
                if kind == "guard":
                    with healer.guard():
                        _step(ddp, optimizer, x, y)
                else:
                    _step(ddp, optimizer, x, y)
            times[kind].append((time.perf_counter() - began) / block)
    if COMM.rank == 0:
        g, p = statistics.median(times["guard"]), statistics.median(times["plain"])
        print(f"mlp whole step: with guard() {g * 1e3:.3f} ms, without {p * 1e3:.3f} ms "
              f"({(g / p - 1) * 100:+.1f} %)", flush=True)
    checkpointer.close()
    ddp.close()
    COMM.Barrier()
    if COMM.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)


def zero_partner(name: str, model: nn.Module, width: int, blocks: int, block: int) -> None:
    """ZeRO stage 1 (Adam) steps with and without the partner copy, blocks interleaved."""
    ddp = mpidp.DistributedDataParallel(model)
    optimizer = mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-4)
    x, y = torch.randn(8, width), torch.randn(8, 1)
    _step(ddp, optimizer, x, y)
    optimizer.keep_partner_copy()
    partner = optimizer._healing.partner
    times = {"partner": [], "plain": []}
    for _ in range(blocks):
        for kind in times:
            optimizer._healing.partner = partner if kind == "partner" else None
            COMM.Barrier()
            began = time.perf_counter()
            for _ in range(block):
                _step(ddp, optimizer, x, y)
            times[kind].append((time.perf_counter() - began) / block)
    if COMM.rank == 0:
        with_, without = statistics.median(times["partner"]), statistics.median(times["plain"])
        print(f"{name} ZeRO-1 Adam whole step at {COMM.size} ranks: with the partner copy "
              f"{with_ * 1e3:.3f} ms, without {without * 1e3:.3f} ms ({(with_ / without - 1) * 100:+.1f} %)",
              flush=True)
    ddp.close()


def main() -> None:
    torch.manual_seed(0)
    if mpidp.healing.ulfm():
        measure("mlp", nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)), 256, 200)
        measure("wide", nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)]), 2048, 10)
        ab()
    zero_partner("mlp", nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)), 256,
                 10, 50)
    zero_partner("wide", nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)]), 2048, 5, 3)


if __name__ == "__main__":
    main()
