"""mpidp.comm on every rank: each op and dtype against numpy, nonblocking overlap, errors."""

import gc

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp import comm

RANK, SIZE = mpidp.rank(), mpidp.size()
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool]
COUNTS = [1, 7, 1000, 1 << 17]
NP_COMBINE = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum,
              "prod": np.multiply, "band": np.bitwise_and, "bor": np.bitwise_or,
              "bxor": np.bitwise_xor}
NP_BOOL_COMBINE = {"sum": np.logical_or, "max": np.logical_or, "min": np.logical_and,
                   "prod": np.logical_and, "band": np.logical_and, "bor": np.logical_or,
                   "bxor": np.logical_xor}


def contribution(rank: int, count: int, op: str, dtype: torch.dtype) -> np.ndarray:
    """Rank ``rank``'s input: small integers, so every dtype holds every result exactly."""
    index = np.arange(count)
    if dtype == torch.bool:
        return (index + rank) % 3 == 0
    if op == "prod":
        return 1.0 + (index + rank) % 2
    if op in ("band", "bor", "bxor"):
        return (index * 7 + rank * 5) % 64
    return (index % 5 + rank).astype(np.float64)


def expected(count: int, op: str, dtype: torch.dtype) -> np.ndarray:
    table = NP_BOOL_COMBINE if dtype == torch.bool else NP_COMBINE
    result = contribution(0, count, op, dtype)
    for rank in range(1, SIZE):
        result = table[op](result, contribution(rank, count, op, dtype))
    return result / SIZE if op == "avg" else result


def as_tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)


def check_equal(result: torch.Tensor, values: np.ndarray, op: str) -> None:
    reference = as_tensor(values, result.dtype)
    if op == "avg":
        torch.testing.assert_close(result.double(), torch.from_numpy(values).double(),
                                   rtol=1e-2 if result.element_size() == 2 else 1e-6, atol=0)
    else:
        assert torch.equal(result, reference), (result, reference)


def ops_for(dtype):
    return [op for op in comm.OPS
            if not dtype.is_floating_point or op not in ("band", "bor", "bxor")
            if op != "avg" or dtype.is_floating_point]


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_allreduce_every_op_and_dtype(dtype, count, nonblocking):
    for op in ops_for(dtype):
        tensor = as_tensor(contribution(RANK, count, op, dtype), dtype)
        if nonblocking:
            handle = comm.iallreduce(tensor, op)
            assert handle.wait() is tensor
            assert handle.is_completed()
        else:
            assert comm.allreduce(tensor, op) is tensor
        check_equal(tensor, expected(count, op, dtype), op)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter_every_op(dtype):
    block = 6
    for op in ops_for(dtype):
        full = expected(block * SIZE, op, dtype)
        tensor = as_tensor(contribution(RANK, block * SIZE, op, dtype), dtype)
        output = torch.empty(block, dtype=dtype)
        comm.ireduce_scatter(output, tensor, op).wait()
        check_equal(output, full[RANK * block:(RANK + 1) * block], op)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast_from_every_root(dtype):
    for root in range(SIZE):
        tensor = as_tensor(contribution(RANK, 11, "sum", dtype), dtype)
        comm.broadcast(tensor, root)
        assert torch.equal(tensor, as_tensor(contribution(root, 11, "sum", dtype), dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allgather(dtype):
    tensor = as_tensor(contribution(RANK, 5, "sum", dtype), dtype)
    output = torch.empty(SIZE, 5, dtype=dtype)
    comm.iallgather(output, tensor).wait()
    for rank in range(SIZE):
        assert torch.equal(output[rank], as_tensor(contribution(rank, 5, "sum", dtype), dtype))


def test_bfloat16_and_float16_take_a_correct_path():
    for dtype in (torch.float16, torch.bfloat16):
        assert comm.reduction_path(dtype, "sum") in ("native", "torch")
    # bfloat16 sums that native integer arithmetic on the bits would get wrong
    tensor = torch.full((3,), 1.5 * (RANK + 1), dtype=torch.bfloat16)
    comm.allreduce(tensor)
    assert torch.equal(tensor, torch.full((3,), 1.5 * SIZE * (SIZE + 1) / 2, dtype=torch.bfloat16))


def test_many_nonblocking_in_flight_complete_in_any_order():
    pool = comm.Pool(size=3)
    try:
        for order in ("forward", "reverse", "shuffled", "polled"):
            tensors = [torch.full((1 << (4 + i),), float(RANK + i)) for i in range(9)]
            handles = [comm.iallreduce(t, "sum", comm=pool) for t in tensors]
            handles.append(comm.ibroadcast(bcast := torch.full((4,), float(RANK)), 0, comm=pool))
            if order == "reverse":
                handles.reverse()
            elif order == "shuffled":
                handles = [handles[i] for i in torch.randperm(len(handles),
                                                              generator=torch.Generator().manual_seed(1))]
            if order == "polled":
                while not all(h.is_completed() for h in handles):
                    pass
            else:
                for handle in handles:
                    handle.wait()
            for i, tensor in enumerate(tensors):
                assert torch.equal(tensor, torch.full_like(tensor, SIZE * i + SIZE * (SIZE - 1) / 2))
            assert torch.equal(bcast, torch.zeros(4))
    finally:
        pool.free()


def test_pool_members_are_distinct_duplicates_used_round_robin():
    pool = comm.Pool(size=3)
    try:
        members = [pool.next() for _ in range(6)]
        assert members[:3] == members[3:] == pool.comms
        assert len({id(c) for c in pool.comms}) == 3
        for member in pool.comms:
            assert MPI.Comm.Compare(member, MPI.COMM_WORLD) == MPI.CONGRUENT
    finally:
        pool.free()


def test_handle_keeps_its_tensor_alive():
    handle = comm.iallreduce(torch.full((1 << 16,), 1.0))
    gc.collect()
    assert torch.equal(handle.wait(), torch.full((1 << 16,), float(SIZE)))


def test_barrier_and_ibarrier():
    comm.barrier()
    comm.ibarrier().wait()
    mpidp.barrier()


@pytest.mark.skipif(SIZE < 2, reason="point-to-point needs two ranks")
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_send_recv_ring_of_3x4_tensors(blocking):
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    outgoing = torch.arange(12, dtype=torch.float32).reshape(3, 4) + RANK
    incoming = torch.empty(3, 4)
    if blocking and RANK % 2 == 0:
        comm.send(outgoing, right, tag=7)
        assert comm.recv(incoming, left, tag=7) == left
    elif blocking:
        assert comm.recv(incoming, left, tag=7) == left
        comm.send(outgoing, right, tag=7)
    else:
        receive = comm.irecv(incoming, left, tag=7)
        send = comm.isend(outgoing, right, tag=7)
        assert receive.wait() is incoming
        send.wait()
    assert torch.equal(incoming, torch.arange(12, dtype=torch.float32).reshape(3, 4) + left)


@pytest.mark.skipif(SIZE < 2, reason="point-to-point needs two ranks")
def test_recv_of_the_wrong_size_is_a_clear_error():
    if RANK == 0:
        comm.send(torch.ones(5), 1, tag=1)
        comm.send(torch.ones(5), 1, tag=2)
    elif RANK == 1:
        with pytest.raises(ValueError, match="tensor has 4 elements of torch.float32, rank 0 sent"):
            comm.recv(torch.empty(4), 0, tag=1)
        with pytest.raises(ValueError, match="tensor has 6 elements of torch.float32, rank 0 sent 5"):
            comm.recv(torch.empty(6), 0, tag=2)
    comm.barrier()


def test_bad_tensors_and_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="tensor has elements that share memory"):
        comm.allreduce(torch.ones(1).expand(4))
    with pytest.raises(ValueError, match=r"tensor requires grad; communicate tensor.detach\(\)"):
        comm.allreduce(torch.ones(3, requires_grad=True))
    with pytest.raises(TypeError, match="tensor has dtype torch.complex64, supported dtypes are"):
        comm.allreduce(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor, got list"):
        comm.allreduce([1.0])
    with pytest.raises(ValueError,
                       match="op must be one of sum, avg, min, max, prod, band, bor, bxor, got 'mean'"):
        comm.allreduce(torch.ones(3), "mean")
    with pytest.raises(TypeError, match="op 'avg' needs a floating-point dtype, got torch.int64"):
        comm.allreduce(torch.ones(3, dtype=torch.int64), "avg")
    with pytest.raises(ValueError, match=rf"output must have world size \({SIZE}\) x tensor.numel\(\)"):
        comm.allgather(torch.empty(SIZE * 3 + 1), torch.ones(3))
    with pytest.raises(ValueError, match=rf"tensor must have world size \({SIZE}\) x output.numel\(\)"):
        comm.reduce_scatter(torch.empty(2), torch.ones(2 * SIZE + 1))
    with pytest.raises(ValueError, match=rf"invalid root {SIZE}, root should be in the interval"):
        comm.broadcast(torch.ones(2), SIZE)
    with pytest.raises(ValueError, match="invalid dest -1"):
        comm.isend(torch.ones(2), -1)
    with pytest.raises(ValueError, match="pool size must be an int >= 1, got 0"):
        comm.Pool(size=0)
    with pytest.raises(TypeError, match="comm must be None, an mpidp.comm.Pool or an mpi4py"):
        comm.allreduce(torch.ones(2), comm="world")


@pytest.mark.skipif(SIZE < 2, reason="a cross-rank mismatch needs two ranks")
def test_debug_mode_reports_mismatched_sizes_on_every_rank(monkeypatch):
    monkeypatch.setattr(comm.checks, "_DEBUG", True)
    with pytest.raises(ValueError, match=r"collective calls differ across ranks: rank 0 called "
                                         r"allreduce\(op='sum', dtype=float32, numel=3\); rank"):
        comm.allreduce(torch.ones(3 + min(RANK, 1)))
    comm.allreduce(torch.ones(3))  # matched calls still work in debug mode


def test_info_report(capsys):
    """``python -m mpidp info`` (its main, here in the launch): rank 0 prints every rank's
    layout, the MPI library and thread level, CUDA-awareness and the binding's findings."""
    from mpidp.__main__ import main
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    if RANK != 0:
        assert out == "", out
        return
    lines = out.splitlines()
    assert lines[0].split() == ["rank", "host", "local_rank", "numa", "cores", "torch_threads", "gpu"]
    assert [line.split()[0] for line in lines[1:1 + SIZE]] == [str(r) for r in range(SIZE)]
    assert "MPI library:" in out and "thread level multiple" in out and "CUDA-aware:" in out
    assert "binding:" in out or "warning:" in out
