"""Training-step time of mpidp vs torch DDP over gloo, in one MPI run.

    mpiexec -n 2 python bench/step_time.py [--steps 30] [--warmup 5] [--rounds 3]

Model: 12 x Linear(1024, 1024) with ReLU (12.6M parameters), batch 64 per rank,
SGD. Every mode runs the same steps on the same data; rounds alternate the
modes so that machine noise hits them alike. A step's time is the slowest
rank's; the report gives the median and p90 over all timed steps, and the
ratio of each mode's median to torch DDP's. Modes:

- local: no communication (the compute floor);
- ddp-gloo: torch.nn.parallel.DistributedDataParallel over gloo (loopback TCP);
- mpidp: mpidp.DistributedDataParallel, default settings;
- mpidp-nopoll: mpidp with the hooks' progress polling switched off, to show
  what polling buys.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

import mpidp

COMM = MPI.COMM_WORLD


def mlp(width=1024, depth=12):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def init_gloo():
    port = None
    if COMM.rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = COMM.bcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=COMM.rank, world_size=COMM.size)


def build(mode):
    model = mlp()
    if mode == "local":
        return model
    if mode == "ddp-gloo":
        return nn.parallel.DistributedDataParallel(model)
    wrapped = mpidp.DistributedDataParallel(model)
    if mode == "mpidp-nopoll":
        wrapped.reducer._poll = lambda: None
    return wrapped


def timed_steps(model, steps, batch):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = batch
    times = []
    for _ in range(steps):
        COMM.Barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        times.append(COMM.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_gloo()
    modes = ["local", "ddp-gloo", "mpidp", "mpidp-nopoll"]
    gen = torch.Generator().manual_seed(COMM.rank)
    batch = (torch.randn(args.batch, 1024, generator=gen), torch.randn(args.batch, 1024, generator=gen))
    models = {mode: build(mode) for mode in modes}
    results = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            timed_steps(models[mode], args.warmup, batch)
            results[mode] += timed_steps(models[mode], args.steps, batch)
    if COMM.rank == 0:
        reference = statistics.median(results["ddp-gloo"])
        print(f"{COMM.size} ranks, torch {torch.__version__}, {MPI.Get_library_version().splitlines()[0]}, "
              f"threads/rank {torch.get_num_threads()}, {args.rounds * args.steps} steps per mode")
        print(f"{'mode':14s} {'median ms':>10s} {'p90 ms':>8s} {'vs ddp-gloo':>12s}")
        for mode in modes:
            ms = sorted(t * 1e3 for t in results[mode])
            median = statistics.median(ms)
            print(f"{mode:14s} {median:10.1f} {ms[int(0.9 * len(ms))]:8.1f} "
                  f"{reference * 1e3 / median:11.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
