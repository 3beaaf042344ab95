"""Rank 1 leaves through SystemExit while the others wait for it: mpidp must end the job.

    mpiexec -n 2 python tests/mpi/exit_on_one_rank.py sys.exit

Modes: ``sys.exit`` (sys.exit(3)), ``exit`` (the builtin, exit(3)), ``message``
(sys.exit("...") exits with status 1), ``finally`` (sys.exit(3) through a
try/finally of the module code), and ``caught`` (rank 1 catches its
sys.exit(3) and carries on: the job must end normally, with status 0).
"""

import sys
import time

import torch

import mpidp


def leave(mode: str) -> None:
    time.sleep(0.5)  # the other ranks are waiting by now
    if mode == "exit":
        exit(3)  # noqa: PLR1722  (the builtin is what is tested)
    sys.exit("rank 1 gives up" if mode == "message" else 3)


mode = sys.argv[1]
if mpidp.rank() == 1:
    if mode == "finally":
        try:
            leave(mode)
        finally:
            print("rank 1 cleans up", flush=True)
    elif mode == "caught":
        try:
            leave(mode)
        except SystemExit:
            print("rank 1 caught its SystemExit and carries on", flush=True)
    else:
        leave(mode)
total = mpidp.comm.allreduce(torch.ones(1))  # the others wait here for rank 1
mpidp.barrier()
if mode != "caught":
    sys.exit(f"rank {mpidp.rank()} got past a collective that rank 1 never joined")
print(f"rank {mpidp.rank()} done, allreduce gave {total.item():.0f}", flush=True)
