"""Shared-memory allreduce (mpidp.comm.shm) against MPI's on the same buffers. Run by hand.

    mpiexec -n 2 python bench/shm_bench.py [--sizes-mb 1 4 16 50 100] [--out r.jsonl]

For each size, float32 buffers of that many MB per rank: ``mpidp.comm.shm`` (the
buffer in the node's shared mapping, reduced in place) and ``MPI_Allreduce``
(``MPI.IN_PLACE`` on a private buffer, whole and in mpidp's 4 MiB chunks), the
modes taking turns, median of 15 after a warm-up. The floor is the bandwidth
floor of bench/hooks_bench.py: all ranks' inputs read and results written,
2 x N x S bytes at the measured aggregate add bandwidth (``--add-gb-s``).
"""

import argparse
import json
import statistics
import time

import torch
from mpi4py import MPI

from mpidp.comm import shm

COMM = MPI.COMM_WORLD


def timed(modes: dict, repeats=15) -> dict:
    """Median seconds (slowest rank) per mode, the modes taking turns call by call."""
    samples = {name: [] for name in modes}
    for _ in range(repeats):
        for name, call in modes.items():
            COMM.Barrier()
            start = time.perf_counter()
            call()
            samples[name].append(COMM.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return {name: statistics.median(values) for name, values in samples.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 50, 100])
    parser.add_argument("--add-gb-s", type=float, default=None,
                        help="aggregate add bandwidth for the floor (hooks_bench.py stream)")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    node = shm.Node(COMM)
    if not node.usable:
        raise SystemExit(f"shared memory is not usable here: {node.reason}")
    rows = []
    for mb in args.sizes_mb:
        numel = int(mb * 1e6) // 4
        window = node.allocate(numel * 4)
        shared = window.tensor(0, numel, torch.float32)
        private = torch.empty(numel)
        chunk = (4 << 20) // 4

        def fill():
            shared.fill_(COMM.rank + 1)
            private.fill_(COMM.rank + 1)

        def chunked():
            for start in range(0, numel, chunk):
                COMM.Allreduce(MPI.IN_PLACE, private[start:start + chunk].numpy())

        modes = {"mpidp.comm.shm": lambda: window.allreduce(shared),
                 "MPI_Allreduce": lambda: COMM.Allreduce(MPI.IN_PLACE, private.numpy()),
                 "MPI_Allreduce 4 MiB chunks": chunked}
        total = sum(r + 1 for r in range(COMM.size))
        fill()
        modes["mpidp.comm.shm"]()
        modes["MPI_Allreduce"]()
        assert torch.all(shared == total) and torch.all(private == total)  # both sum
        fill()  # (the timed calls go on summing: the values stay far from overflow)
        times = timed(modes)
        floor = (2 * COMM.size * numel * 4 / (args.add_gb_s * 1e9)) if args.add_gb_s else None
        for name, seconds in times.items():
            row = dict(kind="shm", ranks=COMM.size, mb=mb, mode=name, ms=seconds * 1e3,
                       over_shm=seconds / times["mpidp.comm.shm"],
                       over_floor=seconds / floor if floor else None)
            rows.append(row)
            if COMM.rank == 0:
                print(f"{mb:6.1f} MB  {name:28s} {seconds * 1e3:8.2f} ms  {row['over_shm']:5.2f}x shm"
                      + (f"  {row['over_floor']:5.2f}x floor" if floor else ""), flush=True)
    if args.out and COMM.rank == 0:
        with open(args.out, "a") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
