"""Gathers across a rank that dies mid-loop, under Open MPI's ULFM (tests/test_healing.py).

    mpirun --with-ft ulfm ... -n 4 python tests/mpi/ulfm_gathers.py VICTIM CALL DELAY

Every rank runs the gathers mpidp makes of objects and of uneven tensors in a loop, each
round's data being its number (the three forms take turns); rank VICTIM SIGKILLs itself
DELAY seconds after it starts its CALL-th gather (from a timer thread: inside a gather,
where the others wait in it). A survivor
must see every round either complete with that round's data from every rank, or raise
``mpidp.errors.RankLostError``: it prints ``rank R: lost at round I in WHAT`` or, for a
round that completed with other data (what Open MPI 5.0.11's blocking MPI_Allgatherv gives
under ULFM), ``rank R: WRONG at round I in WHAT: ...``.
"""

import os
import signal
import sys
import threading

import torch

import mpidp
from mpidp import errors
from mpidp.comm.agreement import watched_allgather


def main() -> None:
    victim, at, delay, calls = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), 0
    rank, size = mpidp.rank(), mpidp.size()
    world = mpidp.runtime.world()
    forms = {
        "a pickled allgather (the agreement's)":
            lambda i: watched_allgather(world, (i, rank), "ulfm_gathers") == [(i, r) for r in range(size)],
        "allgather_object":
            lambda i: mpidp.allgather_object((i, rank)) == [(i, r) for r in range(size)],
        "mpidp.comm.allgatherv":
            lambda i: mpidp.comm.allgatherv(torch.full((rank + 1,), float(i)))[0].eq(i).all().item(),
    }
    for i in range(4000):
        for what, check in forms.items():
            if rank == victim and calls == at:
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            calls += 1
            try:
                ok = check(i)
            except Exception as error:  # noqa: BLE001 (what it raised is the result)
                if errors.lost_rank(error):
                    print(f"rank {rank}: lost at round {i} in {what}", flush=True)
                else:
                    print(f"rank {rank}: WRONG at round {i} in {what}: {type(error).__name__}: "
                          f"{error}", flush=True)
                os._exit(0)
            if not ok:
                print(f"rank {rank}: WRONG at round {i} in {what}: other data", flush=True)
                os._exit(0)
    print(f"rank {rank}: every round whole", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
