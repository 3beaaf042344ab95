"""mpidp.horovod on every rank: each function against numpy or one-process references.

Run under mpiexec at 2 and 3 ranks (tests/test_mpi.py). Every expected value is
computed from the rank and the size; every misuse must raise on every rank.
"""

import importlib.util
import math
import json
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpidp
import mpidp.horovod as hvd

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def horovod():
    hvd.init()
    yield
    hvd.shutdown()


def rank_values(shape=(3,), dtype=torch.float32):
    """Every rank's input (rank r holds r + 1 + arange), as a list indexed by rank."""
    numel = int(np.prod(shape))
    return [(torch.arange(numel, dtype=torch.float64) + r + 1).reshape(shape).to(dtype)
            for r in range(hvd.size())]


def test_process_facts():
    comm = MPI.COMM_WORLD
    assert (hvd.size(), hvd.rank()) == (comm.Get_size(), comm.Get_rank())
    assert (hvd.local_size(), hvd.local_rank()) == (mpidp.local_size(), mpidp.local_rank())
    assert hvd.cross_size() * hvd.local_size() == hvd.size()  # one node here
    assert hvd.cross_rank() == 0 and hvd.is_homogeneous() and hvd.is_initialized()
    assert hvd.mpi_enabled() and hvd.mpi_built() and not hvd.gloo_enabled()
    assert not hvd.gloo_built() and hvd.nccl_built() == 0 and not hvd.rocm_built()
    assert hvd.cuda_built() == torch.backends.cuda.is_built()
    assert hvd.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    assert hvd.global_process_set.size() == hvd.size()
    assert hvd.global_process_set.rank() == hvd.rank()


@pytest.mark.parametrize("op,reference", [
    (hvd.Average, lambda v: sum(v) / len(v)), (hvd.Sum, sum),
    (hvd.Min, lambda v: torch.stack(v).min(0).values),
    (hvd.Max, lambda v: torch.stack(v).max(0).values),
    (hvd.Product, lambda v: torch.stack(v).prod(0))])
def test_allreduce_ops_and_scales(op, reference):
    values = rank_values((2, 3))
    mine = values[hvd.rank()].clone()
    torch.testing.assert_close(hvd.allreduce(mine, op=op), reference(values))
    assert torch.equal(mine, values[hvd.rank()])  # out of place leaves it
    scaled = [v * 0.5 for v in values]
    torch.testing.assert_close(
        hvd.allreduce(mine, op=op, prescale_factor=0.5, postscale_factor=3.0),
        reference(scaled) * 3.0)
    torch.testing.assert_close(hvd.allreduce_(mine, op=op), reference(values))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_product_of_16_bit_floats_is_rounded_once(dtype):
    # factors whose partial products leave float16's range (65504) before a 0 or a small
    # factor brings them back: rounded once from float32, as torch's CUDA prod, not inf or nan
    # (at 2 ranks one multiply rounds once anyway: the case shows from 3 ranks)
    size = hvd.size()
    factors = torch.tensor([[300.0, 300.0, 3.0, 1.0 / 3.0]] * (size - 1) + [[0.0, 1e-3, 3.0, 3.0]])
    mine = factors[hvd.rank()].to(dtype)
    expected = factors.to(dtype).float().prod(0).to(dtype)
    got = hvd.allreduce(mine, op=hvd.Product)
    assert got.dtype == dtype and torch.equal(got, expected), (got, expected)
    grouped = hvd.grouped_allreduce([mine, mine.float()], op=hvd.Product)
    assert torch.equal(grouped[0], expected)


def test_allreduce_forms_average_and_handles():
    values = rank_values((4,))
    mine = values[hvd.rank()].clone()
    assert torch.equal(hvd.allreduce(mine, average=False), sum(values))
    handle = hvd.allreduce_async(mine, name="out")
    handle_ = hvd.allreduce_async_(mine, op=hvd.Sum)
    while not (hvd.poll(handle) and hvd.poll(handle_)):
        pass
    torch.testing.assert_close(hvd.synchronize(handle), sum(values) / hvd.size())
    assert hvd.synchronize(handle_) is mine and torch.equal(mine, sum(values))
    integers = torch.tensor([hvd.rank(), 7])
    assert hvd.allreduce(integers, op=hvd.Sum).tolist() == [sum(range(hvd.size())), 7 * hvd.size()]


def test_a_handle_synchronized_from_two_threads_completes_once():
    """docs/concurrency.md, rule 9: two threads synchronize one handle (or one polls it) at
    once. The average is divided once (a second finish would divide it again); a thread that
    comes after the other forgot the handle gets Horovod's clear error."""
    if mpidp.runtime.thread_level() < MPI.THREAD_MULTIPLE:
        pytest.skip("two threads in MPI need MPI_THREAD_MULTIPLE")
    values = rank_values((4,))
    for k in range(20):
        mine = values[hvd.rank()].clone()
        handle = hvd.allreduce_async_(mine, op=hvd.Average, name=f"twice.{k}")
        gate, outcomes = threading.Barrier(2, timeout=60), []

        def synchronize(poll_first: bool):
            gate.wait()
            try:
                while poll_first and not hvd.poll(handle):
                    pass
                outcomes.append(hvd.synchronize(handle))
            except ValueError as error:
                outcomes.append(str(error))

        threads = [threading.Thread(target=synchronize, args=(k % 2 and n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        torch.testing.assert_close(mine, sum(values) / hvd.size())
        assert any(outcome is mine for outcome in outcomes), outcomes
        assert all(outcome is mine or "is not a pending operation" in outcome
                   for outcome in outcomes), outcomes


def test_allreduce_is_differentiable():
    x = torch.full((3,), float(hvd.rank() + 1), requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * torch.arange(3.0)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(3.0) * hvd.size())


@pytest.mark.parametrize("compression,dtype", [(hvd.Compression.fp16, torch.float16),
                                               (hvd.Compression.bf16, torch.bfloat16)])
def test_compression(compression, dtype):
    values = rank_values((16,))
    result = hvd.allreduce(values[hvd.rank()], compression=compression, op=hvd.Sum)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, sum(v.to(dtype).float() for v in values),
                               atol=0.2, rtol=0.02)
    assert compression.compress(torch.ones(2, dtype=torch.int64))[0].dtype == torch.int64


def test_grouped_allreduce_mixed_dtypes_in_every_form():
    a, b, c = rank_values((2, 2)), rank_values((3,), torch.float64), rank_values((1,))
    mine = [a[hvd.rank()].clone(), b[hvd.rank()].clone(), c[hvd.rank()].clone()]
    out = hvd.grouped_allreduce(mine, op=hvd.Sum)
    for got, values in zip(out, (a, b, c)):
        assert got.dtype == values[0].dtype
        torch.testing.assert_close(got, sum(values))
    handle = hvd.grouped_allreduce_async(mine)
    for got, values in zip(hvd.synchronize(handle), (a, b, c)):
        torch.testing.assert_close(got, sum(values) / hvd.size())
    returned = hvd.grouped_allreduce_(mine, op=hvd.Max)
    assert all(x is y for x, y in zip(returned, mine))
    torch.testing.assert_close(mine[1], b[-1])
    hvd.synchronize(hvd.grouped_allreduce_async_(mine, op=hvd.Sum))
    torch.testing.assert_close(mine[2], c[-1] * hvd.size())


def test_allgather_with_uneven_first_dimensions():
    rank, size = hvd.rank(), hvd.size()
    mine = torch.full((rank + 1, 2), float(rank))
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)])
    assert torch.equal(hvd.allgather(mine), expected)
    assert torch.equal(hvd.synchronize(hvd.allgather_async(mine)), expected)
    first, second = hvd.grouped_allgather([mine, torch.arange(rank + 2)])
    assert torch.equal(first, expected)
    assert torch.equal(second, torch.cat([torch.arange(r + 2) for r in range(size)]))
    x = mine.clone().requires_grad_()
    hvd.allgather(x).sum().backward()  # every rank's loss reads every row
    # Horovod 0.28's gradient: the average over the ranks of the gradient at one's rows
    torch.testing.assert_close(x.grad, torch.ones_like(mine))
    y = torch.arange(rank + 2.0).requires_grad_()
    gathered = hvd.grouped_allgather([x, y])  # differentiable too, each output on its own
    (gathered[0].sum() + 2 * gathered[1].sum()).backward()
    torch.testing.assert_close(y.grad, torch.full_like(y, 2.0))


def test_broadcast_forms():
    values = rank_values((2, 2))
    root = hvd.size() - 1
    mine = values[hvd.rank()].clone()
    assert torch.equal(hvd.broadcast(mine, root_rank=root), values[root])
    assert torch.equal(mine, values[hvd.rank()])
    assert torch.equal(hvd.synchronize(hvd.broadcast_async(mine, root)), values[root])
    assert hvd.broadcast_(mine, root) is mine and torch.equal(mine, values[root])
    other = values[hvd.rank()].clone()
    assert torch.equal(hvd.synchronize(hvd.broadcast_async_(other, 0)), values[0])
    x = values[hvd.rank()].clone().requires_grad_()
    hvd.broadcast(x, root).sum().backward()
    expected = 1.0 if hvd.rank() == root else 0.0  # Horovod 0.28: the average, on the root
    torch.testing.assert_close(x.grad, torch.full_like(x, expected))


def test_alltoall_with_splits_returns_received_splits():
    rank, size = hvd.rank(), hvd.size()
    # rank r sends (r + j) % 3 + 1 rows to rank j; each row holds (sender, receiver)
    splits = [(rank + j) % 3 + 1 for j in range(size)]
    rows = torch.tensor([[rank, j] for j in range(size) for _ in range(splits[j])],
                        dtype=torch.float32)
    output, received = hvd.alltoall(rows, splits=splits)
    assert received.dtype == torch.int32
    assert received.tolist() == [(r + rank) % 3 + 1 for r in range(size)]
    expected = [[r, rank] for r in range(size) for _ in range((r + rank) % 3 + 1)]
    assert output.tolist() == expected
    again, received_again = hvd.synchronize(hvd.alltoall_async(rows, torch.tensor(splits)))
    assert torch.equal(again, output) and torch.equal(received_again, received)
    even = hvd.alltoall(torch.arange(2 * size, dtype=torch.float64) + 100 * rank)
    assert even.tolist() == [100 * r + 2 * rank + k for r in range(size) for k in range(2)]
    x = rows.clone().requires_grad_()
    out, _ = hvd.alltoall(x, splits=splits)
    (out * torch.arange(1.0, 3.0)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(1.0, 3.0).expand_as(x))


def test_alltoall_exchanges_its_splits_once(monkeypatch):
    """hvd.alltoall exchanges the splits to size its output; the engine's own splits check
    (an alltoall and an allreduce more) ran after it too, and now only under MPIDP_DEBUG."""
    uneven = mpidp.comm.uneven
    checks, check = [], uneven._check_splits_agree
    monkeypatch.setattr(uneven, "_check_splits_agree", lambda *a: checks.append(a) or check(*a))
    splits = [hvd.rank() + 1] * hvd.size()
    output, received = hvd.alltoall(torch.ones(sum(splits), 2), splits=splits)
    assert received.tolist() == [r + 1 for r in range(hvd.size())] and output.shape[1] == 2
    assert len(checks) == (1 if mpidp.comm.checks._DEBUG else 0)


def test_reducescatter_splits_rows_as_horovod():
    rank, size = hvd.rank(), hvd.size()
    rows = 2 * size + 1  # not divisible: the first rank gets one more row
    values = [torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) * (r + 1)
              for r in range(size)]
    counts = [rows // size + (r < rows % size) for r in range(size)]
    start = sum(counts[:rank])
    total = sum(values)
    got = hvd.reducescatter(values[rank], op=hvd.Sum)
    torch.testing.assert_close(got, total[start:start + counts[rank]])
    even = [v[:2 * size] for v in values]
    got = hvd.synchronize(hvd.reducescatter_async(even[rank]))
    torch.testing.assert_close(got, (sum(even) / size)[2 * rank:2 * rank + 2])


def test_barrier_and_objects():
    hvd.barrier()
    assert hvd.broadcast_object({"from": hvd.rank()}, root_rank=1) == {"from": 1}
    assert hvd.allgather_object(("r", hvd.rank())) == [("r", r) for r in range(hvd.size())]


class Model(torch.nn.Module):
    """Two branches whose forward order depends on the rank, and one used only on rank 0."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        self.only_rank0 = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x, rank=None):
        rank = hvd.rank() if rank is None else rank
        y = self.b(x) + self.a(x) if rank % 2 else self.a(x) + self.b(x)
        if rank == 0:
            y = y + self.only_rank0(x)
        return self.head(torch.tanh(y))


def batches(steps, passes, rank, rows=4):
    generator = torch.Generator().manual_seed(100 + rank)
    return [[(torch.randn(rows, 4, generator=generator), torch.randn(rows, 1, generator=generator))
             for _ in range(passes)] for _ in range(steps)]


def reference_training(model, steps, passes, lr, active=None):
    """One process: per step, the sum over passes of each rank's gradient, averaged over ranks."""
    size = hvd.size()
    data = [batches(steps, passes, r) for r in range(size)]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(size):
            if active is not None and step >= active[r]:
                continue
            for x, y in data[r][step]:
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x, rank=r), y).backward()
                for t, p in zip(total, model.parameters()):
                    if p.grad is not None:
                        t += p.grad
        for t, p in zip(total, model.parameters()):
            p.grad = t / size
        optimizer.step()
    return model


def distributed_training(model, steps, passes, lr, *, stop_after=None, **options):
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=passes, **options)
    for step, batch in enumerate(batches(steps, passes, hvd.rank())):
        if stop_after is not None and step >= stop_after:
            break
        optimizer.zero_grad()
        for x, y in batch:
            torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return optimizer


def fresh_model():
    torch.manual_seed(7)
    return Model()


def assert_same_parameters(model, reference, **tolerance):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=name, **tolerance)


@pytest.mark.parametrize("passes,options", [
    (1, {}), (2, {}), (3, {"groups": 2}), (1, {"gradient_predivide_factor": 2.0}),
    (1, {"fusion": "0"}), (2, {"fusion": "64"})],
    ids=["plain", "two-passes", "three-passes-two-groups", "predivide", "no-fusion", "64-bytes"])
def test_distributed_optimizer_equals_one_process(passes, options, monkeypatch):
    fusion = options.pop("fusion", None)
    if fusion is not None:
        monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", fusion)
    model = fresh_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    distributed_training(model, 4, passes, 0.1, **options)
    assert_same_parameters(model, reference_training(fresh_model(), 4, passes, 0.1))


def test_distributed_optimizer_with_fp16_compression_stays_close():
    model = fresh_model()
    distributed_training(model, 3, 1, 0.1, compression=hvd.Compression.fp16)
    assert_same_parameters(model, reference_training(fresh_model(), 3, 1, 0.1),
                           atol=2e-3, rtol=2e-3)


def test_synchronize_then_skip_synchronize_and_sum():
    model = fresh_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         op=hvd.Sum)
    x, y = batches(1, 1, hvd.rank())[0][0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    with optimizer.skip_synchronize():
        optimizer.step()
    reference = fresh_model()
    reference_training(reference, 1, 1, 0.0)  # lr 0: gradients only
    for grad, p in zip(grads, reference.parameters()):
        torch.testing.assert_close(grad, p.grad * hvd.size())
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.param_groups[0]["lr"] == 0.1
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.05


def test_join_with_uneven_inputs_trains_as_zeros_from_joined_ranks():
    size = hvd.size()
    active = [4 - r for r in range(size)]  # rank r runs 4 - r steps, then joins
    model = fresh_model()
    distributed_training(model, 4, 1, 0.1, stop_after=active[hvd.rank()])
    assert hvd.join() == 0  # rank 0 has the most steps, so it joins last
    if hvd.rank() == 0:
        assert_same_parameters(model, reference_training(fresh_model(), 4, 1, 0.1, active))


def test_joined_ranks_serve_reductions_and_refuse_what_horovod_refuses():
    later = [r for r in range(hvd.size()) if r != 1]  # join() returns one of them
    if hvd.rank() == 1:  # joined: serves the others, waits on through their errors
        assert hvd.join() in later
        assert hvd.join() in later
        return
    values = rank_values((2,))
    expected = sum(v for r, v in enumerate(values) if r != 1)
    torch.testing.assert_close(hvd.allreduce(values[hvd.rank()], op=hvd.Sum), expected)
    torch.testing.assert_close(hvd.allreduce(values[hvd.rank()], op=hvd.Max), values[-1]
                               if hvd.size() > 2 else values[0])
    rows = torch.stack(rank_values((2,)))  # one row per rank: this rank keeps its row of the sum
    torch.testing.assert_close(hvd.reducescatter(rows[hvd.rank()].expand(hvd.size(), 2).clone(),
                                                 op=hvd.Sum)[0], expected)
    # as Horovod's controller: allgather and broadcast are "not supported with Join"
    with pytest.raises(hvd.HorovodInternalError, match=r"allgather while rank\(s\) \[1\]"):
        hvd.allgather(torch.full((1,), float(hvd.rank())))
    with pytest.raises(hvd.HorovodInternalError, match=r"broadcast while rank\(s\) \[1\]"):
        hvd.broadcast(torch.ones(2), 0)
    hvd.barrier()
    assert hvd.join() in later
    # a second round: rank 1 is joined again; a bad op on rank 0 only fails on the active
    # ranks (rank 0 with its own error's type), then alltoall is refused
    bad_op = "rank 0: error: op must be hvd.Average, .* got 17"
    with pytest.raises(ValueError if hvd.rank() == 0 else hvd.HorovodInternalError, match=bad_op):
        hvd.allreduce(torch.ones(1), op=17 if hvd.rank() == 0 else hvd.Sum)
    with pytest.raises(hvd.HorovodInternalError, match="alltoall while rank.*join"):
        hvd.alltoall(torch.zeros(hvd.size()))
    # Adasum is not served by joined ranks (at 3 ranks it is refused for the set's size first)
    if hvd.size() == 2:
        with pytest.raises(hvd.HorovodInternalError, match=r"op=hvd.Adasum while rank\(s\) \[1\]"):
            hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    hvd.join()


def _adasum_pair(a: torch.Tensor, b: torch.Tensor, counts) -> torch.Tensor:
    """Horovod's combination of two vectors, tensor by tensor, in float64 (the reference)."""
    parts, offset = [], 0
    for count in counts:
        x, y = a[offset:offset + count].double(), b[offset:offset + count].double()
        dot, xx, yy = float(x @ y), float(x @ x), float(y @ y)
        cx = 1 - dot / (2 * xx) if xx >= 1e-8 else 1.0
        cy = 1 - dot / (2 * yy) if yy >= 1e-8 else 1.0
        parts.append(cx * x + cy * y)
        offset += count
    return torch.cat(parts)


def adasum_reference(vectors, counts):
    """The binary tree in rank order: (0, 1), (2, 3), then their results, ..."""
    level = list(vectors)
    while len(level) > 1:
        level = [_adasum_pair(level[k], level[k + 1], counts) for k in range(0, len(level), 2)]
    return level[0]


def test_adasum_combines_as_horovod_or_refuses_a_set_not_a_power_of_2():
    size, rank = hvd.size(), hvd.rank()
    if size & (size - 1):
        with pytest.raises(ValueError, match=f"power of 2 ranks, as in Horovod, got {size}"):
            hvd.allreduce(torch.ones(3), op=hvd.Adasum)
        with pytest.raises(NotImplementedError):  # what Horovod raises
            hvd.allreduce(torch.ones(3), op=hvd.Adasum)
        with pytest.raises(ValueError, match=f"power of 2 ranks, as in Horovod, got {size}"):
            hvd.DistributedOptimizer(torch.optim.SGD(fresh_model().parameters(), lr=0.1),
                                     op=hvd.Adasum)
        return
    # parallel vectors give their mean, orthogonal ones their sum
    v = torch.arange(1.0, 6.0, dtype=torch.float64)
    if size == 2:
        torch.testing.assert_close(hvd.allreduce(v * (rank + 1), op=hvd.Adasum), 1.5 * v)
    torch.testing.assert_close(hvd.allreduce(v, op=hvd.Adasum), v)
    basis = torch.zeros(size, dtype=torch.float64)
    basis[rank] = 2.0
    torch.testing.assert_close(hvd.allreduce(basis, op=hvd.Adasum), torch.full((size,), 2.0,
                                                                                dtype=torch.float64))
    # random vectors: the reference tree; a group gives each tensor its own coefficients;
    # every rank has the same bits
    generator = torch.Generator().manual_seed(3)
    shapes = [(4, 3), (7,), (2, 2, 2)]
    inputs = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(size)]
    counts = [int(np.prod(shape)) for shape in shapes]
    expected = adasum_reference([torch.cat([t.reshape(-1) for t in mine]) for mine in inputs], counts)
    grouped = hvd.grouped_allreduce(inputs[rank], op=hvd.Adasum)
    alone = [hvd.allreduce(t, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25)
             for t in inputs[rank]]
    offset = 0
    for got, one, shape, count in zip(grouped, alone, shapes, counts):
        want = expected[offset:offset + count].reshape(shape).float()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(one, want / 2)  # the combination is linear in a common factor
        offset += count
    bits = torch.cat([g.reshape(-1) for g in grouped])
    assert all(torch.equal(bits, other) for other in hvd.allgather_object(bits))


def test_distributed_optimizer_with_adasum_combines_the_ranks_deltas():
    """Horovod's delta optimizer: each rank's SGD step on its own gradients; the deltas
    (here -lr * gradient) combined by Adasum, parameter by parameter."""
    size = hvd.size()
    if size & (size - 1):
        return  # refused (the test above)
    lr, data = 0.1, [batches(1, 1, r)[0][0] for r in range(size)]
    model = fresh_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                         named_parameters=model.named_parameters(), op=hvd.Adasum)
    x, y = data[hvd.rank()]
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    reference = fresh_model()
    deltas = {name: [] for name, _ in reference.named_parameters()}
    for r in range(size):
        reference.zero_grad()
        torch.nn.functional.mse_loss(reference(data[r][0], rank=r), data[r][1]).backward()
        for name, p in reference.named_parameters():
            deltas[name].append(-lr * p.grad if p.grad is not None else torch.zeros_like(p))
    for name, p in reference.named_parameters():
        want = p.detach() + adasum_reference([d.reshape(-1) for d in deltas[name]],
                                             [p.numel()]).reshape(p.shape).float()
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), want, msg=name)


def test_process_sets():
    rank = hvd.rank()
    members = [1, 2] if hvd.size() > 2 else [1]  # [0, 1] at 2 ranks is the global set
    subset = hvd.add_process_set(hvd.ProcessSet(members))
    assert subset.ranks == members and subset.size() == len(members)
    assert subset.included() == (rank in members)
    if rank in members:
        assert subset.rank() == members.index(rank)
        got = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum, process_set=subset)
        assert got.item() == sum(r + 1 for r in members)
        assert hvd.allgather(torch.tensor([rank]), process_set=subset).tolist() == members
        # a root_rank is a rank of hvd.init's communicator, as in Horovod
        assert hvd.broadcast_object(rank, members[-1], process_set=subset) == members[-1]
        assert hvd.broadcast(torch.tensor([rank]), members[-1], process_set=subset).item() \
            == members[-1]
        hvd.barrier(process_set=subset)
        model = fresh_model()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             op=hvd.Sum, process_set=subset)
        model.a(torch.ones(1, 4)).sum().backward()
        optimizer.synchronize()
        assert model.a.bias.grad.tolist() == [float(len(members))] * 3
        if len(members) > 1:  # the set's calls are compared too
            with pytest.raises(hvd.HorovodInternalError,
                               match=r"rank 0: allgather int64 .*; rank 1: allgather float32"):
                hvd.allgather(torch.tensor([1.0 * rank] if rank == 2 else [rank]),
                              process_set=subset)
    else:
        with pytest.raises(ValueError, match=f"rank {rank} is not in ProcessSet"):
            hvd.allreduce(torch.ones(1), process_set=subset)
    with pytest.raises(ValueError, match="registered already"):
        hvd.add_process_set(list(reversed(members)))
    assert hvd.remove_process_set(subset) and not hvd.remove_process_set(subset)
    assert not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=subset)


def test_broadcast_optimizer_state_and_syncbn():
    model = fresh_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1))
    if hvd.rank() == 0:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    wrapped = hvd.DistributedOptimizer(optimizer)
    hvd.broadcast_optimizer_state(wrapped, root_rank=0)
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert len(optimizer.state) == len(list(model.parameters()))
    assert hvd.SyncBatchNorm is mpidp.SyncBatchNorm
    norm = hvd.SyncBatchNorm(2)
    out = norm(torch.full((3, 2), float(hvd.rank())))
    mean = sum(range(hvd.size())) / hvd.size()
    torch.testing.assert_close(norm.running_mean, torch.full((2,), 0.1 * mean))
    assert out.shape == (3, 2)


def test_timeline_written_by_rank_0(tmp_path):
    path = hvd.broadcast_object(str(tmp_path / "timeline.json"), 0)
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(4), name="ones")
    hvd.allgather(torch.ones(1, 2))
    hvd.stop_timeline()
    if hvd.rank() == 0:
        events = json.loads(Path(path).read_text())
        assert [e["name"] for e in events] == ["allreduce", "allgather"]
        assert events[0]["args"] == {"tensor": "ones", "bytes": 16} and events[0]["dur"] >= 0


def test_environment_variables(monkeypatch):
    hvd.shutdown()
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "123")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    try:
        with pytest.warns(UserWarning, match="ignores HOROVOD_CYCLE_TIME"):
            hvd.init()
        assert mpidp.watchdog.get_timeout() == (123.0, "report")
        hvd.shutdown()
        monkeypatch.setenv("HOROVOD_ELASTIC", "1")
        with pytest.raises(ValueError, match="HOROVOD_ELASTIC .* no elastic training"):
            hvd.init()
        assert not hvd.is_initialized()
    finally:
        mpidp.watchdog.set_timeout(None, action="abort")
        for name in ("HOROVOD_ELASTIC", "HOROVOD_CYCLE_TIME", "HOROVOD_STALL_CHECK_TIME_SECONDS"):
            monkeypatch.delenv(name, raising=False)
        with warnings.catch_warnings():
            hvd.init()


def test_misuse_raises_a_clear_error_on_every_rank():
    t = torch.ones(2)
    with pytest.raises(ValueError, match="op and average were both given"):
        hvd.allreduce(t, average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="op=hvd.Adasum needs floating-point tensors .* got torch.int64"):
        hvd.allreduce(torch.ones(2, dtype=torch.int64), op=hvd.Adasum)
    with pytest.raises(ValueError, match="op must be hvd.Average, .* got 17"):
        hvd.allreduce(t, op=17)
    # Average on integers, as Horovod: the exact quotient, rounded toward zero
    mine = torch.full((2,), -(hvd.rank() + 1))
    assert hvd.allreduce(mine).tolist() == [math.trunc(-(hvd.size() + 1) / 2)] * 2
    with pytest.raises(ValueError, match=r"invalid root_rank 9, .* \[0, "):
        hvd.broadcast(t, 9)
    with pytest.raises(ValueError, match=r"splits must hold .* adding up to the first dimension"):
        hvd.alltoall(torch.ones(3), splits=[5] * hvd.size())
    rows = r"every rank of the process set must make the same call .* rank 0: {} float32 rows " \
           r"of shape \(1,\); rank 1: {} float32 rows of shape \(2,\)"
    # calls that differ raise Horovod's HorovodInternalError (a RuntimeError) on every rank
    with pytest.raises(hvd.HorovodInternalError, match=rows.format("alltoall", "alltoall")):
        hvd.alltoall(torch.ones(hvd.size(), 1 + hvd.rank()), splits=[1] * hvd.size())
    with pytest.raises(RuntimeError, match=rows.format("allgather", "allgather")):
        hvd.allgather(torch.ones(1, 1 + hvd.rank()))
    # a call that differs, or a bad argument, on one rank only fails on every rank
    # (it gave silent garbage or a hang); the rank with the bad argument raises its type
    odd = hvd.rank() == 1
    differ = r"must make the same call .* got .*{}.*; rank 1: {}"
    internal = hvd.HorovodInternalError
    with pytest.raises(internal, match=differ.format(r"allreduce float32 shape \(2,\)",
                                                     "allreduce float64")):
        hvd.allreduce(torch.ones(2, dtype=torch.float64 if odd else torch.float32))
    with pytest.raises(internal, match=differ.format(r"shape \(2,\)", r".* shape \(3,\)")):
        hvd.allreduce_(torch.ones(3 if odd else 2), op=hvd.Sum)
    with pytest.raises(internal, match=differ.format("hvd.Average", "allreduce .* hvd.Sum")):
        hvd.allreduce(t, op=hvd.Sum if odd else hvd.Average)
    with pytest.raises(internal, match=differ.format("name 'a'", "allreduce .* name 'b'")):
        hvd.allreduce(t, name="b" if odd else "a")
    with pytest.raises(internal, match=differ.format(r"broadcast float32 shape \(2,\)",
                                                     r"broadcast float32 shape \(3,\)")):
        hvd.broadcast(torch.ones(3 if odd else 2), 0)
    bad_there = ValueError if odd else internal
    with pytest.raises(bad_there, match=differ.format("root_rank 0", "error: invalid root_rank 5")):
        hvd.broadcast_(t, 5 if odd else 0)
    with pytest.raises(bad_there, match=differ.format("broadcast_object", "error: invalid root")):
        hvd.broadcast_object("x", -1 if odd else 0)
    with pytest.raises(bad_there, match=differ.format("reducescatter", r"error: .* 0-d")):
        hvd.reducescatter(torch.ones(()) if odd else torch.ones(4))
    # a name still pending on this rank is refused here alone, before anything is sent
    handle = hvd.allreduce_async(t, name="twice")
    with pytest.raises(ValueError, match="name 'twice' is the name of an operation of this rank"):
        hvd.allreduce_async(t, name="twice")
    hvd.synchronize(handle)
    with pytest.raises(ValueError, match="handle 123456 is not a pending operation"):
        hvd.synchronize(123456)
    with pytest.raises(NotImplementedError, match="elastic training"):
        hvd.elastic.run
    model = fresh_model()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="must be unique. Found duplicates: a.weight"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=named + [named[0]])
    with pytest.raises(ValueError, match=r"optimizer's parameters number\(s\) \[0\]"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=named[1:])
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1, got 0"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor must be 1 unless"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="zero_grad.* before optimizer.step"):
        optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step \\(1\\)"):
        model(torch.ones(1, 4)).sum().backward()
    optimizer.synchronize()
    # sparse gradients: averaged as sparse tensors (an allgather of indices and values), or
    # as dense ones with sparse_as_dense=True; either way they stay sparse, as in Horovod
    expected = torch.zeros(5, 2)
    for r in range(hvd.size()):
        expected[r % 5] += 1 / hvd.size()
    # (here in one fused bucket with a head's dense gradients, averaged beside them)
    for as_dense in (False, True):
        embedding, head = torch.nn.Embedding(5, 2, sparse=True), torch.nn.Linear(2, 1)
        with torch.no_grad():
            embedding.weight.fill_(hvd.rank() + 1)
            head.weight.fill_(1.0)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD([*embedding.parameters(), *head.parameters()], lr=1.0),
            sparse_as_dense=as_dense)
        assert optimizer._buckets.members == [[2, 1, 0]]
        head(embedding(torch.tensor([hvd.rank() % 5]))).sum().backward()
        optimizer.synchronize()
        assert embedding.weight.grad.is_sparse
        torch.testing.assert_close(embedding.weight.grad.to_dense(), expected)
        torch.testing.assert_close(head.weight.grad, torch.full((1, 2), (hvd.size() + 1) / 2))
        torch.testing.assert_close(head.bias.grad, torch.ones(1))


def test_distributed_optimizer_refuses_layouts_that_differ_across_ranks():
    """A rank whose model differs raised nowhere (its shared buffers were quietly dropped):
    now every rank raises, naming the parameter, the rule and each rank's value."""
    odd = hvd.rank() == 1
    model = torch.nn.Sequential(torch.nn.Linear(4, 3 if odd else 2), torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"must bucket the same parameters alike .* parameter "
                                         r"\d+ in bucket order differs: ranks? 0(, 2)?: a\.bias: "
                                         r"torch.float32, 2 elements, bucket 0; rank 1: a\.bias: "
                                         r"torch.float32, 3 elements"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("a." + name.split(".")[1], p) for name, p
                                                   in model[:1].named_parameters()]
                                 + [("b." + name.split(".")[1], p) for name, p
                                    in model[1:].named_parameters()])
    # layouts that agree still build (the next test trains with them), and their fused CPU
    # buffers move into the node's shared window (mpidp DDP's BucketLayout.share)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(fresh_model().parameters(), lr=0.1))
    fused = [bucket for bucket in optimizer._buckets.buckets if not bucket.solo]
    assert fused and all(optimizer._strategy.window.holds(bucket.buffer) for bucket in fused)


def test_names_match_across_ranks():
    """Horovod's controller starts a named operation once every rank of its set submitted it."""
    rank, size = hvd.rank(), hvd.size()
    values = rank_values((17,))
    mine, total = values[rank], sum(values)
    # Horovod's own *_duplicate_name_error pattern: rank 0 submits first, the others after a
    # barrier; a second submission of a pending name is refused on its rank alone
    handles = []
    for turn in (rank == 0, rank > 0):
        if turn:
            handles.append(hvd.allreduce_async(mine, name="dup", op=hvd.Sum))
            with pytest.raises(ValueError, match="name 'dup' is the name of an operation"):
                hvd.allreduce_async(mine, name="dup", op=hvd.Sum)
        hvd.barrier()
    torch.testing.assert_close(hvd.synchronize(handles[0]), total)
    # the same with a group (one operation per tensor, under one name)
    for turn in (rank == 0, rank > 0):
        if turn:
            group = hvd.grouped_allgather_async([mine, 2 * mine], name="group")
            with pytest.raises(ValueError, match="name 'group' is the name of an operation"):
                hvd.grouped_allgather_async([mine], name="group")
        hvd.barrier()
    assert [g.tolist() for g in hvd.synchronize(group)] == \
        [torch.cat(values).tolist(), torch.cat(values).mul(2).tolist()]
    # a name pending twice on rank 0 and once elsewhere: the second is refused on rank 0
    # alone (nothing sent), the first meets the other ranks' one; nothing waits
    handle = hvd.allreduce_async(mine, name="once", op=hvd.Sum)
    if rank == 0:
        with pytest.raises(ValueError, match="name 'once' is the name of an operation"):
            hvd.allreduce_async(mine, name="once", op=hvd.Sum)
    torch.testing.assert_close(hvd.synchronize(handle), total)
    # a name is free again once synchronized, or after the set's next call once started
    for _ in range(2):
        torch.testing.assert_close(hvd.synchronize(
            hvd.allreduce_async(mine, name="again", op=hvd.Sum)), total)
    first = hvd.allgather_async(mine, name="again")
    hvd.barrier()
    second = hvd.allgather_async(mine, name="again")
    assert torch.equal(hvd.synchronize(first), hvd.synchronize(second))
    # the same names in another order on odd ranks: each meets its own name
    order = ["a", "b"] if rank % 2 == 0 else ["b", "a"]
    got = {name: hvd.allreduce_async(mine * (1 + (name == "b")), name=name, op=hvd.Sum)
           for name in order}
    torch.testing.assert_close(hvd.synchronize(got["a"]), total)
    torch.testing.assert_close(hvd.synchronize(got["b"]), 2 * total)
    # one name under two process sets at once: allowed, as Horovod's queues are per set
    members = [0, 1] if size > 2 else [0]  # [0, 1] at 2 ranks is the global set
    subset = hvd.add_process_set(hvd.ProcessSet(members))
    try:
        here = hvd.allreduce_async(mine, name="both", op=hvd.Sum)
        if rank in members:
            torch.testing.assert_close(hvd.allreduce(mine, name="both", op=hvd.Sum,
                                                     process_set=subset),
                                       sum(values[r] for r in members))
        torch.testing.assert_close(hvd.synchronize(here), total)
    finally:
        hvd.remove_process_set(subset)
    # operations of one name that differ fail at synchronize, on every rank
    if rank == 0:
        handle = hvd.allreduce_async(torch.ones(2), name="m")
    hvd.barrier()
    if rank > 0:
        handle = hvd.allreduce_async(torch.ones(3), name="m")
    with pytest.raises(hvd.HorovodInternalError, match=r"operations named 'm' differ .* "
                       r"rank 0: allreduce float32 shape \(2,\).*; ranks? 1.*shape \(3,\)"):
        hvd.synchronize(handle)
    # a rank waiting for a name no other rank submitted, against a call that cannot go on:
    # an error on every rank, not a hang (Horovod stalls there)
    with pytest.raises(hvd.HorovodInternalError, match=r"rank 0: allreduce .* name 'lone' "
                       r"\(synchronize; not submitted on every rank\); ranks? 1.*: barrier"):
        if rank == 0:
            hvd.allreduce(mine, name="lone")
        else:
            hvd.barrier()
    hvd.barrier()  # the set goes on
    # hvd.shutdown() drops what still waits for the other ranks (Horovod fails its queue)
    if rank == 0:
        dropped = hvd.allreduce_async(mine, name="dropped")
    hvd.barrier()
    hvd.shutdown()
    hvd.init()
    if rank == 0:
        with pytest.raises(ValueError, match="is not a pending operation"):
            hvd.synchronize(dropped)
    torch.testing.assert_close(hvd.allreduce(mine, name="dropped", op=hvd.Sum), total)


def test_not_initialized_error():
    hvd.shutdown()
    try:
        with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)"):
            hvd.rank()
        with pytest.raises(ValueError, match="not been initialized"):
            hvd.allreduce(torch.ones(1))
    finally:
        hvd.init()


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("passes", [1, 2])
def test_training_example_trains_like_one_process(passes):
    """n ranks at batch B and lr n x 0.1 (the example scales it by hvd.size()) against one
    process at n B, summing ``passes`` batches' gradients before each allreduce."""
    example = load_example("horovod_train")
    size = hvd.size()
    common = ["--epochs", "3", "--backward-passes-per-step", str(passes)]
    loss, accuracy = example.main(common + ["--batch-size", "32", "--lr", "0.1"])
    hvd.shutdown()
    hvd.init(comm=MPI.COMM_SELF)
    try:
        alone = example.main(common + ["--batch-size", str(32 * size), "--lr", str(0.1 * size)])
    finally:
        hvd.shutdown()
        hvd.init()
    print(f"\ntraining example, {passes} backward passes per step, at {size} ranks: validation "
          f"loss {loss:.6f}, accuracy {accuracy:.4f}; one process: loss {alone[0]:.6f}, "
          f"accuracy {alone[1]:.4f}")
    assert accuracy > 0.9
    assert loss == pytest.approx(alone[0], rel=1e-4) and accuracy == pytest.approx(alone[1])


def test_training_example_resumes_from_rank_0s_checkpoint(tmp_path):
    """One epoch saved by rank 0, then a second resumed from it (rank 0 reads, every rank
    gets it by broadcast): the same result as two epochs straight."""
    example = load_example("horovod_train")
    checkpoint = str(tmp_path / "digits.pt")  # rank 0's path is the one used
    example.main(["--epochs", "1", "--checkpoint", checkpoint])
    assert Path(checkpoint).exists() == (hvd.rank() == 0)
    resumed = example.main(["--epochs", "2", "--checkpoint", checkpoint, "--resume"])
    assert resumed == example.main(["--epochs", "2"])


def test_a_control_message_is_in_the_flight_record_and_ended():
    """Horovod's negotiation starts its control allreduce through the engine, recorded."""
    before = {entry["ticket"] for entry in mpidp.recorder.entries()}
    hvd.allreduce(torch.ones(3), name="recorded control")
    controls = [entry for entry in mpidp.recorder.entries()
                if entry["ticket"] not in before and entry["op"] == "hvd control"]
    if hvd.size() == 1:
        return
    assert controls and all(entry["end"] for entry in controls), controls
