"""Reproducible mode's cost: a DDP step with reproducible=True against the exact default.

    mpiexec -n 2 python bench/reproducible_bench.py --models mlp wide --rounds 7

Each rank trains, in one run, one copy of the model (bench/models.py) per mode on
the same per-rank batch: "exact" (mpidp.DistributedDataParallel's defaults, one
backward), and "k=K" (reproducible=True, the rank's batch cut into K micro-batches,
the first K - 1 under no_sync()), and with ``--uneven M``, "M=M" (reproducible=True,
M micro-batches dealt unevenly as mpidp.DistributedSampler deals them: at 2 ranks
M=3 runs 2 on rank 0 and 1 on rank 1, each micro-batch the size of one of the
"k=2" mode's). A step is zero_grad, the forward and backward
passes and an SGD step. The modes take turns, one step each per round after a
warm-up, so load on the machine falls on all of them alike; rank 0 prints each
mode's median step and its ratio to "exact" as a markdown table.
"""

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mpidp  # noqa: E402
from mpidp.sampler import micro_batch_counts  # noqa: E402
from models import build  # noqa: E402


class Mode:
    """One copy of the model under one mode, and its step times."""

    def __init__(self, model_name: str, micro_batches: int | None, dealt: int | None = None):
        model, batches, self.loss = build(model_name, MPI.COMM_WORLD.Get_rank())
        self.x, self.y = batches[0]
        count = micro_batches or 1
        self.pieces = list(zip(self.x.chunk(count), self.y.chunk(count)))
        if dealt is not None:  # this rank's share of ``dealt``, pieces of the largest share's size
            counts = micro_batch_counts(dealt, MPI.COMM_WORLD.Get_size())
            pieces = zip(self.x.chunk(counts[0]), self.y.chunk(counts[0]))
            self.pieces = list(pieces)[:counts[MPI.COMM_WORLD.Get_rank()]]
        reproducible = micro_batches is not None or dealt is not None
        self.ddp = mpidp.DistributedDataParallel(model, reproducible=reproducible)
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=1e-3)
        self.times: list[float] = []

    def step(self) -> None:
        began = time.perf_counter()
        self.optimizer.zero_grad()
        for k, (x, y) in enumerate(self.pieces):
            with contextlib.nullcontext() if k == len(self.pieces) - 1 else self.ddp.no_sync():
                self.loss(self.ddp(x), y).backward()
        self.optimizer.step()
        self.times.append(time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "wide"])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--uneven", nargs="*", type=int, default=[],
                        help="micro-batches per step over all ranks, dealt unevenly")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for name in args.models:
        modes = {"exact": Mode(name, None)}
        modes.update({f"k={k}": Mode(name, k) for k in args.micro_batches})
        modes.update({f"M={m}": Mode(name, None, dealt=m) for m in args.uneven})
        for _ in range(args.warmup + args.rounds):
            for mode in modes.values():
                mpidp.barrier()
                mode.step()
        exact = statistics.median(modes["exact"].times[args.warmup:])
        for label, mode in modes.items():
            median = statistics.median(mode.times[args.warmup:])
            rows.append(f"| {name} | {label} | {median * 1e3:.1f} | {median / exact:.2f}x |")
            mode.ddp.close()
    if mpidp.rank() == 0:
        print(f"{mpidp.size()} ranks, torch threads per rank {torch.get_num_threads()}, "
              f"median of {args.rounds} steps after {args.warmup}\n")
        print("| model | mode | step (ms) | over exact |\n|---|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
