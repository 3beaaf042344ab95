"""MPI initialised at MPI_THREAD_SERIALIZED: DDP picks legal overlap strategies, refuses the others.

torch's DDP over the "mpidp" backend works there too: every operation completes before it
returns, and no progress thread starts (it would call MPI beside the training thread).
Runs in the launches with ``MPI4PY_RC_THREAD_LEVEL=serialized`` (tests/test_mpi.py), beside
check_backend.py at 2 ranks; skips in a launch at another level.
"""

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.ddp import overlap

pytestmark = pytest.mark.skipif(mpidp.runtime.thread_level() > MPI.THREAD_SERIALIZED,
                                reason="for launches with MPI4PY_RC_THREAD_LEVEL=serialized")


def test_ddp_picks_a_legal_strategy_and_refuses_the_thread_on_every_rank():
    ddp = mpidp.DistributedDataParallel(nn.Linear(4, 2))
    assert isinstance(ddp.reducer.strategy, overlap.InlineStrategy), ddp.reducer.strategy
    with pytest.raises(ValueError) as error:
        mpidp.DistributedDataParallel(nn.Linear(4, 2), overlap="thread")
    message = str(error.value)
    assert MPI.COMM_WORLD.allgather(message) == [message] * mpidp.size()  # every rank, same words
    ddp.close()


@pytest.mark.parametrize("name", ["inline", "nonblocking"])
def test_the_legal_strategies_train(name):
    """Legal: MPI is called from the training thread only."""
    with mpidp.DistributedDataParallel(nn.Linear(4, 2), overlap=name) as model:
        torch.manual_seed(mpidp.rank())
        model(torch.randn(3, 4)).sum().backward()
        grad = model.module.weight.grad
        high, low = grad.clone(), grad.clone()
        mpidp.comm.allreduce(high, "max")
        mpidp.comm.allreduce(low, "min")
        assert torch.equal(high, low), name


def test_torch_ddp_over_mpidp_completes_each_operation_before_it_returns():
    mpidp.init_process_group()  # torch.distributed over "mpidp"
    try:
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
    finally:
        torch.distributed.destroy_process_group()
