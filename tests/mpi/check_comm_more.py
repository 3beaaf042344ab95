"""reduce, gather, scatter, alltoall, allgatherv, object collectives and optimizer state, on every rank.

Each op and dtype is checked against numpy, with expected values computed from
rank and size; non-contiguous tensors against contiguous ones; every misuse
raises a clear error, either on the rank that made it (which stays in step with
the others) or, where the fault spans ranks, the same error on every rank.
Each error test ends with correct collectives whose results are checked, which
would hang if the ranks had fallen out of step.
"""

import copy
import pickle
import threading

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp import comm
from _expected import BITWISE, as_tensor, check_reduced, contribution, ops_for, reduced  # noqa: F401
from mpidp.objects import allgather_object, average, broadcast_object
from mpidp.optimizer import broadcast_optimizer_state

RANK, SIZE = mpidp.rank(), mpidp.size()
ODD = SIZE - 1  # the rank that misbehaves (rank 0 when it runs alone)
OTHERS = "rank 0" if SIZE == 2 else f"ranks 0-{SIZE - 2}"
ROOTS = sorted({0, SIZE - 1, SIZE // 2})
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.int32, torch.int64, torch.uint8, torch.bool]

needs_two = pytest.mark.skipif(SIZE < 2, reason="needs two ranks")


# -- expected values -------------------------------------------------------------------------







def payload(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s data to move: differs by rank and index, exact in every dtype."""
    index = np.arange(count)
    values = (index + rank) % 2 == 1 if dtype == torch.bool else (index * 3 + rank * 11) % 97
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)











def agree_on_every_rank(message: str) -> None:
    """Every rank saw the same message (and reached this collective: nobody hung)."""
    messages = MPI.COMM_WORLD.allgather(message)
    assert messages == [messages[0]] * SIZE, messages


def sums_agree(target=None) -> None:
    """Two correct allreduces on ``target``; a rank a pool member ahead would hang here."""
    for step in range(2):
        tensor = torch.full((5,), float(RANK + step))
        comm.allreduce(tensor, comm=target)
        assert torch.equal(tensor, torch.full((5,), SIZE * (SIZE - 1) / 2 + SIZE * step))


@pytest.fixture(params=["default pool", "Pool(size=3)", "COMM_WORLD.Dup()"])
def target(request):
    """The ``comm`` argument: None, a pool of its own, or a plain mpi4py communicator."""
    if request.param == "default pool":
        yield None
    elif request.param.startswith("Pool"):
        pool = comm.Pool(size=3)
        yield pool
        pool.free()
    else:
        dup = MPI.COMM_WORLD.Dup()
        yield dup
        dup.Free()


# -- reduce, gather, scatter -----------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 7, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_reduce_every_op_dtype_and_root(dtype, count, nonblocking):
    for root in ROOTS:
        for op in ops_for(dtype):
            mine = as_tensor(contribution(RANK, count, op, dtype), dtype)
            tensor = mine.clone()
            if nonblocking:
                assert comm.ireduce(tensor, root, op).wait() is tensor
            else:
                assert comm.reduce(tensor, root, op) is tensor
            if RANK == root:
                check_reduced(tensor, reduced(count, op, dtype), op)
            else:
                assert torch.equal(tensor, mine)  # a sender's tensor is left as it was


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_gather_to_every_root(dtype, nonblocking):
    gathered = torch.stack([payload(rank, 6, dtype).reshape(2, 3) for rank in range(SIZE)])
    for root in ROOTS:
        for given in (False, True):
            output = torch.empty(SIZE * 6, dtype=dtype) if given and RANK == root else None
            call = comm.igather if nonblocking else comm.gather
            result = call(payload(RANK, 6, dtype).reshape(2, 3), output, root)
            result = result.wait() if nonblocking else result
            if RANK != root:
                assert result is None
                continue
            if given:
                assert result is output
                assert torch.equal(result, gathered.reshape(-1))
            else:
                assert result.shape == (SIZE, 2, 3) and torch.equal(result, gathered)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_scatter_from_every_root(dtype, nonblocking):
    for root in ROOTS:
        blocks = payload(root, SIZE * 5, dtype) if RANK == root else None
        output = torch.empty(5, dtype=dtype)
        call = comm.iscatter if nonblocking else comm.scatter
        result = call(output, blocks, root)
        assert (result.wait() if nonblocking else result) is output
        assert torch.equal(output, payload(root, SIZE * 5, dtype)[RANK * 5:(RANK + 1) * 5])


# -- alltoall --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_alltoall_equal_blocks(dtype, nonblocking):
    block = 3
    tensor = payload(RANK, SIZE * block, dtype)
    output = torch.empty(SIZE * block, dtype=dtype)
    result = (comm.ialltoall(output, tensor).wait() if nonblocking
              else comm.alltoall(output, tensor))
    assert result is output
    expected = torch.cat([payload(peer, SIZE * block, dtype)[RANK * block:(RANK + 1) * block]
                          for peer in range(SIZE)])
    assert torch.equal(output, expected)


def rows_sent(sender: int, receiver: int) -> int:
    return (sender + 2 * receiver) % 3  # zeros included


def rows_of(rank: int, dtype: torch.dtype, row_shape: tuple) -> torch.Tensor:
    rows = sum(rows_sent(rank, peer) for peer in range(SIZE))
    return payload(rank, rows * int(np.prod(row_shape)), dtype).reshape(rows, *row_shape)


def expected_alltoallv(dtype: torch.dtype, row_shape: tuple) -> torch.Tensor:
    pieces = []
    for peer in range(SIZE):
        start = sum(rows_sent(peer, other) for other in range(RANK))
        pieces.append(rows_of(peer, dtype, row_shape)[start:start + rows_sent(peer, RANK)])
    return torch.cat(pieces)


@pytest.mark.parametrize("row_shape", [(), (2, 3)], ids=["1-d", "rows of 2x3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_alltoall_uneven_splits_in_rows(dtype, row_shape, nonblocking):
    input_splits = [rows_sent(RANK, peer) for peer in range(SIZE)]
    output_splits = [rows_sent(peer, RANK) for peer in range(SIZE)]
    tensor = rows_of(RANK, dtype, row_shape)
    output = torch.empty(sum(output_splits), *row_shape, dtype=dtype)
    call = comm.ialltoall if nonblocking else comm.alltoall
    result = call(output, tensor, output_splits, input_splits)
    assert (result.wait() if nonblocking else result) is output
    assert torch.equal(output, expected_alltoallv(dtype, row_shape))


def test_alltoall_a_side_without_splits_is_equal_rows():
    tensor = torch.arange(2 * SIZE * 3, dtype=torch.float32).reshape(2 * SIZE, 3) + 100 * RANK
    output = torch.empty(2 * SIZE, 3)
    comm.alltoall(output, tensor, [2] * SIZE, None)
    expected = torch.cat([(torch.arange(2 * SIZE * 3.0).reshape(2 * SIZE, 3) + 100 * peer)
                          [2 * RANK:2 * RANK + 2] for peer in range(SIZE)])
    assert torch.equal(output, expected)
    again = torch.empty(2 * SIZE, 3)
    comm.alltoall(again, tensor, None, (2,) * SIZE)  # tuples are fine
    assert torch.equal(again, expected)


# -- allgatherv ------------------------------------------------------------------------------

@pytest.mark.parametrize("row_shape", [(), (3,), (2, 2)], ids=["1-d", "rows of 3", "rows of 2x2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_allgatherv_concatenates_first_dimensions_that_differ(dtype, row_shape, nonblocking):
    def rows(rank):  # rank 0 has none
        return payload(rank, rank * int(np.prod(row_shape)), dtype).reshape(rank, *row_shape)

    result = comm.iallgatherv(rows(RANK)).wait() if nonblocking else comm.allgatherv(rows(RANK))
    output, sizes = result
    assert sizes == list(range(SIZE))
    assert output.dtype == dtype and output.shape == (sum(sizes), *row_shape)
    assert torch.equal(output, torch.cat([rows(rank) for rank in range(SIZE)]))
    for rank, part in enumerate(output.split(sizes)):
        assert torch.equal(part, rows(rank))


# -- non-contiguous tensors are staged -------------------------------------------------------

def strided(values: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous tensor (every other element of a wider one)."""
    wide = torch.zeros(values.numel() * 2, dtype=values.dtype)
    view = wide[::2].view(values.shape) if values.dim() <= 1 else None
    if view is None:
        view = wide.view(*values.shape[:-1], values.shape[-1] * 2)[..., ::2]
    view.copy_(values)
    assert view.numel() < 2 or not view.is_contiguous()
    return view


@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_non_contiguous_tensors_give_the_contiguous_results(nonblocking):
    def run(name, *args, **kwargs):
        if nonblocking:
            return getattr(comm, "i" + name)(*args, **kwargs).wait()
        return getattr(comm, name)(*args, **kwargs)

    def mine():
        return torch.arange(12, dtype=torch.float32).reshape(3, 4) + RANK

    tensor = mine().t()  # a transposed view: non-contiguous
    assert run("allreduce", tensor, "max") is tensor
    assert torch.equal(tensor, (torch.arange(12.0).reshape(3, 4) + SIZE - 1).t())
    tensor = strided(mine())
    run("broadcast", tensor, ODD)
    assert torch.equal(tensor, torch.arange(12.0).reshape(3, 4) + ODD)
    tensor = strided(mine())
    run("reduce", tensor, 0, "sum")
    total = torch.arange(12.0).reshape(3, 4) * SIZE + SIZE * (SIZE - 1) / 2
    assert torch.equal(tensor, total if RANK == 0 else mine())
    output = strided(torch.zeros(SIZE, 6))
    run("allgather", output, strided(torch.full((6,), float(RANK))))
    assert torch.equal(output, torch.arange(SIZE, dtype=torch.float32)[:, None].expand(SIZE, 6))
    output = strided(torch.zeros(2))
    run("reduce_scatter", output, strided(torch.arange(2.0 * SIZE)))
    assert torch.equal(output, torch.tensor([2.0 * RANK, 2.0 * RANK + 1]) * SIZE)
    output = strided(torch.zeros(SIZE, 4)) if RANK == 0 else None
    result = run("gather", strided(torch.full((4,), float(RANK))), output, 0)
    assert result is output
    if RANK == 0:
        assert torch.equal(output, torch.arange(SIZE, dtype=torch.float32)[:, None].expand(SIZE, 4))
    output = strided(torch.zeros(3))
    run("scatter", output, strided(torch.arange(3.0 * SIZE)) if RANK == 0 else None, 0)
    assert torch.equal(output, torch.arange(3.0 * RANK, 3.0 * RANK + 3))
    output = strided(torch.zeros(SIZE * 2))
    run("alltoall", output, strided(torch.arange(2.0 * SIZE) + 10 * RANK))
    assert torch.equal(output, torch.tensor([[2.0 * RANK + 10 * peer, 2.0 * RANK + 1 + 10 * peer]
                                             for peer in range(SIZE)]).reshape(-1))
    input_splits = [rows_sent(RANK, peer) for peer in range(SIZE)]
    output_splits = [rows_sent(peer, RANK) for peer in range(SIZE)]
    output = strided(torch.zeros(sum(output_splits), 3, dtype=torch.int64))
    run("alltoall", output, strided(rows_of(RANK, torch.int64, (3,))), output_splits, input_splits)
    assert torch.equal(output, expected_alltoallv(torch.int64, (3,)))
    gathered, sizes = run("allgatherv", strided(torch.full((RANK + 1, 2), RANK)))
    assert sizes == [rank + 1 for rank in range(SIZE)]
    assert torch.equal(gathered, torch.cat([torch.full((rank + 1, 2), rank)
                                            for rank in range(SIZE)]))


@needs_two
def test_a_failed_operation_raises_again_on_every_later_wait_or_test():
    """An operation keeps its error (docs/concurrency.md, rule 9): a receive of the wrong size
    raises it at every wait and test; a second wait used to return the tensor as if received."""
    if RANK == 0:
        comm.send(torch.ones(5), 1, tag=3)
    elif RANK == 1:
        handle = comm.irecv(torch.zeros(6), 0, tag=3)
        for again in (handle.wait, handle.wait, handle.is_completed,
                      lambda: comm.progress.test_all([handle])):
            with pytest.raises(ValueError, match="tensor has 6 elements of torch.float32, "
                                                 "rank 0 sent 5"):
                again()
    comm.barrier()


@needs_two
def test_non_contiguous_send_and_recv():
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    incoming = strided(torch.zeros(3, 4))
    receive = comm.irecv(incoming, left, tag=5)
    comm.isend(strided(torch.arange(12.0).reshape(3, 4) + RANK), right, tag=5).wait()
    assert receive.wait() is incoming
    assert torch.equal(incoming, torch.arange(12.0).reshape(3, 4) + left)


def test_contiguous_tensors_go_to_mpi_as_they_are():
    if comm.staging._STAGE_CPU:
        pytest.skip("MPIDP_STAGE_CPU=1 stages every tensor")
    tensor, output = torch.ones(4), torch.empty(4 * SIZE)
    inputs, outputs, copy_back = comm._stage((tensor,), (output, tensor))
    assert inputs[0] is tensor and outputs[0] is output and outputs[1] is tensor
    assert copy_back is None


# -- object collectives ----------------------------------------------------------------------

def _load_unless_on(rank: int):
    if RANK == rank:
        raise RuntimeError(f"refused on rank {rank}")
    return "loaded"


class LoadsEverywhereButOn:
    """Pickles anywhere; unpickling raises on rank ``rank`` only."""

    def __init__(self, rank: int):
        self.rank = rank

    def __reduce__(self):
        return _load_unless_on, (self.rank,)


def test_broadcast_object_from_every_root(target):
    for root in ROOTS:
        mine = {"rank": RANK, "tensor": torch.full((3,), float(RANK)), "text": "x" * RANK,
                "nested": [(RANK, None), {RANK}]}
        result = broadcast_object(mine, root, comm=target)
        if RANK == root:
            assert result is mine
        assert result["rank"] == root and result["text"] == "x" * root
        assert torch.equal(result["tensor"], torch.full((3,), float(root)))
        assert result["nested"] == [(root, None), {root}]
    sums_agree(target)


def test_broadcast_object_of_64_mib():
    blob = np.arange(16 << 20, dtype=np.int32) * (RANK + 1)
    result = broadcast_object({"blob": blob, "rank": RANK}, ODD)
    assert result["rank"] == ODD
    assert np.array_equal(result["blob"], np.arange(16 << 20, dtype=np.int32) * (ODD + 1))


def test_allgather_object_of_sizes_that_differ(target):
    mine = {"rank": RANK, "rows": list(range(RANK * 1000)), "tensor": torch.ones(RANK)}
    result = allgather_object(mine, comm=target)
    assert result[RANK] is mine
    for rank, item in enumerate(result):
        assert item["rank"] == rank and item["rows"] == list(range(rank * 1000))
        assert torch.equal(item["tensor"], torch.ones(rank))
    assert allgather_object(None, comm=target) == [None] * SIZE
    sums_agree(target)


def test_an_object_that_cannot_be_pickled_is_an_error_on_every_rank():
    with pytest.raises(pickle.PicklingError) as info:
        broadcast_object(threading.Lock() if RANK == ODD else "ignored", ODD)
    assert str(info.value) == (f"broadcast_object: rank {ODD}'s object cannot be pickled: "
                               f"TypeError: cannot pickle '_thread.lock' object")
    agree_on_every_rank(str(info.value))
    with pytest.raises(pickle.PicklingError) as info:
        allgather_object(threading.Lock() if RANK == ODD else RANK)
    assert str(info.value) == (f"allgather_object: an object cannot be pickled on rank {ODD}: "
                               f"TypeError: cannot pickle '_thread.lock' object")
    agree_on_every_rank(str(info.value))
    sums_agree()


@needs_two
def test_an_object_that_cannot_be_unpickled_on_one_rank_is_an_error_on_every_rank():
    with pytest.raises(pickle.UnpicklingError) as info:
        broadcast_object(LoadsEverywhereButOn(ODD), 0)
    assert str(info.value) == (f"broadcast_object: rank 0's object cannot be unpickled on rank "
                               f"{ODD}: RuntimeError: refused on rank {ODD}")
    agree_on_every_rank(str(info.value))
    with pytest.raises(pickle.UnpicklingError) as info:
        allgather_object(LoadsEverywhereButOn(ODD) if RANK == 0 else RANK)
    assert str(info.value) == (f"allgather_object: an object cannot be unpickled on rank {ODD}: "
                               f"rank 0's object: RuntimeError: refused on rank {ODD}")
    agree_on_every_rank(str(info.value))
    sums_agree()


# -- average ---------------------------------------------------------------------------------

def test_average_of_numbers_and_dicts(target):
    assert average(RANK, comm=target) == (SIZE - 1) / 2
    assert average(np.float32(RANK), comm=target) == (SIZE - 1) / 2
    assert average(torch.tensor([2.0 * RANK], requires_grad=True), comm=target) == SIZE - 1
    metrics = {"loss": 1.0 / (RANK + 1), "accuracy": torch.tensor(0.5 * RANK), "n": RANK}
    if RANK % 2:
        metrics = dict(reversed(metrics.items()))  # key order may differ by rank
    result = average(metrics, comm=target)
    assert list(result) == list(metrics)  # this rank's order
    # builtin sum in rank order, as average() sums (compensated from Python 3.12 on)
    loss = sum(1.0 / (rank + 1) for rank in range(SIZE))
    assert result == {"loss": loss / SIZE, "accuracy": 0.5 * (SIZE - 1) / 2, "n": (SIZE - 1) / 2}
    agree_on_every_rank(repr(sorted(result.items())))  # bit for bit
    assert average({}, comm=target) == {}
    sums_agree(target)


@needs_two
def test_average_of_dicts_whose_keys_differ_is_an_error_on_every_rank():
    metrics = {"loss": 1.0, "accuracy": 0.5} if RANK != ODD else {"loss": 1.0}
    with pytest.raises(ValueError) as info:
        average(metrics)
    assert str(info.value) == (f"average: the dicts' keys differ across ranks: {OTHERS}: keys "
                               f"'accuracy', 'loss'; rank {ODD}: keys 'loss'; every rank must "
                               f"report the same keys")
    agree_on_every_rank(str(info.value))
    sums_agree()


@pytest.mark.parametrize("value,error", [(None, "value is a NoneType, not a number or a dict of "
                                                "numbers"),
                                         ({"loss": "high"}, "value of 'loss' is a str, not a number"),
                                         ({"loss": torch.ones(2)},
                                          "value of 'loss' is a Tensor, not a number")])
def test_average_of_something_else_is_an_error_on_every_rank(value, error):
    with pytest.raises(TypeError) as info:
        average(value if RANK == ODD else {"loss": 1.0})
    assert str(info.value) == f"average: rank {ODD}: {error}"
    agree_on_every_rank(str(info.value))
    if SIZE > 1:
        with pytest.raises(TypeError, match=r"average: ranks mix numbers and dicts: "):
            average(1.0 if RANK == ODD else {"loss": 1.0})
    sums_agree()


# -- broadcast_optimizer_state ---------------------------------------------------------------

def make_model(unused: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if unused:
        model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))
    return model


def train_step(model, optimizer, step: int, touch_unused: bool = False) -> None:
    generator = torch.Generator().manual_seed(step)
    inputs, targets = torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    (loss + model.unused.sum() if touch_unused else loss).backward()
    optimizer.step()


OPTIMIZERS = {
    "SGD momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "SGD nesterov, weight decay": lambda params, lr: torch.optim.SGD(
        params, lr=lr, momentum=0.8, nesterov=True, weight_decay=1e-3),
    "Adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "AdamW amsgrad": lambda params, lr: torch.optim.AdamW(params, lr=lr, amsgrad=True),
    "Adam tensor lr": lambda params, lr: torch.optim.Adam(params, lr=torch.tensor(lr),
                                                          foreach=False),
}


def same(a, b) -> bool:
    """Deep equality of state dicts: tensors by dtype, shape and values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def resumed_on(root: int, name: str, target=None, unused: bool = False):
    """A model and optimizer built fresh everywhere, the checkpoint loaded on ``root`` only.

    Returns (model, optimizer, checkpoint): the checkpoint is three steps of
    training, which every rank can compute to check against.
    """
    model = make_model(unused)
    optimizer = OPTIMIZERS[name](model.parameters(), 0.05)
    for step in range(3):
        train_step(model, optimizer, step)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    model = make_model(unused)
    optimizer = OPTIMIZERS[name](model.parameters(), 0.5 + RANK)  # other hyperparameters
    if RANK == root:  # a copy, as torch.load gives: load_state_dict keeps the tensors it gets
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
    for param in model.parameters():
        comm.broadcast(param.detach(), root, comm=target)
    return model, optimizer, checkpoint


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_broadcast_optimizer_state_after_resuming_on_one_rank(name):
    for root in ROOTS:
        model, optimizer, checkpoint = resumed_on(root, name)
        if RANK != root:
            assert not optimizer.state  # nothing to go on but the root's
        before = copy.deepcopy(optimizer.state_dict()) if RANK == root else None
        broadcast_optimizer_state(optimizer, root)
        if RANK == root:
            assert same(optimizer.state_dict(), before)  # the root's is left as it is
        assert same(optimizer.state_dict(), checkpoint["optimizer"])
        states = allgather_object(optimizer.state_dict())
        assert all(same(state, states[root]) for state in states)
        # one more step gives the same parameters everywhere, those of training on
        reference = make_model()
        reference.load_state_dict(checkpoint["model"])
        reference_optimizer = OPTIMIZERS[name](reference.parameters(), 0.05)
        reference_optimizer.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
        train_step(reference, reference_optimizer, 3)
        train_step(model, optimizer, 3)
        for param, expected in zip(model.parameters(), reference.parameters()):
            assert torch.equal(param, expected)
        gathered = allgather_object([p.detach() for p in model.parameters()])
        assert all(torch.equal(a, b) for params in gathered for a, b in zip(params, gathered[0]))


def test_broadcast_optimizer_state_replaces_a_state_other_ranks_had(target):
    # The root's checkpoint never gave "unused" a gradient, so has no state for it;
    # the other ranks trained it and must end with no state for it either.
    model, optimizer, checkpoint = resumed_on(ODD, "Adam", target, unused=True)
    if RANK != ODD:
        for step in range(2):
            train_step(model, optimizer, 10 + RANK + step, touch_unused=True)
        assert len(optimizer.state) == 5
    broadcast_optimizer_state(optimizer, ODD, comm=target)
    assert len(optimizer.state) == 4
    assert same(optimizer.state_dict(), checkpoint["optimizer"])
    sums_agree(target)


def test_broadcast_optimizer_state_of_large_tensors_on_their_own():
    torch.manual_seed(1)
    model = torch.nn.Linear(512, 1024)  # a 2 MiB weight: broadcast where it lies
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if RANK == ODD:
        model(torch.randn(2, 512)).sum().backward()
        optimizer.step()
    broadcast_optimizer_state(optimizer, ODD)
    buffers = allgather_object([optimizer.state[p]["momentum_buffer"] for p in model.parameters()])
    assert all(torch.equal(a, b) for mine in buffers for a, b in zip(mine, buffers[ODD]))


@needs_two
def test_an_optimizer_that_cannot_load_the_roots_state_is_an_error_on_every_rank():
    model = make_model()
    groups = ([{"params": model[0].parameters()}, {"params": model[2].parameters()}]
              if RANK == 0 else model.parameters())
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    others = "rank 1" if SIZE == 2 else f"ranks 1-{SIZE - 1}"
    with pytest.raises(ValueError) as info:
        broadcast_optimizer_state(optimizer, 0)
    assert str(info.value).startswith(f"broadcast_optimizer_state: rank 0's state dict cannot be "
                                      f"loaded on {others}: ValueError: ")
    agree_on_every_rank(str(info.value))
    sums_agree()


def test_broadcast_optimizer_state_checks_its_arguments():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got dict"):
        broadcast_optimizer_state({}, 0)
    with pytest.raises(ValueError, match=rf"invalid root {SIZE}, root should be in the interval"):
        broadcast_optimizer_state(torch.optim.SGD(make_model().parameters(), lr=0.1), SIZE)
    sums_agree()


# -- misuse raised on the rank that made it, before anything collective ----------------------

# name -> (call on ``comm``, the error it raises, what its message says)
BAD_CALLS = {
    "reduce root=size": (lambda c: comm.reduce(torch.ones(4), SIZE, comm=c), ValueError,
                         rf"invalid root {SIZE}, root should be in the interval \[0, {SIZE - 1}\]"),
    "ireduce op=mean": (lambda c: comm.ireduce(torch.ones(4), 0, "mean", comm=c), ValueError,
                        "op must be one of sum, avg, min, max, prod, band, bor, bxor, got 'mean'"),
    "reduce avg of int": (lambda c: comm.reduce(torch.ones(4, dtype=torch.int32), 0, "avg", comm=c),
                          TypeError, "op 'avg' needs a floating-point dtype, got torch.int32"),
    "reduce into an expanded tensor": (
        lambda c: comm.reduce(torch.zeros(1).expand(4), 0, comm=c), ValueError,
        r"tensor has elements that share memory \(strides \(0,\) for shape \(4,\)\) and cannot "
        r"receive a result; pass a tensor of its own, such as tensor.clone\(\)"),
    "gather root=-1": (lambda c: comm.gather(torch.ones(4), None, -1, comm=c), ValueError,
                       r"invalid root -1, root should be in the interval"),
    "gather output 1 too long on the root": (
        lambda c: comm.gather(torch.ones(4), torch.empty(SIZE * 4 + 1), ODD, comm=c), ValueError,
        rf"output must have world size \({SIZE}\) x tensor.numel\(\) = {SIZE * 4} elements, "
        rf"got {SIZE * 4 + 1}"),
    "igather output of another dtype": (
        lambda c: comm.igather(torch.ones(4), torch.empty(SIZE * 4, dtype=torch.int64), ODD,
                               comm=c),
        TypeError, "output and tensor must have the same dtype, got torch.int64 and torch.float32"),
    "gather output on a sender": (
        lambda c: comm.gather(torch.ones(4), torch.empty(SIZE * 4), (ODD + 1) % SIZE, comm=c),
        ValueError, rf"output must be None on ranks other than the root \({(ODD + 1) % SIZE}\), "
                    rf"got a Tensor on rank {ODD}"),
    "scatter without tensor on the root": (
        lambda c: comm.scatter(torch.empty(4), None, ODD, comm=c), ValueError,
        rf"tensor is required on the root \(rank {ODD}\): world size \({SIZE}\) x "
        rf"output.numel\(\) elements to scatter"),
    "iscatter tensor on a sender": (
        lambda c: comm.iscatter(torch.empty(4), torch.ones(4 * SIZE), (ODD + 1) % SIZE, comm=c),
        ValueError, r"tensor must be None on ranks other than the root"),
    "scatter tensor 1 too short": (
        lambda c: comm.scatter(torch.empty(4), torch.ones(4 * SIZE - 1), ODD, comm=c), ValueError,
        rf"tensor must have world size \({SIZE}\) x output.numel\(\) = {4 * SIZE} elements"),
    "alltoall sizes differ": (
        lambda c: comm.alltoall(torch.empty(2 * SIZE), torch.ones(2 * SIZE + 1), comm=c),
        ValueError, rf"without splits, output and tensor must have the same number of elements, "
                    rf"divisible by the world size \({SIZE}\), got {2 * SIZE} and {2 * SIZE + 1}"),
    "alltoall of another dtype": (
        lambda c: comm.alltoall(torch.empty(SIZE, dtype=torch.int32), torch.ones(SIZE), comm=c),
        TypeError, "output and tensor must have the same dtype, got torch.int32 and torch.float32"),
    "alltoall splits too short": (
        lambda c: comm.alltoall(torch.empty(SIZE), torch.ones(SIZE), [1] * (SIZE - 1), [1] * SIZE,
                                comm=c),
        ValueError, rf"output_splits must be a list of world size \({SIZE}\) row counts, got"),
    "alltoall splits that do not add up": (
        lambda c: comm.alltoall(torch.empty(SIZE), torch.ones(SIZE), [1] * SIZE,
                                [2] + [1] * (SIZE - 1), comm=c),
        ValueError, rf"input_splits must add up to the first dimension \({SIZE}\), got "
                    rf"\[2(, 1)*\] \(sum {SIZE + 1}\)"),
    "ialltoall negative split": (
        lambda c: comm.ialltoall(torch.empty(SIZE), torch.ones(SIZE), [1] * SIZE,
                                 [2, -1] + [1] * (SIZE - 2) if SIZE > 1 else [-1], comm=c),
        ValueError, r"input_splits must hold ints >= 0, got \[.*-1.*\]"),
    "alltoall None side not divisible": (
        lambda c: comm.alltoall(torch.empty(SIZE + 1), torch.ones(SIZE), None, [1] * SIZE,
                                comm=c),
        ValueError, rf"output_splits is None, so the first dimension must divide by the world "
                    rf"size \({SIZE}\), got {SIZE + 1}"),
    "alltoall rows of different sizes": (
        lambda c: comm.alltoall(torch.empty(SIZE, 3), torch.ones(SIZE, 2), [1] * SIZE,
                                [1] * SIZE, comm=c),
        ValueError, r"output and tensor must have rows \(all dimensions but the first\) of the "
                    r"same number of elements, got 3 and 2"),
    "alltoall splits of a 0-d tensor": (
        lambda c: comm.alltoall(torch.empty(1), torch.tensor(1.0), [1] + [0] * (SIZE - 1),
                                None, comm=c),
        ValueError, "tensor must have at least one dimension to split into rows, got a 0-d tensor"),
    "allgatherv of a 0-d tensor": (
        lambda c: comm.allgatherv(torch.tensor(1.0), comm=c), ValueError,
        "tensor must have at least one dimension to split into rows"),
    "iallgatherv requiring grad": (
        lambda c: comm.iallgatherv(torch.ones(2, requires_grad=True), comm=c), ValueError,
        r"tensor requires grad; communicate tensor.detach\(\) instead"),
    "allreduce of an expanded tensor": (
        lambda c: comm.allreduce(torch.zeros(2, 1).expand(2, 3), comm=c), ValueError,
        "tensor has elements that share memory"),
    "recv into an expanded tensor": (
        lambda c: comm.recv(torch.zeros(1).expand(3), comm=c), ValueError,
        "tensor has elements that share memory"),
    "broadcast_object root=size": (
        lambda c: broadcast_object("x", SIZE, comm=c), ValueError,
        rf"invalid root {SIZE}, root should be in the interval"),
    "average on a string comm": (lambda c: average(1.0, comm="world"), TypeError,
                                 "comm must be None, an mpidp.comm.Pool or an mpi4py Intracomm"),
}
# a sender other than the root, or a size that does not divide by the world size
NEEDS_TWO = {"gather output on a sender", "iscatter tensor on a sender",
             "alltoall None side not divisible"}


@pytest.mark.parametrize("debug_mode", [False, True], ids=["debug off", "debug on"])
@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_a_rank_that_catches_an_argument_error_stays_in_step(name, target, debug_mode,
                                                             monkeypatch):
    if name in NEEDS_TWO and SIZE < 2:
        pytest.skip("needs two ranks")
    monkeypatch.setattr(comm.checks, "_DEBUG", debug_mode)
    call, error, message = BAD_CALLS[name]
    in_flight = len(comm._in_flight)
    if RANK == ODD:
        with pytest.raises(error, match=message):
            call(target)
    assert len(comm._in_flight) == in_flight  # nothing was started
    sums_agree(target)
    sums_agree()


# -- faults that span ranks: the same error on every rank ------------------------------------

@pytest.fixture
def no_debug(monkeypatch):
    """The checks every call makes, not MPIDP_DEBUG's fingerprint, which would see some first."""
    monkeypatch.setattr(comm.checks, "_DEBUG", False)


@needs_two
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_alltoall_splits_that_disagree_are_an_error_on_every_rank(target, nonblocking):
    # every rank sends one row to each; rank ODD expects two from rank 0 and none from itself
    output_splits = [1] * SIZE
    if RANK == ODD:
        output_splits[0], output_splits[ODD] = 2, 0
    call = comm.ialltoall if nonblocking else comm.alltoall
    with pytest.raises(ValueError) as info:
        call(torch.empty(SIZE, 2), torch.ones(SIZE, 2), output_splits, [1] * SIZE, comm=target)
    assert str(info.value) == (
        f"alltoall splits disagree across ranks: rank 0's input_splits[{ODD}] is 1, rank {ODD}'s "
        f"output_splits[0] is 2; rank {ODD}'s input_splits[{ODD}] is 1, rank {ODD}'s "
        f"output_splits[{ODD}] is 0; each rank's output_splits[j] must equal rank j's "
        f"input_splits[rank], of rows with the same number of elements and dtype")
    agree_on_every_rank(str(info.value))
    sums_agree(target)


@needs_two
def test_alltoall_rows_that_disagree_are_an_error_on_every_rank(no_debug):
    dtype = torch.float64 if RANK == ODD else torch.float32
    with pytest.raises(ValueError) as info:
        comm.alltoall(torch.empty(SIZE, 2, dtype=dtype), torch.ones(SIZE, 2, dtype=dtype),
                      [1] * SIZE, [1] * SIZE)
    assert str(info.value).startswith(
        f"alltoall splits disagree across ranks: rank {ODD} sends rows of 2 elements of float64, "
        f"rank 0 receives rows of 2 elements of float32")
    agree_on_every_rank(str(info.value))
    sums_agree()


@needs_two
def test_allgatherv_of_rows_that_differ_is_an_error_on_every_rank(target, no_debug):
    tensor = torch.ones(2, 3 if RANK == ODD else 2)
    with pytest.raises(ValueError) as info:
        comm.allgatherv(tensor, comm=target)
    assert str(info.value) == (f"allgatherv: tensors must have the same dtype and the same shape "
                               f"after the first dimension on every rank, got {OTHERS}: rows of "
                               f"shape (2,), float32; rank {ODD}: rows of shape (3,), float32")
    agree_on_every_rank(str(info.value))
    with pytest.raises(ValueError, match=r"rank \d: rows of shape \(\), (uint8|int64)"):
        comm.iallgatherv(torch.ones(3, dtype=torch.uint8 if RANK == ODD else torch.int64),
                         comm=target)
    sums_agree(target)


# -- MPIDP_DEBUG fingerprints of the new collectives -----------------------------------------

def raises_the_same_everywhere(call, expected: str) -> None:
    with pytest.raises(ValueError, match="collective calls differ across ranks") as info:
        call()
    assert str(info.value) == (f"collective calls differ across ranks: {expected}; every rank "
                               f"must make the same collective calls, with the same op, root, "
                               f"dtype and element count, in the same order")
    agree_on_every_rank(str(info.value))
    sums_agree()


@pytest.fixture
def debug(monkeypatch):
    monkeypatch.setattr(comm.checks, "_DEBUG", True)


@needs_two
def test_debug_reduce_to_different_roots(debug):
    root = ODD if RANK == ODD else 0
    raises_the_same_everywhere(lambda: comm.reduce(torch.ones(4), root, "max"),
                               f"{OTHERS} called reduce(op='max', root=0, dtype=float32, "
                               f"numel=4); rank {ODD} called reduce(op='max', root={ODD}, "
                               f"dtype=float32, numel=4)")


@needs_two
def test_debug_gather_against_scatter(debug):
    if RANK == ODD:
        call = lambda: comm.scatter(torch.empty(2), None, 0)  # noqa: E731
    else:
        call = lambda: comm.igather(torch.ones(2), torch.empty(2 * SIZE) if RANK == 0 else None,  # noqa: E731
                                    0).wait()
    raises_the_same_everywhere(call, f"{OTHERS} called igather(root=0, dtype=float32, numel=2); "
                                     f"rank {ODD} called scatter(root=0, dtype=float32, numel=2)")


@needs_two
def test_debug_alltoall_equal_against_uneven(debug):
    splits = [1] * SIZE if RANK == ODD else None
    raises_the_same_everywhere(
        lambda: comm.alltoall(torch.empty(SIZE), torch.ones(SIZE), splits, splits),
        f"{OTHERS} called alltoall(dtype=float32, numel={SIZE}); rank {ODD} called "
        f"alltoall(dtype=float32, splits=uneven, row_numel=1)")


@needs_two
def test_debug_allgatherv_against_broadcast_object(debug):
    if RANK == ODD:
        call = lambda: broadcast_object("x", 0)  # noqa: E731
    else:
        call = lambda: comm.allgatherv(torch.ones(RANK, 2))  # noqa: E731
    raises_the_same_everywhere(call, f"{OTHERS} called allgatherv(dtype=float32, row_shape=(2,)); "
                                     f"rank {ODD} called broadcast_object(root=0)")


@needs_two
def test_debug_average_against_allgather_object(debug):
    call = (lambda: allgather_object(1)) if RANK == ODD else (lambda: average(1.0))
    raises_the_same_everywhere(call, f"{OTHERS} called average(); rank {ODD} called "
                                     f"allgather_object()")


def test_debug_matched_calls_give_the_right_results(debug, target):
    tensor = torch.full((3,), float(RANK + 1))
    comm.reduce(tensor, ODD, "prod", comm=target)
    if RANK == ODD:
        assert torch.equal(tensor, torch.full((3,), float(np.prod(np.arange(1, SIZE + 1)))))
    gathered = comm.gather(torch.full((2,), float(RANK)), None, 0, comm=target)
    if RANK == 0:
        assert torch.equal(gathered, torch.arange(SIZE, dtype=torch.float32)[:, None].expand(SIZE, 2))
    output = comm.scatter(torch.empty(1), torch.arange(float(SIZE)) if RANK == 0 else None, 0,
                          comm=target)
    assert output.item() == RANK
    output = comm.alltoall(torch.empty(SIZE), torch.full((SIZE,), float(RANK)), [1] * SIZE,
                           [1] * SIZE, comm=target)
    assert torch.equal(output, torch.arange(float(SIZE)))
    rows, sizes = comm.allgatherv(torch.full((RANK,), RANK), comm=target)
    assert sizes == list(range(SIZE)) and rows.tolist() == [r for r in range(SIZE) for _ in range(r)]
    assert broadcast_object(RANK, ODD, comm=target) == ODD
    assert allgather_object(RANK, comm=target) == list(range(SIZE))
    assert average(RANK, comm=target) == (SIZE - 1) / 2
    sums_agree(target)
