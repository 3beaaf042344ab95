"""The cost of the "mpidp" backend's call check: all_reduce per call with and without it.

    mpiexec -n 2 python bench/check_cost.py [--calls 3000] [--rounds 5]

Blocking ``dist.all_reduce`` of 1 float, 256 floats and 1 MiB, then async ones: in
windows of ``--window`` calls started, then waited in order (as DDP's buckets or FSDP's
prefetches are), and all ``--calls`` started before the first wait. Each timed with the
check on and off (``ProcessGroupMPIDP._call_check`` replaced by
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
parser.add_argument("--window", type=int, default=16)
args = parser.parse_args()
mpidp.init_process_group()
checked = ProcessGroupMPIDP._call_check


def unchecked(self, check):
    return None


def run(tensor, async_op):
    """us per call; ``async_op``: 0 (blocking), or how many calls are started before they
    are waited (-1: all)."""
    dist.barrier()
    start = time.perf_counter()
    if async_op:
        window = args.calls if async_op < 0 else async_op
        for _ in range(0, args.calls, window):
            works = [dist.all_reduce(tensor, async_op=True) for _ in range(window)]
            for work in works:
                work.wait()
    else:
        for _ in range(args.calls):
            dist.all_reduce(tensor)
    return (time.perf_counter() - start) / args.calls * 1e6


for numel in (1, 256, 1 << 18):
    for async_op in (0, args.window, -1):
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
            how = {0: "blocking", -1: "async all"}.get(async_op, f"async {async_op}")
            print(f"{numel * 4:>8} B {how:>10}: "
                  f"check {on:8.1f} us, none {off:8.1f} us, x{on / off:.2f}", flush=True)
dist.destroy_process_group()
