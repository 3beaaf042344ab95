"""Training throughput with Horovod's API on mpidp: images per second of a small CNN.

    mpiexec -n 2 python examples/horovod_benchmark.py
    mpiexec -n 2 python examples/horovod_benchmark.py --batch-size 64 --fp16-allreduce

Every rank trains the same small CNN on a fixed batch of random images (nothing is
read, so the figure is compute plus the gradients' allreduce). After ``--warmup``
untimed steps, each rank times ``--rounds`` rounds of ``--steps`` steps and keeps its
median rate; ``hvd.allgather`` brings every rank's rate to rank 0, which prints them
and, last, their sum:

    total 812.4 img/sec on 2 ranks (per rank: 406.2 median, 398.0 slowest)

Run it at 1 rank too: the total at n ranks over n times the 1-rank rate is the
scaling efficiency. Lines a one-process script would not have are tagged "# hvd:";
the import, the one change from a script for Horovod itself, "# mpidp:".
"""

import argparse
import statistics
import time

import torch
from torch import nn

import mpidp.horovod as hvd  # mpidp: where a Horovod script imports horovod.torch as hvd


def small_cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, kernel_size=3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, kernel_size=3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(64, 128, kernel_size=3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="images per step and rank")
    parser.add_argument("--image-size", type=int, default=64, help="height and width")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true", help="send float16 gradients")
    args = parser.parse_args()
    for name in ("batch_size", "image_size", "classes", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    hvd.init()  # hvd
    torch.manual_seed(hvd.rank())  # different images on each rank, as real shards would be
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, args.classes, (args.batch_size,))
    model = small_cnn(args.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())  # hvd: scaled
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # hvd
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none  # hvd
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),  # hvd
                                         compression=compression)

    def step():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()  # hvd: the gradients' allreduce ends here

    for _ in range(args.warmup):
        step()
    rates = []
    for _ in range(args.rounds):
        hvd.barrier()  # hvd: every rank starts the round together
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        rates.append(args.batch_size * args.steps / (time.perf_counter() - start))
    mine = statistics.median(rates)
    every = hvd.allgather(torch.tensor([mine], dtype=torch.float64), name="rates")  # hvd
    if hvd.rank() == 0:  # hvd: print once
        print(f"{args.batch_size} images of 3x{args.image_size}x{args.image_size} per step and "
              f"rank, {args.rounds} rounds of {args.steps} steps after {args.warmup} warm-up steps")
        for rank, rate in enumerate(every.tolist()):
            print(f"rank {rank}: {rate:.1f} img/sec (median of its rounds)")
        ranks = f"{hvd.size()} rank{'s' if hvd.size() > 1 else ''}"
        print(f"total {every.sum():.1f} img/sec on {ranks} "
              f"(per rank: {statistics.median(every.tolist()):.1f} median, "
              f"{every.min():.1f} slowest)", flush=True)


if __name__ == "__main__":
    main()
