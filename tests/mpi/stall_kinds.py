"""One rank late at each kind of collective mpidp issues: the stall watchdog must name each.

    MPIDP_TIMEOUT=0.75 MPIDP_TIMEOUT_ACTION=report mpiexec -n 2 python tests/mpi/stall_kinds.py

For each kind in ``KINDS``, every rank first makes what the collective needs
(a DDP, a group, a ZeRO optimizer...) and meets the others in a barrier; then the
last rank waits in user code until rank 0 has written its stall summary (the
flight recorder's ``summary.txt``), at most ``MPIDP_TIMEOUT + 30`` seconds, before
it issues the collective, while the others wait in it. Under
``MPIDP_TIMEOUT_ACTION=report`` rank 0 prints a stall summary naming what they
wait in, the late rank arrives, and the next kind begins: one launch checks them
all. Each kind is announced on stdout as ``kind NAME starts`` (rank 0).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

import mpidp
import mpidp.horovod as hvd

RANK, SIZE = mpidp.rank(), mpidp.size()
# rank 0 summarises within about two watchdog periods (MPIDP_TIMEOUT / 4) of the timeout; a
# fixed sleep past it cost 8 x 1.25 s, and a loaded machine may take longer than that anyway
LATEST = float(os.environ.get("MPIDP_TIMEOUT", "1")) + 30
SUMMARY = os.path.join(mpidp.recorder.directory(), "summary.txt")


def _late() -> None:
    """The late rank, in user code: until rank 0's summary of this stall, which shows this
    rank's stack down to this function, is written."""
    deadline = time.monotonic() + LATEST
    while time.monotonic() < deadline:
        if os.path.exists(SUMMARY):
            with open(SUMMARY) as summary:
                if f" in {_late.__name__}\n" in summary.read():
                    return
        time.sleep(0.05)


def _model(shared_memory: bool) -> mpidp.DistributedDataParallel:
    torch.manual_seed(0)
    return mpidp.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)),
                                         shared_memory=shared_memory)


def ddp_bucket(shared_memory: bool = False):
    model = _model(shared_memory)
    yield
    model(torch.ones(2, 8)).sum().backward()


def shared_memory_reduction():
    yield from ddp_bucket(shared_memory=True)


def backend_op():
    yield
    dist.all_reduce(torch.ones(16))


def horovod_op():
    yield
    hvd.allreduce(torch.ones(16), name="late")


def sync_batchnorm():
    layer = mpidp.SyncBatchNorm(4)
    yield
    layer(torch.randn(3, 4))


def zero_step():
    model = nn.Linear(8, 8)
    optimizer = mpidp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    yield
    optimizer.step()


def zero_checkpoint_gather():
    model = nn.Linear(8, 8)
    optimizer = mpidp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    yield
    optimizer.consolidate_state_dict()


def object_collective():
    mpidp.comm.default_pool()  # made at its first use: not the call under test
    yield
    mpidp.objects.broadcast_object({"step": 3}, root=0)


KINDS = [ddp_bucket, shared_memory_reduction, backend_op, horovod_op, sync_batchnorm, zero_step,
         zero_checkpoint_gather, object_collective]


def main() -> None:
    mpidp.init_process_group("mpidp")
    hvd.init()
    chosen = sys.argv[1:] or [kind.__name__ for kind in KINDS]
    for kind in KINDS:
        if kind.__name__ not in chosen:
            continue
        steps = kind()
        next(steps)  # what every rank makes before the collective
        if RANK == SIZE - 1 and os.path.exists(SUMMARY):
            os.remove(SUMMARY)  # the last kind's, read: its collective is done
        MPI.COMM_WORLD.Barrier()
        if RANK == 0:
            print(f"kind {kind.__name__} starts", flush=True)
        if RANK == SIZE - 1:
            _late()
        for _ in steps:  # the collective itself
            pass
        MPI.COMM_WORLD.Barrier()
    hvd.shutdown()
    dist.destroy_process_group()
    print(f"rank {RANK}: every kind done", flush=True)


if __name__ == "__main__":
    main()
