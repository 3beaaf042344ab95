"""The cost of the "mpidp" backend's call check: all_reduce per call with and without it.

    mpiexec -n 2 python bench/check_cost.py [--calls 3000] [--rounds 5]

Blocking ``dist.all_reduce`` of 1 float, 256 floats and 1 MiB, then async ones waited in
order, each timed with the check on and off (``ProcessGroupMPIDP._call_check`` replaced by
one that returns None), the two taking turns round by round. Prints the median us per call
of each, and their ratio, on rank 0.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import mpidp
from mpidp.process_group import ProcessGroupMPIDP

parser = argparse.ArgumentParser()
parser.add_argument("--calls", type=int, default=3000)
parser.add_argument("--rounds", type=int, default=5)
args = parser.parse_args()
mpidp.init_process_group()
checked = ProcessGroupMPIDP._call_check


def unchecked(self, check):
    return None


def run(tensor, async_op):
    dist.barrier()
    start = time.perf_counter()
    if async_op:
        works = [dist.all_reduce(tensor, async_op=True) for _ in range(args.calls)]
        for work in works:
            work.wait()
    else:
        for _ in range(args.calls):
            dist.all_reduce(tensor)
    return (time.perf_counter() - start) / args.calls * 1e6


for numel in (1, 256, 1 << 18):
    for async_op in (False, True):
        tensor = torch.ones(numel)
        times = {"check": [], "none": []}
        calls = args.calls
        args.calls = max(50, calls // (1 + numel // 4096))
        run(tensor, async_op)  # warm up
        for _ in range(args.rounds):
            for mode, function in (("check", checked), ("none", unchecked)):
                ProcessGroupMPIDP._call_check = function
                times[mode].append(run(tensor, async_op))
        ProcessGroupMPIDP._call_check = checked
        args.calls = calls
        if dist.get_rank() == 0:
            on, off = statistics.median(times["check"]), statistics.median(times["none"])
            print(f"{numel * 4:>8} B {'async' if async_op else 'blocking':>8}: "
                  f"check {on:8.1f} us, none {off:8.1f} us, x{on / off:.2f}", flush=True)
dist.destroy_process_group()
