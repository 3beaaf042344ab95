"""Start-up time of ``mpidp.init_process_group()`` with the store over MPI and over TCP, in turns.

Each launch is a fresh job (the store starts once per process); the two stores
take turns, launch after launch, so load on the machine falls on both alike::

    python bench/store_startup.py --ranks 2 4 --launches 5

Per launch, every rank times ``import mpidp`` and then the first and second
``mpidp.init_process_group(backend)`` (destroyed in between); rank 0 prints the
slowest rank's times. The summary gives the median over the launches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = r"""
import time
started = time.perf_counter()
import mpidp
imported = time.perf_counter() - started
import torch.distributed as dist
from mpi4py import MPI
times = [imported]
for _ in range(2):
    MPI.COMM_WORLD.Barrier()
    t = time.perf_counter()
    mpidp.init_process_group(BACKEND)
    times.append(time.perf_counter() - t)
    MPI.COMM_WORLD.Barrier()  # gloo: a rank that destroys its group while a peer still connects
    dist.destroy_process_group()  # fails the peer's start ("Connection closed by peer")
slowest = MPI.COMM_WORLD.reduce(times, op=lambda a, b: [max(x, y) for x, y in zip(a, b)])
if MPI.COMM_WORLD.Get_rank() == 0:
    print("TIMES", *slowest)
"""


def launch(ranks: int, store: str, backend: str) -> list[float]:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    env = dict(os.environ, MPIDP_STORE=store, OMP_NUM_THREADS="1")
    code = CHILD.replace("BACKEND", repr(backend))
    done = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-c", code], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = next((l for l in done.stdout.splitlines() if l.startswith("TIMES")), None)
    if line is None:
        raise RuntimeError(f"{store} at {ranks} ranks failed:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-6000:]}")
    return [float(x) for x in line.split()[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--backend", default="mpidp")
    args = parser.parse_args()
    print(f"backend {args.backend}; ms, median over {args.launches} launches (slowest rank)")
    print("ranks  store  import mpidp  first init  second init")
    for ranks in args.ranks:
        results: dict[str, list[list[float]]] = {"mpi": [], "tcp": []}
        for _ in range(args.launches):
            for store in results:
                results[store].append(launch(ranks, store, args.backend))
        for store, runs in results.items():
            medians = [statistics.median(run[i] for run in runs) * 1e3 for i in range(3)]
            print(f"{ranks:5d}  {store:5s}  {medians[0]:12.1f}  {medians[1]:10.1f}  "
                  f"{medians[2]:11.1f}")
        sys.stdout.flush()


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"({time.time() - started:.0f} s)")
