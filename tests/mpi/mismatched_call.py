"""Ranks make an allreduce that differs (element count or dtype): the job must end, saying what.

    mpiexec -n 2 python tests/mpi/mismatched_call.py count|dtype|backend|ddp

Without ``MPIDP_DEBUG=1`` nothing compares the calls first; MPICH then ends the
process from inside the collective (a truncated message), whatever the error handler.
mpidp's exit report must name the collective and the way on. With ``MPIDP_DEBUG=1``
(set by the test) every rank raises mpidp's own ValueError before MPI runs the call.
``backend``: the same through torch.distributed over "mpidp". ``ddp``: rank 1 makes an
all_reduce of 3 elements where rank 0's torch DDP reduces a bucket: the future torch's C++
reducer waits on fails, which crashed the rank (SIGSEGV) until such a failure ended the job.
"""

import sys

import torch

import mpidp

rank = mpidp.rank()
kind = sys.argv[1]
if kind == "dtype":
    tensor = torch.ones(1000, dtype=torch.float32 if rank == 0 else torch.float64)
else:
    tensor = torch.ones(1000 + 500 * rank)
if kind in ("backend", "ddp"):
    import torch.distributed as dist
    mpidp.init_process_group()
if kind == "backend":
    dist.all_reduce(tensor)
elif kind == "ddp":
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    for step in range(3):
        if step == 2 and rank == 1:
            dist.all_reduce(torch.ones(3))
        else:
            model(torch.randn(4, 64)).sum().backward()
else:
    mpidp.comm.allreduce(tensor)
print(f"rank {rank} went on past a mismatched allreduce: {tensor[:2].tolist()}", flush=True)
