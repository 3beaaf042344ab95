"""Reproducible mode (``DistributedDataParallel(reproducible=True)``): the same bits at any size.

Run on every rank under mpiexec, at 1 to 4 ranks. Each run trains a tiny model
a few steps over the world and, on every rank, the same over ``COMM_SELF``
with the whole global batch (one process, as a 1-rank launch would), and the
printed losses and the final parameters must be equal, bit for bit.
"""

import contextlib
import itertools
import re

import pytest
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import mpidp

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
# two micro-batches per rank (one under no_sync); the same count at every size is
# examples/train_preemptible.py's contract, launched by tests/test_preemption.py
MICRO_BATCHES, MICRO_SIZE, STEPS = 2 * SIZE, 2, 2
OPTIMIZERS = ("plain", "zero1", "zero2")
# dealt unevenly from 2 ranks on: the first rank two micro-batches, the others one
UNEVEN = pytest.mark.skipif(SIZE == 1, reason="one rank takes every micro-batch")


def _loader(comm, dtype, micro_batches=MICRO_BATCHES):
    data = torch.Generator().manual_seed(5)
    inputs = torch.randn(96, 8, generator=data, dtype=dtype)
    targets = (inputs @ torch.randn(8, 1, generator=data, dtype=dtype)).sin()
    sampler = mpidp.DistributedSampler(TensorDataset(inputs, targets), comm.Get_size(),
                                       comm.Get_rank(), seed=3, micro_batches=micro_batches,
                                       micro_batch_size=MICRO_SIZE)
    return DataLoader(sampler.dataset, batch_size=sampler.batch_size, sampler=sampler)


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)


def _optimizer(ddp, comm, kind):
    if kind == "plain":
        return torch.optim.Adam(ddp.parameters(), lr=0.01)
    if kind == "zero1":
        return mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, comm=comm,
                                             lr=0.01)
    return mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, stage=2, lr=0.01)


def _micro_steps(ddp, x, y) -> list[float]:
    pieces = list(zip(x.split(MICRO_SIZE), y.split(MICRO_SIZE)))
    losses = []
    for k, (xm, ym) in enumerate(pieces):
        with contextlib.nullcontext() if k == len(pieces) - 1 else ddp.no_sync():
            loss = F.mse_loss(ddp(xm), ym)
            loss.backward()
        losses.append(loss.item())
    return losses


def _train(comm, dtype, kind, zero_grad=True, micro_batches=MICRO_BATCHES) -> list[str]:
    """The losses of each step as printed (repr), then the final parameters' bytes."""
    model = _model(dtype)
    ddp = mpidp.DistributedDataParallel(model, comm=comm, reproducible=True)
    optimizer = _optimizer(ddp, comm, kind)
    printed = []
    for x, y in itertools.islice(_loader(comm, dtype, micro_batches), STEPS):
        if zero_grad:
            optimizer.zero_grad()
        losses = _micro_steps(ddp, x, y)
        optimizer.step()
        printed.append(repr(mpidp.average(losses, comm=comm)))
    printed += [p.detach().numpy().tobytes().hex() for p in model.parameters()]
    ddp.close()
    return printed


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_every_step_is_the_one_process_run_bit_for_bit(dtype, kind):
    alone = _train(MPI.COMM_SELF, dtype, kind)
    assert _train(MPI.COMM_WORLD, dtype, kind) == alone


@UNEVEN
@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_micro_batches_dealt_unevenly_give_the_one_process_run_bit_for_bit(dtype, kind):
    alone = _train(MPI.COMM_SELF, dtype, kind, micro_batches=SIZE + 1)
    assert _train(MPI.COMM_WORLD, dtype, kind, micro_batches=SIZE + 1) == alone


def test_gradients_left_from_the_step_before_are_added_as_torch_accumulates():
    alone = _train(MPI.COMM_SELF, torch.float64, "plain", zero_grad=False)
    assert _train(MPI.COMM_WORLD, torch.float64, "plain", zero_grad=False) == alone
    # without zero_grad(), .grad is the earlier average plus the new one
    ddp = mpidp.DistributedDataParallel(_model(torch.float64), reproducible=True)
    (x1, y1), (x2, y2) = itertools.islice(_loader(MPI.COMM_WORLD, torch.float64), 2)
    averages = []
    for x, y in ((x1, y1), (x2, y2)):
        ddp.module.zero_grad()
        _micro_steps(ddp, x, y)
        averages.append([p.grad.clone() for p in ddp.parameters()])
    ddp.module.zero_grad()
    _micro_steps(ddp, x1, y1)
    _micro_steps(ddp, x2, y2)
    assert all(torch.equal(p.grad, second + first)
               for p, first, second in zip(ddp.parameters(), *averages))
    # zero_grad() between a forward and its backward: nothing of before is kept
    pieces = list(zip(x2.split(MICRO_SIZE), y2.split(MICRO_SIZE)))
    for k, (xm, ym) in enumerate(pieces):
        with contextlib.nullcontext() if k == len(pieces) - 1 else ddp.no_sync():
            loss = F.mse_loss(ddp(xm), ym)
            if k == 0:
                ddp.module.zero_grad()
            loss.backward()
    assert all(torch.equal(p.grad, second) for p, second in zip(ddp.parameters(), averages[1]))
    ddp.close()


def test_an_evaluation_forward_with_grad_on_one_rank_changes_nothing():
    (x1, y1), (x2, y2) = itertools.islice(_loader(MPI.COMM_WORLD, torch.float64), 2)
    grads = []
    for evaluate in (False, True):
        ddp = mpidp.DistributedDataParallel(_model(torch.float64), reproducible=True)
        _micro_steps(ddp, x1, y1)
        if evaluate and RANK == 0:  # no collective, and the average in .grad is not kept
            ddp.eval()
            ddp(x1[:MICRO_SIZE])
            ddp.train()
        ddp.module.zero_grad()
        _micro_steps(ddp, x2, y2)
        grads.append([p.grad.clone() for p in ddp.parameters()])
        ddp.close()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.skipif(SIZE == 1, reason="needs ranks that can disagree")
def test_another_number_of_micro_batches_on_one_rank_raises_on_every_rank():
    ddp = mpidp.DistributedDataParallel(_model(torch.float64), reproducible=True)
    x, y = next(iter(_loader(MPI.COMM_WORLD, torch.float64)))
    with ddp.no_sync():
        for _ in range(1 if RANK == SIZE - 1 else 0):  # the last rank runs one micro-batch more
            F.mse_loss(ddp(x[:MICRO_SIZE]), y[:MICRO_SIZE]).backward()
    with pytest.raises(ValueError, match=rf"as the sampler deals them.*micro_batch_counts\(M, "
                                         rf"{SIZE} ranks\) = .*M = {MICRO_BATCHES + 1} \(their "
                                         rf"sum.*rank {SIZE - 1}: "
                                         rf"ran {MICRO_BATCHES // SIZE + 1} micro-batch\(es\)"):
        _micro_steps(ddp, x, y)
    ddp.module.zero_grad()
    _micro_steps(ddp, x, y)  # the next step starts afresh on every rank
    assert all(p.grad is not None for p in ddp.parameters())
    ddp.close()


def _step_with_one_more_on_rank_0(ddp, x, y):
    """A step in which rank 0 runs one micro-batch more: from 2 ranks on, the dealing of one
    more in all (4 at 2 ranks: [3, 2], the dealing of 5), which only M itself tells apart."""
    with ddp.no_sync():
        if RANK == 0:
            F.mse_loss(ddp(x[:MICRO_SIZE]), y[:MICRO_SIZE]).backward()
    _micro_steps(ddp, x, y)


@pytest.mark.skipif(SIZE == 1, reason="needs ranks that can disagree")
def test_one_micro_batch_too_many_that_deals_another_total_raises_on_every_rank():
    x, y = next(iter(_loader(MPI.COMM_WORLD, torch.float64)))
    dealt = [MICRO_BATCHES // SIZE + (r < MICRO_BATCHES % SIZE) for r in range(SIZE)]
    for kind in ("plain", "zero2"):  # given: refused at the first step (stage 2 too)
        ddp = mpidp.DistributedDataParallel(_model(torch.float64), reproducible=True,
                                            micro_batches=MICRO_BATCHES)
        optimizer = _optimizer(ddp, MPI.COMM_WORLD, kind)
        with pytest.raises(ValueError, match=rf"micro_batch_counts\(M, {SIZE} ranks\) = "
                                             rf"{re.escape(str(dealt))}, M = micro_batches="
                                             rf"{MICRO_BATCHES};.*rank 0: ran {dealt[0] + 1} "):
            _step_with_one_more_on_rank_0(ddp, x, y)
        optimizer.zero_grad()
        _micro_steps(ddp, x, y)  # the next step starts afresh on every rank
        optimizer.step()
        ddp.close()
    # not given: the first synced step's total is M for the DDP's life, a heal's rebuild too
    ddp = mpidp.DistributedDataParallel(_model(torch.float64), reproducible=True)
    _micro_steps(ddp, x, y)
    for rebuilt in (False, True):
        if rebuilt:
            ddp._rebuild(MPI.COMM_WORLD)  # as mpidp.healing rebuilds it over the survivors
        assert ddp.reducer.micro_batches == MICRO_BATCHES
        with pytest.raises(ValueError, match=rf"M = {MICRO_BATCHES}, the total the first "
                                             rf"synced step fixed.*DistributedDataParallel\("
                                             rf"micro_batches=\).*rank 0: ran {dealt[0] + 1} "):
            _step_with_one_more_on_rank_0(ddp, x, y)
        _micro_steps(ddp, x, y)
    ddp.close()


@pytest.mark.parametrize("micro_batches", [12, 2 * SIZE + 1])
def test_the_sampler_deals_whole_micro_batches_in_order(micro_batches):
    dataset = list(range(50))
    samplers = [mpidp.DistributedSampler(dataset, SIZE, rank, shuffle=False,
                                         micro_batches=micro_batches, micro_batch_size=2)
                for rank in range(SIZE)]
    shares = [list(sampler) for sampler in samplers]
    # whole global batches of 2 * micro_batches; the tail is left out at any size, and
    # rank order then batch order is micro-batch order
    sizes = [2 * (micro_batches // SIZE + (rank < micro_batches % SIZE)) for rank in range(SIZE)]
    assert [sampler.batch_size for sampler in samplers] == sizes
    steps = 50 // (2 * micro_batches)
    assert [i for step in range(steps) for share, size in zip(shares, sizes)
            for i in share[step * size:(step + 1) * size]] == list(range(steps * 2 * micro_batches))
    with pytest.raises(ValueError, match=r"micro_batches must be at least the number of ranks "
                                         r".*got micro_batches=12 for num_replicas=13"):
        mpidp.DistributedSampler(dataset, 13, 0, micro_batches=12, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"micro_batch_size must be an int >= 1, got None"):
        mpidp.DistributedSampler(dataset, 1, 0, micro_batches=12)


def test_options_it_cannot_honour_raise_on_every_rank():
    with pytest.raises(ValueError, match=r"gradient_as_bucket_view must be False with "
                                         r"reproducible=True.*got True"):
        mpidp.DistributedDataParallel(_model(torch.float64), gradient_as_bucket_view=True,
                                      reproducible=True)
    with pytest.raises(TypeError, match=r"reproducible must be a bool, got 1"):
        mpidp.DistributedDataParallel(_model(torch.float64), reproducible=1)
    with pytest.raises(ValueError, match=r"micro_batches must be an int >= 1, got 0"):
        mpidp.DistributedDataParallel(_model(torch.float64), reproducible=True, micro_batches=0)
    with pytest.raises(ValueError, match=r"pass it with reproducible=True, got micro_batches=4 "
                                         r"and reproducible=False"):
        mpidp.DistributedDataParallel(_model(torch.float64), micro_batches=4)
    if SIZE > 1:
        with pytest.raises(ValueError, match=rf"micro_batches must be at least the number of "
                                             rf"ranks.*got micro_batches={SIZE - 1} for "
                                             rf"num_replicas={SIZE}"):
            mpidp.DistributedDataParallel(_model(torch.float64), reproducible=True,
                                          micro_batches=SIZE - 1)
    with mpidp.DistributedDataParallel(_model(torch.float64), reproducible=True) as ddp:
        with pytest.raises(RuntimeError, match=r"join\(\) is not supported with reproducible"):
            with ddp.join():
                pass
        with pytest.raises(RuntimeError, match=r"a comm hook cannot reduce the buckets of a "
                                             r"DistributedDataParallel\(reproducible=True\)"):
            ddp.register_comm_hook(None, mpidp.hooks.fp16_compress_hook)
