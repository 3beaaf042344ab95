"""The "mpidp" torch.distributed backend (mpidp.process_group) as torch's default, on every rank.

Every collective goes through the public ``torch.distributed`` API, in three
forms: blocking, ``async_op=True`` finished by ``work.wait()``, and
``async_op=True`` finished only through ``work.get_future()`` (never calling
``wait()``), after which ``is_completed()`` must turn true on its own. Expected
values come from rank and size. Misuse raises the same clear error on every
rank, and each error test ends with a correct collective that would hang if the
ranks had fallen out of step.
"""

import datetime
import os
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed import ReduceOp

import mpidp
from mpidp import comm
from _expected import BITWISE, as_tensor, check_reduced, contribution, ops_for, reduced  # noqa: F401

RANK, SIZE = mpidp.rank(), mpidp.size()
ROOTS = sorted({0, SIZE - 1, SIZE // 2})
MODES = ("blocking", "wait", "future")
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.int32, torch.int64, torch.uint8, torch.bool]
# data movement carries any dtype: mpidp.comm's, complex, and ones mpidp.comm lacks
MOVED = [torch.float32, torch.bfloat16, torch.bool, torch.int16, torch.int8, torch.complex64]
OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "prod": ReduceOp.PRODUCT,
       "min": ReduceOp.MIN, "max": ReduceOp.MAX, "band": ReduceOp.BAND, "bor": ReduceOp.BOR,
       "bxor": ReduceOp.BXOR}

needs_two = pytest.mark.skipif(SIZE < 2, reason="needs two ranks")

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),  # all_gather_into_tensor & co.
              pytest.mark.filterwarnings("ignore:Running .* does not belong to the given group")]


@pytest.fixture(scope="module", autouse=True)
def default_group():
    # no MASTER_ADDR of the user's: the one there, if any, is mpidp's own (mpidp.rendezvous)
    assert os.environ.get("MASTER_ADDR") == mpidp.rendezvous.exported().get("MASTER_ADDR")
    assert not dist.is_initialized()
    mpidp.init_process_group()
    yield
    dist.destroy_process_group()
    assert not dist.is_initialized()


# -- helpers ---------------------------------------------------------------------------------













def payload(rank: int, shape, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s data to move: differs by rank, index and salt, exact in every dtype."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    values = (np.arange(int(np.prod(shape))) * 3 + rank * 11 + salt * 5) % 97
    if dtype == torch.bool:
        tensor = torch.from_numpy(values % 2 == 1)
    elif dtype.is_complex:
        real = torch.from_numpy(values).double()
        tensor = torch.complex(real, -real - 0.5).to(dtype)
    else:
        tensor = torch.from_numpy(values).to(dtype)
    return tensor.reshape(shape)


def run(mode: str, call):
    """``call(async_op)`` in ``mode``; returns the Work of the async forms."""
    if mode == "blocking":
        assert call(False) is None
        return None
    work = call(True)
    assert isinstance(work, dist.Work), work
    if mode == "wait":
        assert work.wait() is True
        assert work.is_completed() and work.is_success()
    else:
        work.get_future().wait()
        eventually_completed(work)
    return work


def eventually_completed(work) -> None:
    deadline = time.monotonic() + 60
    while not work.is_completed():
        assert time.monotonic() < deadline, "is_completed() stayed False after the future"
        time.sleep(1e-4)
    assert work.is_success() and work.exception() is None


def agree_on_every_rank(message: str) -> None:
    """Every rank saw the same message (and reached this point: nobody hung)."""
    messages = MPI.COMM_WORLD.allgather(message)
    assert messages == [messages[0]] * SIZE, messages


def still_in_step(group=None) -> None:
    """A correct all_reduce; ranks out of step would hang or disagree here."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(SIZE))
    tensor = torch.full((3,), float(RANK))
    dist.all_reduce(tensor, group=group)
    assert torch.equal(tensor, torch.full((3,), float(sum(ranks))))


def raises_everywhere(errors, call, same: bool = True) -> str:
    """``call()`` raises one of ``errors`` on every rank (``same``: the same message)."""
    with pytest.raises(errors) as info:
        call()
    message = f"{type(info.value).__name__}: {info.value}"
    agree_on_every_rank(message if same else "raised")
    return message


# -- the default group -----------------------------------------------------------------------

def test_mpidp_is_the_default_backend_with_mpis_ranks():
    assert dist.is_initialized()
    assert dist.get_backend() == "mpidp"
    assert (dist.get_rank(), dist.get_world_size()) == (RANK, SIZE)
    assert (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()) == (RANK, SIZE)
    assert os.environ.get("MASTER_ADDR") == mpidp.rendezvous.exported().get("MASTER_ADDR")
    assert "ProcessGroupMPIDP" in repr(dist.group.WORLD)


# -- all_reduce ------------------------------------------------------------------------------

def premul_sums():
    """PREMUL_SUM with a float factor and with a tensor factor: (op, factor)."""
    return [(dist._make_nccl_premul_sum(2.0), 2.0),
            (dist._make_nccl_premul_sum(torch.tensor([3.0])), 3.0)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_every_op_and_dtype(dtype):
    names = [name for name in OPS
             if (name != "avg" or dtype.is_floating_point)
             and (name not in BITWISE or not dtype.is_floating_point)]
    shapes = {"blocking": (7,), "wait": (1,), "future": (10, 100)}
    for name in names:
        for mode in MODES:
            count = int(np.prod(shapes[mode]))
            tensor = as_tensor(contribution(RANK, count, name, dtype), dtype)
            tensor = tensor.reshape(shapes[mode])
            work = run(mode, lambda a: dist.all_reduce(tensor, OPS[name], async_op=a))
            if mode == "future":
                value = work.get_future().value()
                assert len(value) == 1 and value[0].data_ptr() == tensor.data_ptr()
            check_reduced(tensor.reshape(-1), reduced(count, name, dtype), name)
    if dtype.is_floating_point:
        for op, factor in premul_sums():
            for mode in MODES:
                tensor = as_tensor(contribution(RANK, 7, "sum", dtype), dtype)
                run(mode, lambda a: dist.all_reduce(tensor, op, async_op=a))
                check_reduced(tensor, factor * reduced(7, "sum", dtype), "sum")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_ops_that_do_not_apply_raise_on_every_rank(dtype):
    names = [name for name in OPS
             if name == "avg" and not dtype.is_floating_point
             or name in BITWISE and dtype.is_floating_point]
    ops = [OPS[name] for name in names]
    if not dtype.is_floating_point:
        ops += [op for op, _ in premul_sums()]
    for op in ops:
        for async_op in (False, True):
            tensor = as_tensor(contribution(RANK, 7, "sum", dtype), dtype)
            before = tensor.clone()
            message = raises_everywhere((TypeError, ValueError), lambda: dist.all_reduce(
                tensor, op, async_op=async_op))
            assert str(dtype) in message, message
            assert torch.equal(tensor, before)  # nothing happened to it
    still_in_step()


def test_all_reduce_complex_and_non_contiguous():
    for mode in MODES:
        tensor = payload(RANK, (3, 4), torch.complex64)
        run(mode, lambda a: dist.all_reduce(tensor, async_op=a))
        assert torch.equal(tensor, sum(payload(r, (3, 4), torch.complex64) for r in range(SIZE)))
        for op in (ReduceOp.MAX, ReduceOp.PRODUCT):
            tensor = payload(RANK, 3, torch.complex64)
            with pytest.raises(ValueError, match="complex"):
                dist.all_reduce(tensor, op, async_op=mode != "blocking")
        for dtype in (torch.float32, torch.int64, torch.float16):
            base = payload(RANK, (4, 6), dtype)
            view = base.t()  # (6, 4), non-contiguous
            assert not view.is_contiguous()
            run(mode, lambda a: dist.all_reduce(view, async_op=a))
            expected = sum(payload(r, (4, 6), torch.float64) for r in range(SIZE)).to(dtype)
            assert torch.equal(base, expected)
            strided = payload(RANK, 20, dtype)[::3]  # every third element
            run(mode, lambda a: dist.all_reduce(strided, ReduceOp.MAX, async_op=a))
            assert torch.equal(strided, torch.stack([payload(r, 20, dtype)[::3]
                                                     for r in range(SIZE)]).amax(0))


def test_all_reduce_coalesced_and_the_coalescing_manager():
    def fresh():
        return [payload(RANK, 7, torch.float32), payload(RANK, (10, 100), torch.float32, 1),
                payload(RANK, 1, torch.float32, 2)]

    def expected():
        return [sum(payload(r, 7, torch.float32) for r in range(SIZE)),
                sum(payload(r, (10, 100), torch.float32, 1) for r in range(SIZE)),
                sum(payload(r, 1, torch.float32, 2) for r in range(SIZE))]

    tensors = fresh()
    dist.all_reduce_coalesced(tensors)
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected()))
    tensors = fresh()
    future = dist.all_reduce_coalesced(tensors, ReduceOp.MAX, async_op=True)
    assert isinstance(future, torch.futures.Future)  # torch returns the Work's future
    future.wait()
    for tensor, (shape, salt) in zip(tensors, [(7, 0), ((10, 100), 1), (1, 2)]):
        assert torch.equal(tensor, torch.stack([payload(r, shape, torch.float32, salt)
                                                for r in range(SIZE)]).amax(0))
    assert len(future.value()) == 3

    for async_ops in (False, True):
        tensors = fresh()
        with dist._coalescing_manager(async_ops=async_ops) as manager:
            for tensor in tensors:
                dist.all_reduce(tensor)
        if async_ops:
            manager.wait()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected()))
        # with device: torch calls the group's _start/_end_coalescing (a group without them
        # raised there and left torch recording, never running, every later collective)
        tensors = fresh()
        with dist._coalescing_manager(device=torch.device("cpu"), async_ops=async_ops) as manager:
            for tensor in tensors:
                dist.all_reduce(tensor)
        if async_ops:
            manager.wait()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected()))
        after = torch.ones(3)
        dist.all_reduce(after)
        assert torch.equal(after, torch.full((3,), float(SIZE)))

        inputs = [payload(RANK, 5, torch.float32), payload(RANK, 3, torch.float32, 1)]
        outputs = [torch.empty(SIZE * 5), torch.empty(SIZE * 3)]
        with dist._coalescing_manager(async_ops=async_ops) as manager:
            for out, inp in zip(outputs, inputs):
                dist.all_gather_into_tensor(out, inp)
        if async_ops:
            manager.wait()
        assert torch.equal(outputs[0], torch.cat([payload(r, 5, torch.float32)
                                                  for r in range(SIZE)]))
        assert torch.equal(outputs[1], torch.cat([payload(r, 3, torch.float32, 1)
                                                  for r in range(SIZE)]))

        inputs = [payload(RANK, SIZE * 4, torch.float32), payload(RANK, SIZE * 2, torch.float32, 1)]
        outputs = [torch.empty(4), torch.empty(2)]
        with dist._coalescing_manager(async_ops=async_ops) as manager:
            for out, inp in zip(outputs, inputs):
                dist.reduce_scatter_tensor(out, inp)
        if async_ops:
            manager.wait()
        for out, (n, salt) in zip(outputs, [(4, 0), (2, 1)]):
            total = sum(payload(r, SIZE * n, torch.float32, salt) for r in range(SIZE))
            assert torch.equal(out, total[RANK * n:(RANK + 1) * n])


# -- broadcast and the gathers ---------------------------------------------------------------

def test_broadcast_from_every_root():
    for dtype in MOVED:
        for root in ROOTS:
            for mode in MODES:
                tensor = payload(RANK, (2, 7), dtype, root)
                run(mode, lambda a: dist.broadcast(tensor, src=root, async_op=a))
                assert torch.equal(tensor, payload(root, (2, 7), dtype, root))
    for dtype in (torch.float32, torch.int64, torch.complex64):  # non-contiguous views
        for mode in MODES:
            base = payload(RANK, (5, 3), dtype)
            view = base.t()
            run(mode, lambda a: dist.broadcast(view, src=SIZE - 1, async_op=a))
            assert torch.equal(base, payload(SIZE - 1, (5, 3), dtype))
    for dtype in MOVED:  # 0-d tensors
        scalar = payload(RANK, (), dtype, 3)
        dist.broadcast(scalar, src=SIZE - 1)
        assert scalar.shape == () and torch.equal(scalar, payload(SIZE - 1, (), dtype, 3))
    big = payload(RANK, 1000, torch.float64)
    dist.broadcast(big, src=0)
    assert torch.equal(big, payload(0, 1000, torch.float64))


def test_broadcast_of_a_non_contiguous_tensor_of_a_dtype_mpidp_carries_as_bytes():
    base = payload(RANK, (4, 3), torch.uint16)  # no MPI datatype in mpidp.comm: moved as bytes
    raises_everywhere(TypeError, lambda: dist.broadcast(base.t(), src=0))
    still_in_step()


def test_all_gather_list():
    for dtype in MOVED:
        for mode in MODES:
            outputs = [torch.empty((2, 3), dtype=dtype) for _ in range(SIZE)]
            tensor = payload(RANK, (2, 3), dtype)
            run(mode, lambda a: dist.all_gather(outputs, tensor, async_op=a))
            for rank, out in enumerate(outputs):
                assert torch.equal(out, payload(rank, (2, 3), dtype)), (rank, dtype, mode)
    outputs = [torch.empty(1000) for _ in range(SIZE)]
    dist.all_gather(outputs, payload(RANK, 1000, torch.float32))
    assert all(torch.equal(out, payload(r, 1000, torch.float32)) for r, out in enumerate(outputs))


def test_all_gather_into_tensor_also_in_place():
    for dtype in MOVED:
        for mode in MODES:
            tensor = payload(RANK, 7, dtype)
            output = torch.empty(SIZE * 7, dtype=dtype)
            run(mode, lambda a: dist.all_gather_into_tensor(output, tensor, async_op=a))
            assert torch.equal(output, torch.cat([payload(r, 7, dtype) for r in range(SIZE)]))
            stacked = torch.empty((SIZE, 7), dtype=dtype)  # a 2-d output, as DTensor has
            run(mode, lambda a: dist.all_gather_into_tensor(stacked, tensor, async_op=a))
            assert torch.equal(stacked, output.reshape(SIZE, 7))
            # in place: the input is this rank's slice of the output (FSDP2's all-gather)
            output = torch.zeros(SIZE * 7, dtype=dtype)
            mine = output[RANK * 7:(RANK + 1) * 7]
            mine.copy_(payload(RANK, 7, dtype))
            run(mode, lambda a: dist.all_gather_into_tensor(output, mine, async_op=a))
            assert torch.equal(output, torch.cat([payload(r, 7, dtype) for r in range(SIZE)]))
    for mode in MODES:  # a non-contiguous output
        output = torch.empty(7, SIZE).t()
        run(mode, lambda a: dist.all_gather_into_tensor(output, payload(RANK, 7, torch.float32),
                                                        async_op=a))
        assert torch.equal(output, torch.stack([payload(r, 7, torch.float32)
                                                for r in range(SIZE)]))
    for mode in MODES:  # all_gather_single, the new name
        output = torch.empty(SIZE * 1000)
        run(mode, lambda a: dist.all_gather_single(output, payload(RANK, 1000, torch.float32),
                                                   async_op=a))
        assert torch.equal(output, torch.cat([payload(r, 1000, torch.float32)
                                              for r in range(SIZE)]))


# -- reduce_scatter --------------------------------------------------------------------------

def test_reduce_scatter_list_and_tensor():
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        names = ["sum", "max"] + (["avg"] if dtype.is_floating_point else ["bxor"])
        for name in names:
            for mode in MODES:
                count = 7
                everything = [contribution(r, SIZE * count, name, dtype) for r in range(SIZE)]
                mine = as_tensor(everything[RANK], dtype)
                total = reduced(SIZE * count, name, dtype)[RANK * count:(RANK + 1) * count]
                inputs = list(mine.clone().split(count))
                output = torch.empty(count, dtype=dtype)
                run(mode, lambda a: dist.reduce_scatter(output, inputs, OPS[name], async_op=a))
                check_reduced(output, total, name)
                output = torch.empty(count, dtype=dtype)
                source = mine.clone()
                run(mode, lambda a: dist.reduce_scatter_tensor(output, source, OPS[name],
                                                               async_op=a))
                check_reduced(output, total, name)
                assert torch.equal(source, mine)  # the input is left as it was
    for op, factor in premul_sums():
        for mode in MODES:
            mine = as_tensor(contribution(RANK, SIZE * 3, "sum", torch.float32), torch.float32)
            source = mine.clone()
            output = torch.empty(3)
            run(mode, lambda a: dist.reduce_scatter_tensor(output, source, op, async_op=a))
            total = factor * reduced(SIZE * 3, "sum", torch.float32)[RANK * 3:(RANK + 1) * 3]
            check_reduced(output, total, "sum")
            assert torch.equal(source, mine), "PREMUL_SUM changed reduce_scatter's input"
            inputs = list(mine.clone().split(3))
            output = torch.empty(3)
            run(mode, lambda a: dist.reduce_scatter(output, inputs, op, async_op=a))
            check_reduced(output, total, "sum")
            assert torch.equal(torch.cat(inputs), mine), "PREMUL_SUM changed the input list"


# -- all_to_all ------------------------------------------------------------------------------

def sent(sender: int, receiver: int) -> int:
    """Rows ``sender`` sends ``receiver`` in the uneven exchanges (zeros included)."""
    return (sender + 2 * receiver) % 3


def rows_of(rank: int, dtype, row_shape) -> torch.Tensor:
    rows = sum(sent(rank, peer) for peer in range(SIZE))
    return payload(rank, (rows, *row_shape), dtype)


def expected_rows(dtype, row_shape) -> torch.Tensor:
    pieces = []
    for peer in range(SIZE):
        start = sum(sent(peer, other) for other in range(RANK))
        pieces.append(rows_of(peer, dtype, row_shape)[start:start + sent(peer, RANK)])
    return torch.cat(pieces)


def test_all_to_all_single_even_and_uneven():
    for dtype in MOVED:
        for mode in MODES:
            tensor = payload(RANK, SIZE * 3, dtype)
            output = torch.empty(SIZE * 3, dtype=dtype)
            run(mode, lambda a: dist.all_to_all_single(output, tensor, async_op=a))
            assert torch.equal(output, torch.cat([payload(p, SIZE * 3, dtype)[RANK * 3:RANK * 3 + 3]
                                                  for p in range(SIZE)]))
            for row_shape in ((), (2, 3)):
                input_splits = [sent(RANK, peer) for peer in range(SIZE)]
                output_splits = [sent(peer, RANK) for peer in range(SIZE)]
                tensor = rows_of(RANK, dtype, row_shape)
                output = torch.empty((sum(output_splits), *row_shape), dtype=dtype)
                run(mode, lambda a: dist.all_to_all_single(output, tensor, output_splits,
                                                           input_splits, async_op=a))
                assert torch.equal(output, expected_rows(dtype, row_shape)), (dtype, row_shape)


def test_all_to_all_single_in_place():
    for mode in MODES:
        tensor = torch.arange(SIZE * 2.0) + 100 * RANK
        run(mode, lambda a: dist.all_to_all_single(tensor, tensor, async_op=a))
        assert torch.equal(tensor, torch.cat([torch.arange(2.0 * RANK, 2 * RANK + 2) + 100 * p
                                              for p in range(SIZE)]))


def test_tensors_that_require_grad_are_communicated_as_with_gloo():
    param = torch.nn.Parameter(torch.full((3,), float(RANK)))
    dist.broadcast(param, src=SIZE - 1)  # as a script syncing its parameters does
    assert param.requires_grad and torch.equal(param.detach(), torch.full((3,), SIZE - 1.0))
    loss = (param * 2).sum() + RANK  # not a leaf: logging code all-reduces losses
    dist.all_reduce(loss)
    assert loss.item() == SIZE * 6 * (SIZE - 1) + SIZE * (SIZE - 1) / 2
    output = torch.empty(SIZE * 3)
    dist.all_gather_into_tensor(output, param)
    assert torch.equal(output, torch.full((SIZE * 3,), SIZE - 1.0))
    outputs = [torch.empty(3) for _ in range(SIZE)]
    dist.all_gather(outputs, param)
    assert all(torch.equal(out, torch.full((3,), SIZE - 1.0)) for out in outputs)
    weight = torch.nn.Parameter(torch.arange(float(SIZE)) + RANK)
    output = torch.empty(1)
    dist.reduce_scatter_tensor(output, weight)
    assert output.item() == SIZE * RANK + SIZE * (SIZE - 1) / 2
    output = torch.empty(SIZE)
    dist.all_to_all_single(output, weight)
    assert torch.equal(output, torch.arange(float(SIZE)) + RANK)
    assert param.grad is None and weight.grad is None


def test_all_to_all_list_uneven_sizes():
    def piece(sender, receiver, dtype):
        return payload(sender, (sender + receiver + 1, 2), dtype, receiver)

    for dtype in MOVED:
        for mode in MODES:
            inputs = [piece(RANK, peer, dtype) for peer in range(SIZE)]
            outputs = [torch.empty((peer + RANK + 1, 2), dtype=dtype) for peer in range(SIZE)]
            run(mode, lambda a: dist.all_to_all(outputs, inputs, async_op=a))
            for peer, out in enumerate(outputs):
                assert torch.equal(out, piece(peer, RANK, dtype)), (peer, dtype, mode)


# -- reduce, gather, scatter, barrier --------------------------------------------------------

def test_reduce_to_every_root():
    for root in ROOTS:
        for dtype, name in ((torch.float32, "sum"), (torch.int32, "max"), (torch.float64, "avg"),
                            (torch.uint8, "bor"), (torch.bool, "sum")):
            for mode in MODES:
                tensor = as_tensor(contribution(RANK, 7, name, dtype), dtype)
                run(mode, lambda a: dist.reduce(tensor, dst=root, op=OPS[name], async_op=a))
                if RANK == root:
                    check_reduced(tensor, reduced(7, name, dtype), name)
        for op, factor in premul_sums():
            mine = as_tensor(contribution(RANK, 7, "sum", torch.float64), torch.float64)
            tensor = mine.clone()
            run("wait", lambda a: dist.reduce(tensor, dst=root, op=op, async_op=a))
            if RANK == root:
                check_reduced(tensor, factor * reduced(7, "sum", torch.float64), "sum")
            else:
                assert torch.equal(tensor, mine), "PREMUL_SUM changed a sender's tensor"


def test_gather_and_scatter_with_every_root():
    for dtype in MOVED:
        for root in ROOTS:
            for mode in MODES:
                outputs = [torch.empty((2, 3), dtype=dtype) for _ in range(SIZE)] \
                    if RANK == root else None
                tensor = payload(RANK, (2, 3), dtype, root)
                run(mode, lambda a: dist.gather(tensor, outputs, dst=root, async_op=a))
                if RANK == root:
                    for rank, out in enumerate(outputs):
                        assert torch.equal(out, payload(rank, (2, 3), dtype, root))
                blocks = [payload(root, 5, dtype, rank) for rank in range(SIZE)] \
                    if RANK == root else None
                output = torch.empty(5, dtype=dtype)
                run(mode, lambda a: dist.scatter(output, blocks, src=root, async_op=a))
                assert torch.equal(output, payload(root, 5, dtype, RANK))


def test_barrier():
    for mode in MODES:
        run(mode, lambda a: dist.barrier(async_op=a))
    # a barrier does hold ranks back: the last rank arrives late
    if RANK == SIZE - 1:
        time.sleep(0.2)
    start = time.monotonic()
    dist.barrier()
    if RANK != SIZE - 1 and SIZE > 1:
        assert time.monotonic() - start > 0.1


# -- point to point --------------------------------------------------------------------------

@needs_two
def test_send_and_recv_between_pairs():
    pairs = SIZE - SIZE % 2  # the last rank of an odd size sits it out
    for dtype in MOVED:
        if RANK < pairs:
            peer = RANK ^ 1
            if RANK % 2 == 0:
                dist.send(payload(RANK, 7, dtype), dst=peer, tag=3)
                received = torch.empty(7, dtype=dtype)
                assert dist.recv(received, src=peer, tag=4) == peer
                assert torch.equal(received, payload(peer, 7, dtype, 1))
            else:
                received = torch.empty(7, dtype=dtype)
                assert dist.recv(received, src=peer, tag=3) == peer
                assert torch.equal(received, payload(peer, 7, dtype))
                dist.send(payload(RANK, 7, dtype, 1), dst=peer, tag=4)
    still_in_step()


@needs_two
def test_isend_irecv_ring_with_wait_and_futures():
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    for dtype in (torch.float32, torch.int16, torch.complex64):
        for mode in ("wait", "future"):
            received = torch.empty(1000, dtype=dtype)
            works = [dist.irecv(received, src=left, tag=7),
                     dist.isend(payload(RANK, 1000, dtype), dst=right, tag=7)]
            for work in works:
                if mode == "wait":
                    assert work.wait() is True
                else:
                    work.get_future().wait()
                    eventually_completed(work)
            assert torch.equal(received, payload(left, 1000, dtype))
    still_in_step()


@needs_two
def test_batch_isend_irecv_ring_exchange():
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    for dtype in (torch.float32, torch.int8, torch.complex64):
        from_left = torch.empty(7, dtype=dtype)
        from_right = torch.empty(7, dtype=dtype)
        ops = [dist.P2POp(dist.irecv, from_left, left), dist.P2POp(dist.irecv, from_right, right),
               dist.P2POp(dist.isend, payload(RANK, 7, dtype), right),
               dist.P2POp(dist.isend, payload(RANK, 7, dtype, 1), left)]
        works = dist.batch_isend_irecv(ops)
        assert len(works) == 4
        for work in works:
            work.wait()
        assert torch.equal(from_left, payload(left, 7, dtype))
        # at 2 ranks left is right: its two messages match the two receives in order
        assert torch.equal(from_right, payload(right, 7, dtype, 1))
    still_in_step()


@needs_two
def test_recv_from_any_source_names_the_sender():
    if RANK == 0:
        senders = []
        for _ in range(SIZE - 1):
            received = torch.empty(3, dtype=torch.int64)
            sender = dist.recv(received, tag=11)
            assert torch.equal(received, torch.full((3,), 100 + sender))
            senders.append(sender)
        assert sorted(senders) == list(range(1, SIZE))
        received = torch.empty(2)
        work = dist.irecv(received, tag=5)  # any source
        work.wait()
        assert work._source_rank() == SIZE - 1
        assert torch.equal(received, torch.full((2,), -1.0))
    else:
        dist.send(torch.full((3,), 100 + RANK, dtype=torch.int64), dst=0, tag=11)
        if RANK == SIZE - 1:
            dist.send(torch.full((2,), -1.0), dst=0, tag=5)
    still_in_step()


@needs_two
def test_a_receive_of_the_wrong_size_fails_its_work_on_the_receiver():
    if RANK == 0:
        dist.send(torch.ones(5), dst=1, tag=13)
        dist.send(torch.ones(2), dst=1, tag=14)
    elif RANK == 1:
        with pytest.raises(ValueError, match="sizes must match"):
            dist.recv(torch.empty(3), src=0, tag=13)  # too small: MPI truncates
        work = dist.irecv(torch.empty(4), src=0, tag=14)  # too large
        with pytest.raises(ValueError, match="rank 0 sent 2"):
            work.get_future().wait()
        assert work.is_completed() and not work.is_success()
        assert isinstance(work.exception(), ValueError)
    still_in_step()


@needs_two
def test_wait_with_a_timeout_and_again():
    if RANK == 0:
        received = torch.empty(2)
        work = dist.irecv(received, src=1, tag=15)
        with pytest.raises(TimeoutError):
            work.wait(timeout=datetime.timedelta(milliseconds=20))
        assert not work.is_completed()
        dist.barrier()  # rank 1 sends after it
        assert work.wait(timeout=datetime.timedelta(seconds=60)) is True
        assert torch.equal(received, torch.full((2,), 1.5))
    else:
        dist.barrier()
        if RANK == 1:
            dist.send(torch.full((2,), 1.5), dst=0, tag=15)
    still_in_step()


# -- object collectives ----------------------------------------------------------------------

def test_object_collectives():
    def thing(rank):
        return {"rank": rank, "name": "x" * (rank * 37), "tensor": torch.arange(rank + 1)}

    def same(a, b):
        return a["rank"] == b["rank"] and a["name"] == b["name"] and \
            torch.equal(a["tensor"], b["tensor"])

    gathered = [None] * SIZE
    dist.all_gather_object(gathered, thing(RANK))
    assert all(same(g, thing(r)) for r, g in enumerate(gathered))
    for root in ROOTS:
        objects = [thing(RANK), RANK, "hello" * RANK]
        dist.broadcast_object_list(objects, src=root)
        assert same(objects[0], thing(root)) and objects[1:] == [root, "hello" * root]
        output = [None] * SIZE if RANK == root else None
        dist.gather_object(thing(RANK), output, dst=root)
        if RANK == root:
            assert all(same(g, thing(r)) for r, g in enumerate(output))
        received = [None]
        inputs = [thing(r) for r in range(SIZE)] if RANK == root else None
        dist.scatter_object_list(received, inputs, src=root)
        assert same(received[0], thing(RANK))
    if SIZE > 1:
        if RANK == 0:
            dist.send_object_list([thing(0), "to the last"], dst=SIZE - 1)
        elif RANK == SIZE - 1:
            objects = [None, None]
            dist.recv_object_list(objects, src=0)
            assert same(objects[0], thing(0)) and objects[1] == "to the last"
    still_in_step()


# -- groups ----------------------------------------------------------------------------------

def check_group(group, members) -> None:
    """Collectives within ``group`` of global ranks ``members`` (in group-rank order)."""
    if RANK not in members:
        assert group == dist.GroupMember.NON_GROUP_MEMBER
        assert dist.get_rank(group) == -1
        tensor = torch.full((3,), float(RANK))
        assert dist.all_reduce(tensor, group=group) is None
        assert dist.all_reduce(tensor, group=group, async_op=True) is None
        assert dist.broadcast(tensor, src=members[0], group=group) is None
        assert dist.barrier(group=group) is None
        assert torch.equal(tensor, torch.full((3,), float(RANK)))  # untouched
        return
    assert dist.get_process_group_ranks(group) == members
    assert dist.get_world_size(group) == len(members)
    assert dist.get_rank(group) == members.index(RANK)
    assert dist.get_backend(group) == "mpidp"
    for mode in MODES:
        tensor = torch.full((7,), float(RANK))
        run(mode, lambda a: dist.all_reduce(tensor, group=group, async_op=a))
        assert torch.equal(tensor, torch.full((7,), float(sum(members))))
        tensor = as_tensor(contribution(RANK, 7, "max", torch.int32), torch.int32)
        run(mode, lambda a: dist.all_reduce(tensor, ReduceOp.MAX, group=group, async_op=a))
        check_reduced(tensor, reduced(7, "max", torch.int32, members), "max")
        for src in (members[0], members[-1]):  # global ranks
            tensor = payload(RANK, 5, torch.int16)
            run(mode, lambda a: dist.broadcast(tensor, src=src, group=group, async_op=a))
            assert torch.equal(tensor, payload(src, 5, torch.int16))
        for group_src in range(len(members)):
            tensor = payload(RANK, 5, torch.float32)
            dist.broadcast(tensor, group=group, group_src=group_src)
            assert torch.equal(tensor, payload(members[group_src], 5, torch.float32))
        outputs = [torch.empty(4) for _ in members]
        run(mode, lambda a: dist.all_gather(outputs, payload(RANK, 4, torch.float32),
                                            group=group, async_op=a))
        for member, out in zip(members, outputs):
            assert torch.equal(out, payload(member, 4, torch.float32))
        output = torch.empty(len(members) * 4)
        run(mode, lambda a: dist.all_gather_into_tensor(
            output, payload(RANK, 4, torch.float32), group=group, async_op=a))
        assert torch.equal(output, torch.cat(outputs))
        output = torch.empty(2)
        source = torch.arange(2.0 * len(members)) + RANK
        run(mode, lambda a: dist.reduce_scatter_tensor(output, source, group=group, async_op=a))
        index = members.index(RANK)
        assert torch.equal(output, len(members) * torch.arange(2 * index, 2 * index + 2.0)
                           + sum(members))
        dst = members[-1]
        tensor = torch.full((2,), float(RANK))
        run(mode, lambda a: dist.reduce(tensor, dst=dst, group=group, async_op=a))
        if RANK == dst:
            assert torch.equal(tensor, torch.full((2,), float(sum(members))))
        run(mode, lambda a: dist.barrier(group=group, async_op=a))
    gathered = [None] * len(members)
    dist.all_gather_object(gathered, ("rank", RANK), group=group)
    assert gathered == [("rank", m) for m in members]
    if len(members) > 1:  # point to point with global ranks within the group
        position = members.index(RANK)
        right = members[(position + 1) % len(members)]
        left = members[(position - 1) % len(members)]
        received = torch.empty(3)
        works = [dist.isend(torch.full((3,), float(RANK)), dst=right, group=group),
                 dist.irecv(received, src=left, group=group)]
        for work in works:
            work.wait()
        assert torch.equal(received, torch.full((3,), float(left)))
        if position == 0:  # from any source: recv names the sender by its global rank
            senders = []
            for _ in members[1:]:
                received = torch.empty(1, dtype=torch.int64)
                sender = dist.recv(received, group=group, tag=21)
                assert received.item() == sender
                senders.append(sender)
            assert sorted(senders) == sorted(members[1:])
        else:
            dist.send(torch.tensor([RANK]), dst=members[0], group=group, tag=21)
    still_in_step(group)


def test_new_group_of_the_even_ranks():
    evens = list(range(0, SIZE, 2))
    check_group(dist.new_group(evens), evens)
    still_in_step()


def test_new_group_in_reversed_order_is_sorted():
    members = list(reversed(range(0, SIZE)))
    group = dist.new_group(members)
    check_group(group, sorted(members))
    still_in_step()


@needs_two
def test_group_in_an_arbitrary_order():
    from torch.distributed.distributed_c10d import _new_group_with_tag

    members = [SIZE - 1] + list(range(0, SIZE - 1, 2))  # the last rank is group rank 0
    group = _new_group_with_tag(members, sort_ranks=False)
    check_group(group, members)
    still_in_step()


def test_new_group_with_local_synchronization():
    odds = list(range(1, SIZE, 2)) or [0]
    group = dist.new_group(odds, use_local_synchronization=True) if RANK in odds else None
    if RANK in odds:
        check_group(group, odds)
    still_in_step()


def test_new_subgroups_cover_every_rank():
    size = 2 if SIZE % 2 == 0 else 1
    mine, groups = dist.new_subgroups(size)
    assert len(groups) == SIZE // size
    members = [RANK - RANK % size + i for i in range(size)]
    check_group(mine, members)
    still_in_step()


@pytest.mark.skipif(SIZE != 4, reason="a 2 x 2 mesh needs 4 ranks")
def test_device_mesh_2_by_2():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, SIZE // 2), mesh_dim_names=("dp", "tp"))
    layout = torch.arange(SIZE).reshape(2, SIZE // 2)
    row, column = divmod(RANK, SIZE // 2)
    for dim, members in (("dp", layout[:, column].tolist()), ("tp", layout[row].tolist())):
        group = mesh.get_group(dim)
        assert dist.get_process_group_ranks(group) == members
        tensor = torch.full((7,), float(RANK))
        dist.all_reduce(tensor, group=group)
        assert torch.equal(tensor, torch.full((7,), float(sum(members))))
        work = dist.all_reduce(tensor, group=group, async_op=True)
        work.get_future().wait()
        assert torch.equal(tensor, torch.full((7,), float(len(members) * sum(members))))
    still_in_step()


# -- asynchronous work in order ---------------------------------------------------------------

def test_interleaved_async_ops_on_several_groups_complete_in_issue_order():
    evens, odds = list(range(0, SIZE, 2)), list(range(1, SIZE, 2)) or [0]
    group_evens = dist.new_group(evens)
    group_odds = dist.new_group(odds) if SIZE > 1 else group_evens
    mine, members = (group_evens, evens) if RANK % 2 == 0 else (group_odds, odds)
    order = {"world": [], "mine": []}
    lock = threading.Lock()

    def note(name, index):
        def callback(future):
            with lock:
                order[name].append(index)
            return future.value()[0].sum().item()
        return callback

    tensors, futures = [], []
    for index in range(30):
        world = torch.full((7,), float(RANK + index))
        local = torch.full((1000 if index % 3 == 0 else 1,), float(RANK * index))
        tensors.append((world, local))
        futures.append(dist.all_reduce(world, async_op=True).get_future()
                       .then(note("world", index)))
        futures.append(dist.all_reduce(local, group=mine, async_op=True).get_future()
                       .then(note("mine", index)))
    torch.futures.wait_all(futures)
    assert order["world"] == list(range(30)) and order["mine"] == list(range(30))
    for index, (world, local) in enumerate(tensors):
        assert torch.equal(world, torch.full((7,), float(SIZE * (SIZE - 1) / 2 + SIZE * index)))
        assert torch.equal(local, torch.full(local.shape, float(sum(members) * index)))
        assert futures[2 * index].value() == world.sum().item()
    still_in_step()


def test_many_outstanding_all_reduces_completed_only_through_futures():
    order = []
    works, tensors = [], []
    for index in range(200):
        tensor = torch.full((1 if index % 2 else 7,), float(index + RANK))
        tensors.append(tensor)
        work = dist.all_reduce(tensor, async_op=True)
        works.append(work)
        work.get_future().then(lambda future, index=index: order.append(index))
    last = works[-1].get_future()
    last.wait()
    deadline = time.monotonic() + 60
    while len(order) < 200:
        assert time.monotonic() < deadline
        time.sleep(1e-3)
    assert order == list(range(200))
    for index, (tensor, work) in enumerate(zip(tensors, works)):
        eventually_completed(work)
        assert torch.equal(tensor, torch.full(tensor.shape, float(SIZE * index +
                                                                  SIZE * (SIZE - 1) / 2)))
    still_in_step()


def test_chained_futures_and_a_collective_issued_from_a_callback():
    tensor = torch.full((5,), float(RANK))
    doubled = dist.all_reduce(tensor, async_op=True).get_future().then(
        lambda future: future.value()[0] * 2)
    total = float(SIZE * (SIZE - 1) / 2)
    assert torch.equal(doubled.wait(), torch.full((5,), 2 * total))

    def reduce_again(future):  # as PowerSGD's hook does: a collective in a callback
        again = future.value()[0].clone()
        dist.all_reduce(again)
        return again

    tensor = torch.full((5,), float(RANK))
    nested = dist.all_reduce(tensor, async_op=True).get_future().then(reduce_again)
    assert torch.equal(nested.wait(), torch.full((5,), SIZE * total))
    chain = dist.all_reduce(torch.ones(3), async_op=True).get_future()
    for _ in range(5):
        chain = chain.then(lambda future: [future.value()[0] + 1])
    assert torch.equal(chain.wait()[0], torch.full((3,), SIZE + 5.0))
    still_in_step()


# -- bad input -------------------------------------------------------------------------------

def test_ranks_out_of_range_raise_on_every_rank():
    tensor = torch.ones(3)
    for async_op in (False, True):
        raises_everywhere((ValueError, RuntimeError),
                          lambda: dist.broadcast(tensor, src=SIZE, async_op=async_op))
        raises_everywhere((ValueError, RuntimeError),
                          lambda: dist.reduce(tensor, dst=SIZE, async_op=async_op))
    raises_everywhere((ValueError, RuntimeError), lambda: dist.send(tensor, dst=SIZE))
    raises_everywhere((ValueError, RuntimeError), lambda: dist.isend(tensor, dst=SIZE))
    raises_everywhere((ValueError, RuntimeError), lambda: dist.recv(tensor, src=SIZE))
    raises_everywhere(ValueError, lambda: dist.send(tensor, dst=RANK))  # to oneself
    assert torch.equal(tensor, torch.ones(3))
    still_in_step()


def test_wrong_lists_raise_on_every_rank():
    tensor = torch.ones(4)
    for async_op in (False, True):
        raises_everywhere(ValueError, lambda: dist.all_gather(
            [torch.empty(4) for _ in range(SIZE + 1)], tensor, async_op=async_op))
        raises_everywhere(ValueError, lambda: dist.all_gather(
            [torch.empty(4) for _ in range(SIZE - 1)] + [torch.empty(5)], tensor,
            async_op=async_op))
        raises_everywhere((TypeError, ValueError), lambda: dist.all_gather(
            [torch.empty(4, dtype=torch.float64) for _ in range(SIZE)], tensor,
            async_op=async_op))
        raises_everywhere(ValueError, lambda: dist.reduce_scatter(
            torch.empty(4), [torch.ones(4) for _ in range(SIZE + 1)], async_op=async_op))
        raises_everywhere(ValueError, lambda: dist.reduce_scatter(
            torch.empty(4), [torch.ones(4) for _ in range(SIZE - 1)] + [torch.ones(3)],
            async_op=async_op))
        raises_everywhere(ValueError, lambda: dist.all_to_all(
            [torch.empty(1) for _ in range(SIZE + 1)], [torch.ones(1) for _ in range(SIZE + 1)],
            async_op=async_op))
        raises_everywhere((ValueError, RuntimeError), lambda: dist.all_gather_into_tensor(
            torch.empty(SIZE * 4 + 1), tensor, async_op=async_op))
        raises_everywhere((ValueError, RuntimeError), lambda: dist.reduce_scatter_tensor(
            torch.empty(4), torch.ones(SIZE * 4 + 1), async_op=async_op))
        # the root alone sees its list: it has the wrong length there, and every other
        # rank passes one where none belongs (torch's own check), so every rank raises
        raises_everywhere(ValueError, lambda: dist.gather(
            tensor, [torch.empty(4) for _ in range(SIZE + 1)] if RANK == 0 else
            [torch.empty(4)], dst=0, async_op=async_op), same=False)
        raises_everywhere(ValueError, lambda: dist.scatter(
            torch.empty(4), [torch.ones(4) for _ in range(SIZE + 1)] if RANK == 0 else
            [torch.ones(4)], src=0, async_op=async_op), same=False)
        if RANK == 0:
            with pytest.raises(ValueError, match="world size"):
                dist.gather(tensor, [torch.empty(4)] * (SIZE + 1), dst=0, async_op=async_op)
            with pytest.raises(ValueError, match="world size"):
                dist.scatter(torch.empty(4), [torch.ones(4)] * (SIZE + 1), src=0,
                             async_op=async_op)
    still_in_step()


@needs_two
def test_all_to_all_single_splits_that_disagree_raise_on_every_rank():
    tensor = torch.arange(float(SIZE))
    output = torch.empty(SIZE)
    output_splits = [1] * SIZE
    if RANK == 0:
        output_splits = [2, 0] + [1] * (SIZE - 2)  # expects 2 rows from rank 0, none from 1
    message = raises_everywhere(ValueError, lambda: dist.all_to_all_single(
        output, tensor, output_splits, [1] * SIZE))
    assert "splits disagree" in message
    still_in_step()


def test_debug_mode_size_mismatch_raises_on_every_rank():
    saved = comm.checks._DEBUG
    comm.checks._DEBUG = True
    try:
        for async_op in (False, True):
            tensor = torch.ones(7 + (RANK == SIZE - 1))
            if SIZE > 1:
                message = raises_everywhere(ValueError, lambda: dist.all_reduce(
                    tensor, async_op=async_op))
                assert "differ across ranks" in message
            still_in_step()
        output = torch.empty(SIZE * 3)
        work = dist.all_gather_into_tensor(output, torch.full((3,), float(RANK)), async_op=True)
        work.wait()
        assert torch.equal(output, torch.arange(float(SIZE)).repeat_interleave(3))
    finally:
        comm.checks._DEBUG = saved
    still_in_step()


def test_a_calls_check_is_in_the_flight_record_and_ended():
    """The call check starts through the engine with its recorder entry (comm.handle.issue_recorded)."""
    if dist.get_world_size() == 1:
        pytest.skip("no call check at one rank")
    before = {entry["ticket"] for entry in mpidp.recorder.entries()}
    tensor = torch.ones(5)
    dist.all_reduce(tensor)
    checks = [entry for entry in mpidp.recorder.entries()
              if entry["ticket"] not in before and entry["op"] == "call check"]
    assert checks and all(entry["end"] for entry in checks), checks
    assert checks[-1]["what"] == "allreduce", checks  # the call it checks
