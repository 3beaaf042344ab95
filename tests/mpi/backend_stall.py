"""torch's DDP over the "mpidp" backend with one rank skipping a step: the job must end.

    mpiexec -n 2 python tests/mpi/backend_stall.py timeout|watchdog

``timeout``: the group's timeout is 2 s (init_process_group's ``timeout``); the
future torch's DDP waits on fails with DistBackendError, the backward raises and
the job ends. ``watchdog``: torch's default timeout, ``MPIDP_TIMEOUT`` short
(set by the test); the stall watchdog sees the pending Work and ends the job.
Before the step that hangs, each rank prints ``rank R stalls at T``.
"""

import datetime
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import mpidp

mode = sys.argv[1]
kwargs = {"timeout": datetime.timedelta(seconds=2)} if mode == "timeout" else {}
mpidp.init_process_group(**kwargs)
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
for step in range(3):
    if step == 2:
        print(f"rank {rank} stalls at {time.time():.3f}", flush=True)
        if rank == 1:
            time.sleep(120)  # skips the step: the others wait in its all_reduce
            sys.exit(0)
    model(torch.randn(4, 8)).sum().backward()
print(f"rank {rank}: training ended without the skipped step being noticed", flush=True)
