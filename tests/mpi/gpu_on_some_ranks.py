"""Rank 1 sees no GPU, the others do: ``import mpidp`` must not hang, and every rank must
make the same CUDA decision (mpidp.cuda.decision() gathers every rank's facts first)."""

import os

rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
if rank == "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch
from mpi4py import MPI

import mpidp

decision = mpidp.cuda.decision()
total = MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.Get_rank() + 1)  # the next collective must match
verdicts = MPI.COMM_WORLD.allgather(decision.cuda_aware)
print(f"rank {mpidp.rank()}: gpu {torch.cuda.is_available()}, {decision}, sum {total}, "
      f"verdicts {verdicts}", flush=True)
size = MPI.COMM_WORLD.Get_size()
assert total == size * (size + 1) // 2 and len(set(verdicts)) == 1
