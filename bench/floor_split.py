"""Where the exact path's time over the floor goes: mpidp's DDP statistics against the same
allreduces run alone (run under mpiexec -n 2 from the repository root; prints two lines)."""

import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

import mpidp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build  # noqa: E402
torch.set_num_threads(1)
r = mpidp.rank()
for name in ("mlp", "wide"):
    model, batches, loss_fn = build(name, r)
    ddp = mpidp.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for step in range(12):
        x, y = batches[step % 2]
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
    st = ddp.stats()[2:]
    red = statistics.median(s["reduction_s"] for s in st) * 1e3
    wait = statistics.median(s["wait_s"] for s in st) * 1e3
    grads = [p.grad.clone() for p in ddp.parameters()]
    times = []
    for _ in range(10):
        MPI.COMM_WORLD.Barrier()
        s0 = time.perf_counter()
        for g in grads:
            for piece in g.view(-1).split(1 << 20):
                mpidp.comm.allreduce(piece)
        times.append(time.perf_counter() - s0)
    raw = statistics.median(times) * 1e3
    if r == 0:
        print(f"{name}: DDP reduction span {red:.1f} ms (end-of-backward wait {wait:.2f} ms); the same allreduces alone, back to back, cached grads: {raw:.1f} ms")
    ddp.close()
