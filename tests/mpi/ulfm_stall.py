"""A stall after a lost rank, with no heal, under Open MPI's ULFM (tests/test_healing.py).

Rank 2 of 3 dies; the stall watchdog's communicator, which has it, fails on the survivors.
Rank 0 then waits in a collective over ranks 0 and 1 that rank 1 never joins: its watchdog
must report the stall and end the job saying why there is no summary.
"""

import os
import signal
import time

import torch
from mpi4py import MPI

import mpidp

world = MPI.COMM_WORLD
pair = mpidp.communicators.made(world.Split(0 if world.Get_rank() < 2 else 1), "ulfm_stall's pair")
mpidp.barrier()
if world.Get_rank() == 2:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(1.0)  # the watchdogs' channel meets the lost rank
if world.Get_rank() == 0:
    print("rank 0 waits for rank 1", flush=True)
    mpidp.comm.allreduce(torch.ones(1), comm=pair)
    print("went on past a collective rank 1 never joined", flush=True)
else:
    time.sleep(60)
