"""hvd.DistributedOptimizer against mpidp.DistributedDataParallel, one training step each.

    mpiexec -n 2 python bench/horovod_bench.py --models mlp cnn transformer wide --steps 20

Both train their own copy of the same model (``bench/models.py``) on the same
per-rank batches with SGD; rounds alternate the modes so that machine noise
hits both alike, after warm-up steps. A step's time is the slowest rank's (a
max allreduce of the per-rank times); the report gives each mode's median and
the ratio hvd / mpidp. ``local`` (no communication) is the compute floor.
"""

import argparse
import statistics
import time

import torch
from mpi4py import MPI

import mpidp
import mpidp.horovod as hvd
from models import build


class Mode:
    def __init__(self, name: str, model_name: str):
        model, self.batches, self.loss = build(model_name, MPI.COMM_WORLD.rank)
        self.name = name
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        if name == "hvd":
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            optimizer = hvd.DistributedOptimizer(optimizer,
                                                 named_parameters=model.named_parameters(),
                                                 sparse_as_dense=True)
        elif name == "mpidp":
            model = mpidp.DistributedDataParallel(model)
        self.model, self.optimizer, self.times = model, optimizer, []

    def step(self, index: int) -> float:
        x, y = self.batches[index % len(self.batches)]
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.loss(self.model(x), y).backward()
        self.optimizer.step()
        return MPI.COMM_WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "transformer", "wide"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    hvd.init()
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, torch threads per rank {torch.get_num_threads()}; "
              f"median step in ms (slowest rank)")
        print(f"{'model':12} {'local':>8} {'mpidp':>8} {'hvd':>8} {'hvd/mpidp':>10}")
    for model_name in args.models:
        modes = [Mode(name, model_name) for name in ("local", "mpidp", "hvd")]
        for index in range(args.warmup + args.steps):
            for mode in modes if index % 2 else reversed(modes):
                elapsed = mode.step(index)
                if index >= args.warmup:
                    mode.times.append(elapsed)
        local, ddp, horovod = (1e3 * statistics.median(m.times) for m in modes)
        if hvd.rank() == 0:
            print(f"{model_name:12} {local:8.1f} {ddp:8.1f} {horovod:8.1f} {horovod / ddp:10.2f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
