"""mpidp's own bucket reduction raises on rank 1 at step 2; the script catches it: the job must end.

    mpiexec -n 2 python tests/mpi/reduction_fails_on_one_rank.py thread

The argument is the overlap strategy ("inline", "thread" or "nonblocking").
Under "thread" the reduction raises on the communication thread. The other
ranks wait in collectives that rank 1 will not issue, so catching the error
cannot line the ranks up again: mpidp aborts the job, naming the error, with
status 1. The last line is printed only if the job went on.
"""

import sys

import torch
from torch import nn

import mpidp


class Injected(RuntimeError):
    pass


def fail_once(strategy) -> None:
    """Make the strategy's next bucket reduction raise before it issues anything."""
    def each(*args):
        del strategy._each
        raise Injected("injected failure of bucket 0 on rank 1")

    strategy._each = each


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))
ddp = mpidp.DistributedDataParallel(model, overlap=sys.argv[1], bucket_cap_mb=0.001)
for step in range(5):
    if step == 2 and mpidp.rank() == 1:
        fail_once(ddp.reducer.strategy)
    ddp.zero_grad()
    try:
        ddp(torch.randn(4, 10)).square().sum().backward()
    except RuntimeError as error:  # as a training loop that skips bad steps would
        print(f"rank {mpidp.rank()} step {step}: {type(error).__name__}: {error}", flush=True)
print(f"rank {mpidp.rank()} finished every step", flush=True)
