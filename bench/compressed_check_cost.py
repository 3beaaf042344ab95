"""The cost of compressed_allreduce's agreement check (size, dtype and chunks alike on every rank).

    mpiexec -n 2 python bench/compressed_check_cost.py [--rounds 5]

``mpidp.hooks.compressed_allreduce`` to bfloat16 of 1 KiB, 64 KiB and 4 MiB of
float32, timed with the check and with it replaced by a no-op, the two taking
turns round by round. Prints on rank 0 the median us per call of each and their
ratio.
"""

import argparse
import statistics
import time

import torch
from mpi4py import MPI

from mpidp import hooks

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=5)
args = parser.parse_args()
comm = MPI.COMM_WORLD
checked = hooks._check_same_chunks


def timed(x: torch.Tensor, calls: int, check: bool) -> float:
    hooks._check_same_chunks = checked if check else (lambda *args: None)
    try:
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            hooks.compressed_allreduce(x, torch.bfloat16)
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX) / calls
    finally:
        hooks._check_same_chunks = checked


for nbytes, calls in ((1 << 10, 2000), (64 << 10, 500), (4 << 20, 50)):
    x = torch.ones(nbytes // 4)
    timed(x, calls // 10, True)
    times = {True: [], False: []}
    for _ in range(args.rounds):
        for check in (True, False):
            times[check].append(timed(x, calls, check))
    on, off = (statistics.median(times[c]) * 1e6 for c in (True, False))
    if comm.rank == 0:
        print(f"{nbytes:>8} B  check on {on:8.1f} us  off {off:8.1f} us  ratio {on / off:.2f}",
              flush=True)
