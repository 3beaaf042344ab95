"""Rank 0 alone converts the DDP wrapper (ddp.double()); the stall watchdog must end the job.

    MPIDP_TIMEOUT=2 mpiexec -n 2 python tests/mpi/convert_one_rank.py

A conversion through the wrapper is collective (it rebuilds the buckets on
every rank alike), so rank 0 waits in its model check while rank 1 goes on to
the next step and waits in a bucket allreduce. The watchdog's report names the
"module conversion" on rank 0, and the job is aborted. The last line is printed
only if rank 0 got out of the conversion.
"""

import torch
from torch import nn

import mpidp

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
ddp = mpidp.DistributedDataParallel(model)
ddp(torch.randn(4, 10)).sum().backward()
dtype = torch.float32
if mpidp.rank() == 0:
    ddp.double()
    dtype = torch.float64
ddp(torch.randn(4, 10, dtype=dtype)).sum().backward()
print(f"rank {mpidp.rank()} went on past a conversion made on rank 0 alone", flush=True)
