"""Blocking dist.all_reduce of 1, 16 and 64 MiB over "mpidp": median ms per call, one line.

    PYTHONPATH=<a worktree> mpiexec -n 2 python bench/blocking_allreduce.py LABEL

Run it for two trees in turn, several times (the machine is noisy), to compare the
backend's large all_reduce (chunked above MPIDP_CHUNK_MB) between versions.
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist

import mpidp

mpidp.init_process_group()
medians = {}
for mib in (1, 16, 64):
    tensor = torch.ones(mib << 18)
    calls = max(5, 200 // mib)
    for _ in range(2):
        dist.all_reduce(tensor)
    rounds = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(tensor)
        rounds.append((time.perf_counter() - start) / calls * 1e3)
    medians[mib] = round(statistics.median(rounds), 3)
if dist.get_rank() == 0:
    print(sys.argv[1] if len(sys.argv) > 1 else "", "ms per blocking all_reduce by MiB:", medians,
          flush=True)
dist.destroy_process_group()
