"""Across real nodes (bench/cluster/harness.py): node detection, and training equal to one process.

Run by tests/test_cluster.py on 2 nodes x 2 ranks, each node in namespaces of
its own with its own /dev/shm and a link to the other through veths, so MPI's
messages between nodes cross a (shaped) network and shared memory only joins
the ranks of one node. Checks, in float64 so that only the order of the sums
differs from one process training on the whole batch:

- mpidp sees two nodes: hostnames, local ranks, ``mpidp.comm.shm`` grouping, and
  the info report;
- a 16 MB allreduce gives the exact sum (its bytes cross the veths: the test
  reads the counters);
- mpidp.DistributedDataParallel with shared memory within a node and MPI
  across, torch's DDP over the "mpidp" backend, ZeRO stages 1 and 2, and
  SyncBatchNorm train as one process on the whole batch does.

Rank 0 prints ``CLUSTER <check> max_abs_diff=.. max_rel_diff=..`` per check
(run pytest with ``-s`` to see them).
"""

import contextlib
import io
import os
import socket

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

import mpidp
from mpidp import topology
from mpidp.comm import shm

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
NODES = int(os.environ.get("CLUSTER_NODES", "2"))
PPN = SIZE // NODES
BATCH = 24  # divisible by 1 to 4 ranks
STEPS = 5
TOL = 1e-12  # float64: the sums' order is all that differs (observed ~1e-16)
F64 = torch.float64


def wide():
    return nn.Sequential(nn.Linear(10, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                         nn.Linear(512, 5)).to(F64)


def convbn():
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Conv2d(6, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).to(F64)


def batch(step: int, image: bool = False):
    gen = torch.Generator().manual_seed(100 + step)
    shape = (BATCH, 3, 8, 8) if image else (BATCH, 10)
    return (torch.randn(*shape, generator=gen, dtype=F64),
            torch.randn(BATCH, 5, generator=gen, dtype=F64))


def shard(tensor):
    return tensor.chunk(SIZE)[RANK]


def model_pair(factory):
    """(this rank's model from its own seed, rank 0's initial model as the reference)."""
    torch.manual_seed(RANK)
    mine = factory()
    torch.manual_seed(0)
    return mine, factory()


def differences(a: nn.Module, b: nn.Module) -> tuple[float, float]:
    """(max |a - b|, max over tensors of max|a - b| / max|b|), over parameters and buffers."""
    worst_abs = worst_rel = 0.0
    for x, y in zip([*a.parameters(), *a.buffers()], [*b.parameters(), *b.buffers()]):
        gap = (x.detach().double() - y.detach().double()).abs().max().item()
        worst_abs = max(worst_abs, gap)
        worst_rel = max(worst_rel, gap / (y.detach().double().abs().max().item() or 1.0))
    worst_abs = COMM.allreduce(worst_abs, op=MPI.MAX)
    return worst_abs, COMM.allreduce(worst_rel, op=MPI.MAX)


def report(name: str, trained: nn.Module, reference: nn.Module) -> float:
    worst_abs, worst_rel = differences(trained, reference)
    if RANK == 0:
        print(f"\nCLUSTER {name} nodes={NODES} ranks={SIZE} max_abs_diff={worst_abs:.2e} "
              f"max_rel_diff={worst_rel:.2e}", flush=True)
    return worst_rel


def train(model, optimizer, reference, ref_optimizer, *, image=False, steps=STEPS):
    """Train ``model`` on this rank's shards and ``reference`` on whole batches."""
    for step in range(steps):
        x, y = batch(step, image)
        optimizer.zero_grad()
        F.mse_loss(model(shard(x)), shard(y)).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_optimizer.step()


# -- the layout ------------------------------------------------------------------------


def test_mpidp_sees_every_node_with_its_ranks():
    ranks = topology.gather()
    assert [r.host for r in ranks] == [f"n{rank // PPN}" for rank in range(SIZE)]
    assert [r.local_rank for r in ranks] == [rank % PPN for rank in range(SIZE)]
    assert (mpidp.local_rank(), mpidp.local_size()) == (RANK % PPN, PPN)
    boot_ids = COMM.allgather(open("/proc/sys/kernel/random/boot_id").read())
    assert len(set(boot_ids)) == NODES, "nodes share a boot id: MPI may take them for one machine"


def test_shared_memory_groups_the_ranks_of_each_node():
    node = shm.Node(COMM)
    try:
        assert node.usable == (PPN > 1), node.reason
        assert (node.local_rank, node.local_size) == (RANK % PPN, PPN)
        assert node.cross.Get_size() == NODES
    finally:
        node.free()


def test_info_report_lists_each_node():
    from mpidp.__main__ import info  # noqa: PLC0415 (the report that python -m mpidp info prints)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        info()
    if RANK == 0:
        rows = [line.split() for line in out.getvalue().splitlines()[1:SIZE + 1]]
        assert [row[1] for row in rows] == [f"n{rank // PPN}" for rank in range(SIZE)]
        print("\n" + out.getvalue(), flush=True)


def test_a_16_mb_allreduce_between_nodes_is_exact():
    tensor = torch.full((4 << 20,), float(RANK + 1))
    mpidp.comm.allreduce(tensor)
    assert torch.all(tensor == SIZE * (SIZE + 1) / 2)
    if RANK == 0:
        print(f"\nCLUSTER allreduce16mb host={socket.gethostname()} done", flush=True)


# -- training ------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_ddp_with_shared_memory_in_nodes_equals_one_process(optimizer):
    mine, reference = model_pair(wide)
    ddp = mpidp.DistributedDataParallel(mine, bucket_cap_mb=0.5, shared_memory=PPN > 1)
    assert (ddp._node is not None) == (PPN > 1)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-3)}[optimizer]
    train(ddp, make(ddp.parameters()), reference, make(reference.parameters()))
    assert report(f"ddp-{'shm' if PPN > 1 else 'mpi'}-{optimizer}", ddp.module, reference) < TOL
    ddp.close()


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_equals_one_process(stage):
    mine, reference = model_pair(wide)
    ddp = mpidp.DistributedDataParallel(mine, bucket_cap_mb=0.5)
    opt = mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=stage,
                                        lr=1e-2, weight_decay=0.1)
    train(ddp, opt, reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1))
    assert report(f"zero-stage{stage}", ddp.module, reference) < TOL
    ddp.close()


def test_syncbatchnorm_equals_batchnorm_on_the_whole_batch():
    mine, reference = model_pair(convbn)
    ddp = mpidp.DistributedDataParallel(mpidp.SyncBatchNorm.convert_sync_batchnorm(mine))
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), reference,
          torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9), image=True)
    assert report("syncbn", ddp.module, reference) < TOL  # the running statistics too
    ddp.close()


def test_torch_ddp_over_the_mpidp_backend_equals_one_process():
    mpidp.init_process_group()
    try:
        mine, reference = model_pair(wide)
        model = nn.parallel.DistributedDataParallel(mine, bucket_cap_mb=0.5)
        train(model, torch.optim.Adam(model.parameters(), lr=1e-3), reference,
              torch.optim.Adam(reference.parameters(), lr=1e-3))
        assert report("backend-torch-ddp", model.module, reference) < TOL
    finally:
        dist.destroy_process_group()
