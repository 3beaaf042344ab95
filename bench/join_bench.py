"""What join() costs: mpidp against torch's DDP over gloo, in one run.

    mpiexec -n 2 python bench/join_bench.py --model mlp --steps 20

For each wrapper (mpidp, torch DDP over gloo), rank 0's median step time in
three settings, interleaved round by round so machine noise hits all alike:

- ``plain``: every rank trains, no join();
- ``join``: every rank trains inside join(), nobody has run out (the cost of
  the per-forward "still active" allreduce);
- ``shadowed``: inside join(), every rank but 0 has run out of data at once
  and stands in for rank 0's steps (zero buckets, buffer broadcasts).

Ratios to ``plain`` of the same wrapper are printed, and one JSON line per
(wrapper, setting) is appended to ``--out`` if given.
"""

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

import mpidp
from models import build
from train_bench import init_gloo

COMM = MPI.COMM_WORLD


def run(wrapper, setting, model_name, steps):
    """Rank 0's per-step times of ``steps`` steps (rank 0 always has them all)."""
    model, batches, loss_fn = build(model_name, COMM.rank)
    wrapped = (mpidp.DistributedDataParallel(model) if wrapper == "mpidp"
               else nn.parallel.DistributedDataParallel(model))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    mine = steps if COMM.rank == 0 or setting != "shadowed" else 0
    times = []
    context = wrapped.join() if setting != "plain" else contextlib.nullcontext()
    COMM.Barrier()
    with context:
        for step in range(mine):
            x, y = batches[step % len(batches)]
            start = time.perf_counter()
            optimizer.zero_grad()
            loss_fn(wrapped(x), y).backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
    COMM.Barrier()
    if wrapper == "mpidp":
        wrapped.close()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_gloo()
    cases = [(w, s) for w in ("mpidp", "ddp-gloo") for s in ("plain", "join", "shadowed")]
    times = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            times[case] += run(*case, args.model, args.steps)[2:]  # the first two warm up
    if COMM.rank == 0:
        for wrapper, setting in cases:
            median = statistics.median(times[wrapper, setting]) * 1e3
            plain = statistics.median(times[wrapper, "plain"]) * 1e3
            print(f"{args.model:6} {wrapper:9} {setting:9} median {median:8.2f} ms  "
                  f"x{median / plain:.3f} of plain  ({COMM.size} ranks)")
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(dict(kind="join", model=args.model, wrapper=wrapper,
                                              setting=setting, ranks=COMM.size,
                                              median_ms=median, ratio_to_plain=median / plain))
                              + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
