"""Allreduce micro-benchmark worker: mpidp.comm vs raw mpi4py; bench/run.py drives it.

    mpiexec -n 2 python bench/allreduce_bench.py --out r.jsonl

For each size (float32, 8 bytes to 64 MiB) the methods take turns, call by
call batch, on one duplicated communicator:

- ``mpi4py``: ``comm.Allreduce(MPI.IN_PLACE, numpy_array)``;
- ``mpidp``: ``mpidp.comm.allreduce(tensor, comm=comm)``;
- ``mpidp-nonblocking``: ``mpidp.comm.iallreduce(tensor, comm=comm).wait()``;
- ``mpi4py-nonblocking``: ``comm.Iallreduce(...).Wait()``, the baseline for the line above.

Reports the median time per call and the bus bandwidth, 2 (n - 1) / n x bytes / time.
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import mpidp

SIZES = [8, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def methods(comm, array, tensor):
    return {
        "mpi4py": lambda: comm.Allreduce(MPI.IN_PLACE, array),
        "mpidp": lambda: mpidp.comm.allreduce(tensor, comm=comm),
        "mpi4py-nonblocking": lambda: comm.Iallreduce(MPI.IN_PLACE, array).Wait(),
        "mpidp-nonblocking": lambda: mpidp.comm.iallreduce(tensor, comm=comm).wait(),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    results = []
    for nbytes in SIZES:
        array = np.ones(nbytes // 4, dtype=np.float32)
        tensor = torch.from_numpy(array)  # the same memory for every method
        calls = max(4, min(2000, (64 << 20) // nbytes))
        table = methods(comm, array, tensor)
        times = {name: [] for name in table}
        for name, call in table.items():  # warm up
            call()
        for _ in range(args.repeats):
            for name, call in table.items():
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
                times[name].append(elapsed / calls)
        results += summarise(times, nbytes, comm.size, kind="allreduce")
    report(comm, args.out, results)
    comm.Free()


def summarise(times: dict, nbytes: int, ranks: int, **extra) -> list[dict]:
    """One result per method: the median time per call and the bus bandwidth."""
    results = []
    for name, samples in times.items():
        seconds = statistics.median(samples)
        bus = 2 * (ranks - 1) / ranks * nbytes / seconds / 1e9
        results.append({**extra, "method": name, "bytes": nbytes, "ranks": ranks,
                        "us_per_call": seconds * 1e6, "bus_gbps": bus})
    return results


def report(comm, path: str, results: list[dict]) -> None:
    """Rank 0 appends the results to ``path`` (JSON lines) and prints them."""
    if comm.rank != 0:
        return
    with open(path, "a") as out:
        out.writelines(json.dumps(result) + "\n" for result in results)
    for r in results:
        print(f"{r['bytes']:>10d} B {r['method']:20s} {r['us_per_call']:10.1f} us "
              f"{r['bus_gbps']:7.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
