"""Start-up time of ``mpidp.init_process_group()`` with the store over MPI and over TCP, in turns.

Each launch is a fresh job (the store starts once per process); the two stores
take turns, launch after launch, so load on the machine falls on both alike::

    python bench/store_startup.py --ranks 2 4 8 --launches 5 --backends mpidp gloo
    python bench/store_startup.py --ranks 1 2 --launches 3 --backends nccl   # on a GPU

Per launch, every rank times ``import mpidp`` and then the first and second
``mpidp.init_process_group(backend)`` (destroyed in between); rank 0 prints the
slowest rank's times. The summary gives the median over the launches. A rank
that has finished its start-up waits for the others in a barrier that sleeps
(``MPI_Barrier`` spins: on an oversubscribed machine it would take the core of
a rank still starting), and every rank collects garbage before each start (a
full collection of torch's objects took 220-270 ms under load, and fell inside
one store's start or the other's by where the allocations crossed Python's
threshold). ``--idle S`` then keeps a group and the store idle for
S seconds and reports the CPU time rank 0's process used meanwhile (the store
thread's polls, over MPI) as a percentage of one core.

NCCL: every rank takes its local GPU and passes ``device_id``, so NCCL makes its
communicator inside the start (rank 0 hands its unique id to the others through
the store), and an all_reduce checks the group. Ranks that share one GPU are
given different ``NCCL_HOSTID``s: NCCL then takes them for different hosts (its
check "Duplicate GPU detected" passes) and they talk over sockets. mpiexec is the
one beside python, else the one on PATH (``$MPIEXEC_ARGS`` are added to it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = r"""
import gc
import os
import time
started = time.perf_counter()
import mpidp
imported = time.perf_counter() - started
import torch.distributed as dist
from mpi4py import MPI

def barrier():  # sleeps while it waits, unlike MPI_Barrier
    request = MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.001)

if WARM:  # the "mpidp" backend's first start loads torch._dynamo: seconds, alike over both stores
    import torch._dynamo
extra = {}
if BACKEND == "nccl":
    import torch
    rank = MPI.COMM_WORLD.Get_rank()
    os.environ["NCCL_HOSTID"] = f"mpidp-bench-{rank}"  # one GPU, several ranks: see the docstring
    extra["device_id"] = mpidp.cuda.local_device()
    torch.cuda.set_device(extra["device_id"])

times = [imported]
for _ in range(2):
    gc.collect()  # else a full collection of torch's heap (~250 ms) lands in whichever start
    MPI.COMM_WORLD.Barrier()  # crosses the threshold first: seen in both stores' starts
    t = time.perf_counter()
    mpidp.init_process_group(BACKEND, **extra)
    times.append(time.perf_counter() - t)
    if BACKEND == "nccl":
        ones = torch.ones(4, device=extra["device_id"])
        dist.all_reduce(ones)
        assert ones.tolist() == [float(MPI.COMM_WORLD.Get_size())] * 4, ones
    barrier()  # gloo: a rank that destroys its group while a peer still connects
    dist.destroy_process_group()  # fails the peer's start ("Connection closed by peer")
if IDLE:
    mpidp.init_process_group(BACKEND, **extra)
    barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(IDLE)  # every thread of mpidp's stays up: the store thread, the watchdog
    times.append((time.process_time() - cpu) / (time.perf_counter() - wall))
    barrier()
    dist.destroy_process_group()
slowest = MPI.COMM_WORLD.reduce(times, op=lambda a, b: [max(x, y) for x, y in zip(a, b)])
if MPI.COMM_WORLD.Get_rank() == 0:
    print("TIMES", *(slowest[:3] + times[3:]))
"""


def launch(ranks: int, store: str, backend: str, idle: float, warm: bool = False) -> list[float]:
    beside = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(beside) if beside.exists() else shutil.which("mpiexec")
    env = dict(os.environ, MPIDP_STORE=store, OMP_NUM_THREADS="1")
    code = (CHILD.replace("BACKEND", repr(backend)).replace("IDLE", repr(idle))
            .replace("WARM", repr(warm)))
    done = subprocess.run([mpiexec, *os.environ.get("MPIEXEC_ARGS", "").split(), "-n", str(ranks), sys.executable, "-c", code], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = next((l for l in done.stdout.splitlines() if l.startswith("TIMES")), None)
    if line is None:
        raise RuntimeError(f"{store} at {ranks} ranks failed:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-6000:]}")
    return [float(x) for x in line.split()[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["mpidp", "gloo"])
    parser.add_argument("--warm", action="store_true",
                        help="import torch._dynamo before the first start (the 'mpidp' backend's "
                             "first start loads it: seconds that drown the store's part)")
    parser.add_argument("--idle", type=float, default=0.0,
                        help="seconds of an idle store after the starts; rank 0's CPU meanwhile")
    args = parser.parse_args()
    print(f"ms, median over {args.launches} launches (slowest rank)")
    print("backend  ranks  store  import mpidp  first init  second init"
          + ("  idle CPU, rank 0" if args.idle else ""))
    for backend in args.backends:
        for ranks in args.ranks:
            results: dict[str, list[list[float]]] = {"mpi": [], "tcp": []}
            for _ in range(args.launches):
                for store in results:
                    results[store].append(launch(ranks, store, backend, args.idle, args.warm))
            for store, runs in results.items():
                medians = [statistics.median(run[i] for run in runs) for i in range(len(runs[0]))]
                idle = f"  {medians[3] * 100:15.2f} %" if args.idle else ""
                print(f"{backend:7s}  {ranks:5d}  {store:5s}  {medians[0] * 1e3:12.1f}  "
                      f"{medians[1] * 1e3:10.1f}  {medians[2] * 1e3:11.1f}{idle}")
            sys.stdout.flush()


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"({time.time() - started:.0f} s)")
