"""Horovod's other collectives: ``allgather``, ``broadcast``, ``alltoall``, ``barrier``, objects.

Each starts through ``requests`` (so joined ranks can serve it, see there)
on the process set's data communicator, with ``mpidp.comm``'s nonblocking
collectives: ``iallgatherv`` (first dimensions may differ by rank),
``ibroadcast``, ``ialltoall`` with splits. The object collectives are
``mpidp.objects``'. The out-of-place forms are differentiable, with Horovod
0.28's gradients (allgather and broadcast average the gradients over the set).
A ``root_rank`` is a rank of ``hvd.init``'s communicator, in the process set
given, as in Horovod.
"""

from __future__ import annotations

import torch

from ..comm.handle import collective
from .. import _args
from .. import comm as _comm
from .. import objects as _objects
from ..comm.checks import _check_tensor
from . import process_sets as _sets
from . import requests as _requests
from .reductions import Average, Sum, _check_name, allreduce, grouped_allreduce, process_set_of

__all__ = ["allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
           "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
           "alltoall_async", "barrier", "broadcast_object", "allgather_object",
           "sparse_allreduce_async"]


def _check_rows(tensor, name, purpose: str) -> None:
    """Check a tensor of rows and its call (within ``_requests.checking``)."""
    _check_name(name)
    _check_tensor("tensor", _requests.wrap_tensor(tensor))
    if tensor.dim() == 0:
        raise ValueError(f"tensor must have at least one dimension to {purpose}, got 0-d")


def _begin_allgather(tensor, name, process_set) -> _requests.Request:
    process_set = process_set_of(process_set)
    with _requests.checking(process_set, _requests.ALLGATHER):
        _check_rows(tensor, name, "concatenate along")
    tensor = _requests.wrap_tensor(tensor)
    started = []

    def launch():
        started.append(_comm.iallgatherv(tensor, comm=process_set.data))
        return started

    return _requests.begin(process_set, _requests.ALLGATHER, launch, lambda: started[0].wait(),
                           keep=(tensor,), name=name, nbytes=tensor.nbytes, dtype=tensor.dtype,
                           shape=tuple(tensor.shape[1:]))


def _rows_only(request: _requests.Request) -> _requests.Request:
    finish = request.finish
    request.finish = lambda: finish()[0]
    return request


def allgather_async(tensor, name=None, process_set=_sets.global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along the first dimension; returns a handle.

    Args:
        tensor: this rank's rows; the first dimension may differ by rank, the others
            and the dtype may not.
        name: a label for the timeline.
        process_set: the ranks to gather from (default: all).
    """
    return _requests.register(_rows_only(_begin_allgather(tensor, name, process_set)))


def _grouped_begin(tensors, name, process_set) -> _requests.Request:
    """Allgathers of each tensor of a list, as one request; its result: [(rows, sizes), ...]."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"tensors must be a non-empty list of tensors, got {tensors!r}")
    parts = [_begin_allgather(t, name, process_set) for t in tensors]
    results = [None] * len(parts)
    for k, part in enumerate(parts):  # waiting for the group waits for each part, once
        part.finish = lambda k=k, finish=part.finish: results.__setitem__(k, finish())
    return _requests.Request(parts, lambda: results, (), _requests.ALLGATHER, name,
                             process_set_of(process_set), 0)


class _Allgather(torch.autograd.Function):
    """Horovod 0.28's gradient of a rank's rows: the average over the set of the gradient there.

    One tensor or a group; no tensor is saved, so each output may be backpropagated
    on its own, as in Horovod.
    """

    @staticmethod
    def forward(ctx, process_set, name, *tensors):
        gathered = _requests.synchronize(_requests.register(
            _grouped_begin(list(tensors), name, process_set)))
        rank = process_set.data.Get_rank()
        ctx.rows = [(sum(sizes[:rank]), sizes[rank]) for _, sizes in gathered]
        ctx.process_set = process_set
        return tuple(output for output, _ in gathered)

    @staticmethod
    def backward(ctx, *grads):
        averaged = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        return (None, None) + tuple(g.narrow(0, *rows) for g, rows in zip(averaged, ctx.rows))


def _differentiable(tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors)


def allgather(tensor, name=None, process_set=_sets.global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension (differentiable).

    Returns:
        A new tensor: every rank's rows in rank order.
    """
    if _differentiable([tensor]):
        return _Allgather.apply(process_set_of(process_set), name, tensor)[0]
    return _requests.synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=_sets.global_process_set) -> int:
    """Start an allgather of each tensor of a list; ``synchronize`` returns the list of results."""
    request = _grouped_begin(tensors, name, process_set)
    finish = request.finish
    request.finish = lambda: [rows for rows, _ in finish()]
    return _requests.register(request)


def grouped_allgather(tensors, name=None, process_set=_sets.global_process_set) -> list:
    """Allgather each tensor of a list; returns the list of results (differentiable)."""
    if isinstance(tensors, (list, tuple)) and tensors and _differentiable(tensors):
        return list(_Allgather.apply(process_set_of(process_set), name, *tensors))
    return _requests.synchronize(grouped_allgather_async(tensors, name, process_set))


def root_in_set(process_set: _sets.ProcessSet, root_rank) -> int:
    """The rank in ``process_set`` of ``root_rank``, a rank of ``hvd.init``'s communicator."""
    if process_set is _sets.global_process_set:
        _args.check_rank("root_rank", root_rank, process_set.data.Get_size())
        return root_rank
    if not _args.is_int(root_rank) or root_rank not in process_set.ranks:
        raise ValueError(f"invalid root_rank {root_rank!r}, root_rank should be one of the ranks "
                         f"of the process set {process_set.ranks} (ranks of hvd.init's "
                         f"communicator, as in Horovod)")
    return process_set.ranks.index(root_rank)


def _begin_broadcast(tensor, inplace: bool, root_rank, name, process_set) -> int:
    process_set = process_set_of(process_set)
    with _requests.checking(process_set, _requests.BROADCAST):
        _check_name(name)
        _check_tensor("tensor", _requests.wrap_tensor(tensor), written=inplace)
        root_rank = root_in_set(process_set, root_rank)
    tensor = _requests.wrap_tensor(tensor)
    output = tensor if inplace else tensor.clone(memory_format=torch.contiguous_format)

    def launch():
        return [_comm.ibroadcast(output, root_rank, comm=process_set.data)]

    return _requests.register(_requests.begin(
        process_set, _requests.BROADCAST, launch, lambda: output, keep=(tensor, output),
        name=name, nbytes=output.nbytes, dtype=output.dtype, root=root_rank,
        shape=tuple(output.shape) if output.dim() <= 8 else (output.numel(),)))


def broadcast_async(tensor, root_rank, name=None, process_set=_sets.global_process_set) -> int:
    """Start copying rank ``root_rank``'s ``tensor`` into a new tensor on every rank; a handle.

    Args:
        tensor: the value on ``root_rank``; the same shape and dtype elsewhere.
        root_rank: the sending rank (of ``hvd.init``'s communicator; in the process set).
        name: a label for the timeline.
        process_set: the ranks to broadcast to (default: all).
    """
    return _begin_broadcast(tensor, False, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=_sets.global_process_set) -> int:
    """``broadcast_async`` that writes into ``tensor`` itself."""
    return _begin_broadcast(tensor, True, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=_sets.global_process_set):
    """Copy rank ``root_rank``'s ``tensor`` into ``tensor`` on every rank; returns it."""
    _requests.synchronize(broadcast_async_(tensor, root_rank, name, process_set))
    return tensor


class _Broadcast(torch.autograd.Function):
    """Only the root's input reaches the output: Horovod 0.28 gives it the average of the gradients."""

    @staticmethod
    def forward(ctx, tensor, root_rank, process_set, name):
        ctx.root, ctx.process_set = root_rank, process_set
        return _requests.synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        averaged = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if ctx.process_set.rank() != root_in_set(ctx.process_set, ctx.root):
            averaged.zero_()
        return averaged, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=_sets.global_process_set) -> torch.Tensor:
    """Return rank ``root_rank``'s ``tensor`` on every rank, as a new tensor (differentiable)."""
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, process_set, name)
    return _requests.synchronize(broadcast_async(tensor, root_rank, name, process_set))


def _splits_list(splits, rows: int, size: int) -> list[int]:
    if splits is None:
        if rows % size:
            raise ValueError(f"splits is None, so the first dimension must divide by the "
                             f"process set's size ({size}), got {rows}")
        return [rows // size] * size
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dim() != 1:
            raise ValueError(f"splits must be a 1-d integer tensor or a list of ints, "
                             f"got {splits.dtype} of shape {tuple(splits.shape)}")
        splits = splits.tolist()
    splits = list(splits)
    if len(splits) != size or not all(_args.is_int(n) and n >= 0 for n in splits) \
            or sum(splits) != rows:
        raise ValueError(f"splits must hold {size} ints >= 0 (one per rank of the process set) "
                         f"adding up to the first dimension ({rows}), got {splits}")
    return splits


def alltoall_async(tensor, splits=None, name=None, process_set=_sets.global_process_set) -> int:
    """Start sending ``splits[j]`` rows of ``tensor`` to rank ``j``; returns a handle.

    Args:
        tensor: the rows to send, rank by rank, at least one dimension.
        splits: rows for each rank of the process set (a list or a 1-d int tensor), or
            None for equal parts.
        name: a label for the timeline.
        process_set: the ranks to exchange with (default: all).

    Returns:
        A handle; ``synchronize`` returns ``(output, received_splits)``, the rows
        received from each rank (an int32 tensor), as in Horovod.
    """
    process_set = process_set_of(process_set)
    with _requests.checking(process_set, _requests.ALLTOALL):
        _check_rows(tensor, name, "split into rows")
        sends = _splits_list(splits, tensor.shape[0], process_set.data.Get_size())
    device = splits.device if isinstance(splits, torch.Tensor) else "cpu"
    tensor = _requests.wrap_tensor(tensor)
    result = {}

    def launch():
        receives = collective(process_set.data, "alltoall", (sends,),
                              ("alltoall's splits exchange", tensor))
        output = tensor.new_empty((sum(receives), *tensor.shape[1:]))
        # on the splits' device, as in Horovod (a list of splits: the CPU)
        result["value"] = (output, torch.tensor(receives, dtype=torch.int32, device=device))
        # the splits were exchanged just above, and the negotiation compared the rows'
        # shape and dtype: the engine's splits check would exchange them a second time
        return [_comm.ialltoall(output, tensor, receives, sends, comm=process_set.data,
                                check_splits=False)]

    return _requests.register(_requests.begin(
        process_set, _requests.ALLTOALL, launch, lambda: result["value"], keep=(tensor,),
        name=name, nbytes=tensor.nbytes, dtype=tensor.dtype, shape=tuple(tensor.shape[1:])))


class _Alltoall(torch.autograd.Function):
    """The gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx, tensor, splits, process_set, name):
        output, received = _requests.synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, _):
        grad, _ = _requests.synchronize(alltoall_async(grad_output.contiguous(), ctx.received,
                                                       None, ctx.process_set))
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=_sets.global_process_set):
    """Exchange rows of ``tensor`` with every rank of the process set (differentiable).

    Returns:
        The received rows, rank by rank; with ``splits`` given,
        ``(output, received_splits)`` as in Horovod.
    """
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        output, received = _Alltoall.apply(tensor, splits, process_set, name)
    else:
        output, received = _requests.synchronize(alltoall_async(tensor, splits, name,
                                                                process_set))
    return output if splits is None else (output, received)


def barrier(process_set=_sets.global_process_set) -> None:
    """Block until every rank of the process set has called ``barrier``."""
    process_set = process_set_of(process_set)
    _requests.synchronize(_requests.register(_requests.begin(
        process_set, _requests.BARRIER, lambda: [_comm.ibarrier(comm=process_set.data)],
        lambda: None)))


def object_call(what: str, process_set, call, *, name=None, root=None):
    """Run ``call(comm, root)``, a collective of ``mpidp.objects``, as one of the set's collectives.

    Args:
        root: the rank ``call`` sends from, if any (of ``hvd.init``'s communicator), checked
            here on every rank; ``call`` gets its rank in the set.
    """
    process_set = process_set_of(process_set)
    with _requests.checking(process_set, _requests.OBJECT):
        _check_name(name)
        if root is not None:
            root = root_in_set(process_set, root)
    result = {}

    def launch():
        result["value"] = call(process_set.data, root)
        return []

    return _requests.synchronize(_requests.register(_requests.begin(
        process_set, _requests.OBJECT, launch, lambda: result["value"], name=name or what,
        root=-1 if root is None else root)))



def broadcast_object(obj, root_rank=0, name=None, process_set=_sets.global_process_set):
    """Return rank ``root_rank``'s ``obj`` on every rank of the process set (pickled)."""
    return object_call("broadcast_object", process_set,
                       lambda comm, root: _objects.broadcast_object(obj, root, comm=comm),
                       name=name, root=root_rank)


def allgather_object(obj, name=None, process_set=_sets.global_process_set) -> list:
    """Return every rank's ``obj``, in rank order, on every rank of the process set."""
    return object_call("allgather_object", process_set,
                       lambda comm, _: _objects.allgather_object(obj, comm=comm), name=name)


def sparse_allreduce_async(tensor, name, op, process_set=_sets.global_process_set):
    """Start reducing a sparse COO tensor over the process set; returns a function giving the result.

    As in Horovod, the reduction is an allgather of every rank's indices and values
    (a sum of sparse tensors concatenates their entries), divided by the set's size
    for ``hvd.Average``.

    Args:
        tensor: a sparse COO tensor, of the same size on every rank.
        name: a label (``None`` or a str); the two allgathers take ``name.indices`` and
            ``name.values``.
        op: ``hvd.Average`` or ``hvd.Sum``.

    Returns:
        A function of no arguments that waits and returns the reduced sparse tensor
        (its entries not coalesced), as Horovod's handle.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"tensor must be a sparse COO tensor, got {tensor!r:.80}")
    if op not in (Average, Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum for sparse_allreduce_async, got {op!r}")
    _check_name(name)
    label = (lambda part: None) if name is None else (lambda part: f"{name}.{part}")
    indices = allgather_async(tensor._indices().t().contiguous(), label("indices"), process_set)
    values = allgather_async(tensor._values().contiguous(), label("values"), process_set)
    size = process_set_of(process_set).size()

    def result() -> torch.Tensor:
        gathered = _requests.synchronize(values)
        at = _requests.synchronize(indices)
        if op == Average:
            gathered = gathered / size
        return torch.sparse_coo_tensor(at.t(), gathered, tensor.size(), check_invariants=False)

    return result
