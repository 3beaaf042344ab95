"""MPI initialised at MPI_THREAD_SERIALIZED: DDP picks legal overlap strategies, refuses the others.

torch's DDP over the "mpidp" backend works there too: every operation completes before it
returns, and no progress thread starts (it would call MPI beside the training thread).
"""

import mpi4py

mpi4py.rc.thread_level = "serialized"  # before mpidp (and mpi4py.MPI) is imported

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

import mpidp  # noqa: E402
from mpidp.ddp import overlap  # noqa: E402

level = mpidp.runtime.thread_level()
assert level <= MPI.THREAD_SERIALIZED, f"asked for serialized, MPI granted {level}"
ddp = mpidp.DistributedDataParallel(nn.Linear(4, 2))
assert isinstance(ddp.reducer.strategy, overlap.InlineStrategy), ddp.reducer.strategy
try:
    mpidp.DistributedDataParallel(nn.Linear(4, 2), overlap="thread")
except ValueError as error:
    message = str(error)
else:
    raise AssertionError("overlap='thread' was accepted under MPI_THREAD_SERIALIZED")
assert MPI.COMM_WORLD.allgather(message) == [message] * mpidp.size()  # every rank, same words
for name in ("inline", "nonblocking"):  # legal: MPI is called from the training thread only
    with mpidp.DistributedDataParallel(nn.Linear(4, 2), overlap=name) as model:
        torch.manual_seed(mpidp.rank())
        model(torch.randn(3, 4)).sum().backward()
        grad = model.module.weight.grad
        high, low = grad.clone(), grad.clone()
        mpidp.comm.allreduce(high, "max")
        mpidp.comm.allreduce(low, "min")
        assert torch.equal(high, low), name
mpidp.init_process_group()  # torch.distributed over "mpidp"
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
torch.manual_seed(mpidp.rank())
model(torch.randn(3, 4)).sum().backward()
grads = [torch.empty_like(model.module.weight.grad) for _ in range(mpidp.size())]
torch.distributed.all_gather(grads, model.module.weight.grad)
assert all(torch.equal(g, grads[0]) for g in grads), "torch DDP over mpidp: gradients differ"
work = torch.distributed.all_reduce(torch.ones(1), async_op=True)
assert work.is_completed(), "below MPI_THREAD_MULTIPLE an async op completes before it returns"
assert mpidp.process_group._progress._thread is None, "a progress thread started"
torch.distributed.destroy_process_group()
if mpidp.rank() == 0:
    print(f"granted level {level}; overlap='thread' refused: {message}")
    print("thread level checks passed")
