"""Collectives of equal blocks on every rank: allreduce, broadcast, allgather, reduce_scatter,
reduce, gather, scatter, and barrier.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from . import checks as _checks
from . import chunking as _chunking
from .checks import _check_root, _check_same_call, _check_tensor, _overlap
from .dtypes import _buffer, _check_op, _dtype_name, _reduction
from .handle import Handle, _start
from .pool import _base, _collective_comm
from .staging import _chain, _stage

__all__ = [
    "allreduce", "iallreduce", "broadcast", "ibroadcast", "allgather", "iallgather",
    "reduce_scatter", "ireduce_scatter", "reduce", "ireduce", "gather", "igather",
    "scatter", "iscatter", "barrier", "ibarrier",
]


def _avg(tensor: torch.Tensor, op: str, size: int):
    return (lambda: _chunking.mean_of_sum(tensor, size)) if op == "avg" and size > 1 else None


def _allreduce(tensor, op, comm, nonblocking, debug=True):
    """``debug=False``: no MPIDP_DEBUG check (a chunk of a call whose whole was checked)."""
    _check_tensor("tensor", tensor, written=True)
    _check_op(op, tensor.dtype)
    comm = _collective_comm(comm)
    if debug and _checks._DEBUG:
        _check_same_call(comm, "allreduce", nonblocking, op=repr(op),
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    reduction, native = _reduction(tensor.dtype, op)
    (staged,), _, copy_back = _stage((tensor,), (tensor,),
                                     host_only=not native, nonblocking=nonblocking)
    args = (MPI.IN_PLACE, _buffer(staged), reduction)
    return _start(comm, "Allreduce", args, (tensor, staged), tensor,
                  _chain(_avg(staged, op, comm.Get_size()), copy_back), nonblocking,
                  ("allreduce", tensor, "op", op))


def allreduce(tensor: torch.Tensor, op: str = "sum", *, comm=None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place.

    Args:
        tensor: overwritten with the result on every rank.
        op: one of ``OPS``: "sum", "avg", "min", "max", "prod", "band", "bor", "bxor".
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``tensor``.
    """
    return _allreduce(tensor, op, comm, False)


def iallreduce(tensor: torch.Tensor, op: str = "sum", *, comm=None) -> Handle:
    """Start ``allreduce`` without blocking; returns a ``Handle`` whose ``wait()`` gives ``tensor``."""
    return _allreduce(tensor, op, comm, True)


def _broadcast(tensor, root, comm, nonblocking):
    _check_tensor("tensor", tensor, written=True)
    _check_root(root, _base(comm))
    comm = _collective_comm(comm)
    if _checks._DEBUG:
        _check_same_call(comm, "broadcast", nonblocking, root=root,
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    (staged,), _, copy_back = _stage((tensor,), (tensor,), nonblocking=nonblocking)
    return _start(comm, "Bcast", (_buffer(staged), root), (tensor, staged), tensor, copy_back,
                  nonblocking, ("broadcast", tensor, "root", root))



def broadcast(tensor: torch.Tensor, root: int = 0, *, comm=None) -> torch.Tensor:
    """Copy ``tensor`` from rank ``root`` into ``tensor`` on every other rank; returns it."""
    return _broadcast(tensor, root, comm, False)


def ibroadcast(tensor: torch.Tensor, root: int = 0, *, comm=None) -> Handle:
    """Start ``broadcast`` without blocking."""
    return _broadcast(tensor, root, comm, True)


def _check_scaled(big_name, big, small_name, small, size: int) -> None:
    if big.dtype != small.dtype:
        raise TypeError(f"{big_name} and {small_name} must have the same dtype, "
                        f"got {big.dtype} and {small.dtype}")
    if big.numel() != size * small.numel():
        raise ValueError(f"{big_name} must have world size ({size}) x {small_name}.numel() "
                         f"= {size * small.numel()} elements, got {big.numel()}")


def _allgather(output, tensor, comm, nonblocking):
    _check_tensor("output", output, written=True)
    _check_tensor("tensor", tensor)
    _check_scaled("output", output, "tensor", tensor, _base(comm).Get_size())
    comm = _collective_comm(comm)
    if _checks._DEBUG:
        _check_same_call(comm, "allgather", nonblocking,
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    if _is_rank_block(tensor, output, comm.Get_rank()):
        # In place (FSDP's all-gather does it): MPI forbids aliased buffers but for MPI_IN_PLACE.
        (received,), _, copy_back = _stage((output,), (output,), nonblocking=nonblocking)
        args = (MPI.IN_PLACE, _buffer(received, tensor.numel()))
        return _start(comm, "Allgather", args, (output, tensor, received), output, copy_back,
                      nonblocking, ("allgather", tensor))
    if _overlap(tensor, output):
        tensor = tensor.clone()
    (sent,), (received,), copy_back = _stage((tensor,), (output,), nonblocking=nonblocking)
    # mpi4py counts the receive buffer per rank, like the send buffer.
    args = (_buffer(sent), _buffer(received, tensor.numel()))
    return _start(comm, "Allgather", args, (output, tensor, sent, received),
                  output, copy_back, nonblocking, ("allgather", tensor))



def _is_rank_block(tensor: torch.Tensor, output: torch.Tensor, rank: int) -> bool:
    return (tensor.device == output.device and tensor.is_contiguous() and output.is_contiguous()
            and tensor.numel() > 0
            and tensor.data_ptr() == output.data_ptr() + rank * tensor.nbytes)


def allgather(output: torch.Tensor, tensor: torch.Tensor, *, comm=None) -> torch.Tensor:
    """Gather ``tensor`` from every rank into ``output``, rank by rank along the flat order.

    ``tensor`` may be this rank's block of ``output`` (an in-place all-gather).

    Args:
        output: tensor of ``world size * tensor.numel()`` elements.
        tensor: this rank's contribution.
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``output``.
    """
    return _allgather(output, tensor, comm, False)


def iallgather(output: torch.Tensor, tensor: torch.Tensor, *, comm=None) -> Handle:
    """Start ``allgather`` without blocking."""
    return _allgather(output, tensor, comm, True)


def _reduce_scatter(output, tensor, op, comm, nonblocking):
    _check_tensor("output", output, written=True)
    _check_tensor("tensor", tensor)
    _check_op(op, tensor.dtype)
    _check_scaled("tensor", tensor, "output", output, _base(comm).Get_size())
    comm = _collective_comm(comm)
    if _checks._DEBUG:
        _check_same_call(comm, "reduce_scatter", nonblocking, op=repr(op),
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    reduction, native = _reduction(tensor.dtype, op)
    (sent,), (received,), copy_back = _stage((tensor,), (output,),
                                             host_only=not native, nonblocking=nonblocking)
    # mpi4py counts the send buffer per block, like the receive buffer.
    args = (_buffer(sent, output.numel()), _buffer(received), reduction)
    return _start(comm, "Reduce_scatter_block", args, (output, tensor, sent, received), output,
                  _chain(_avg(received, op, comm.Get_size()), copy_back), nonblocking,
                  ("reduce_scatter", tensor, "op", op))


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", *,
                   comm=None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks and leave block ``rank`` of the result in ``output``.

    Args:
        output: tensor of ``tensor.numel() / world size`` elements.
        tensor: this rank's input, ``world size`` equal blocks in flat order.
        op: one of ``OPS``: "sum", "avg", "min", "max", "prod", "band", "bor", "bxor".
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``output``.
    """
    return _reduce_scatter(output, tensor, op, comm, False)


def ireduce_scatter(output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", *,
                    comm=None) -> Handle:
    """Start ``reduce_scatter`` without blocking."""
    return _reduce_scatter(output, tensor, op, comm, True)


def _reduce(tensor, root, op, comm, nonblocking):
    _check_tensor("tensor", tensor, written=True)
    _check_op(op, tensor.dtype)
    _check_root(root, _base(comm))
    comm = _collective_comm(comm)
    if _checks._DEBUG:
        _check_same_call(comm, "reduce", nonblocking, op=repr(op), root=root,
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    reduction, native = _reduction(tensor.dtype, op)
    if comm.Get_rank() != root:  # sends only: its tensor is left as it was
        (staged,), _, _ = _stage((tensor,), (), host_only=not native, nonblocking=nonblocking)
        return _start(comm, "Reduce", (_buffer(staged), None, reduction, root), (tensor, staged),
                      tensor, None, nonblocking, ("reduce", tensor, "op", op, "root", root))
    (staged,), _, copy_back = _stage((tensor,), (tensor,),
                                     host_only=not native, nonblocking=nonblocking)
    args = (MPI.IN_PLACE, _buffer(staged), reduction, root)
    return _start(comm, "Reduce", args, (tensor, staged), tensor,
                  _chain(_avg(staged, op, comm.Get_size()), copy_back), nonblocking,
                  ("reduce", tensor, "op", op, "root", root))


def reduce(tensor: torch.Tensor, root: int = 0, op: str = "sum", *, comm=None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks into ``tensor`` on rank ``root``.

    Args:
        tensor: this rank's input; on ``root`` overwritten with the result, elsewhere
            left as it was.
        root: the rank that receives the result.
        op: one of ``OPS``: "sum", "avg", "min", "max", "prod", "band", "bor", "bxor".
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``tensor``.
    """
    return _reduce(tensor, root, op, comm, False)


def ireduce(tensor: torch.Tensor, root: int = 0, op: str = "sum", *, comm=None) -> Handle:
    """Start ``reduce`` without blocking."""
    return _reduce(tensor, root, op, comm, True)


def _root_only(name: str, value, root: int, base: MPI.Intracomm) -> None:
    if value is not None:
        raise ValueError(f"{name} must be None on ranks other than the root ({root}), got a "
                         f"{type(value).__name__} on rank {base.Get_rank()}")


def _gather(tensor, output, root, comm, nonblocking):
    _check_tensor("tensor", tensor)
    base = _base(comm)
    _check_root(root, base)
    is_root = base.Get_rank() == root
    if not is_root:
        _root_only("output", output, root, base)
    elif output is not None:
        _check_tensor("output", output, written=True)
        _check_scaled("output", output, "tensor", tensor, base.Get_size())
    comm = _collective_comm(comm)
    if _checks._DEBUG:
        _check_same_call(comm, "gather", nonblocking, root=root,
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    if not is_root:
        (sent,), _, _ = _stage((tensor,), (), nonblocking=nonblocking)
        return _start(comm, "Gather", (_buffer(sent), None, root), (tensor, sent), None, None,
                      nonblocking, ("gather", tensor, "root", root))
    if output is None:
        output = tensor.new_empty((comm.Get_size(), *tensor.shape))
    (sent,), (received,), copy_back = _stage((tensor,), (output,), nonblocking=nonblocking)
    args = (_buffer(sent), _buffer(received, tensor.numel()), root)
    return _start(comm, "Gather", args, (output, tensor, sent, received), output, copy_back,
                  nonblocking, ("gather", tensor, "root", root))


def gather(tensor: torch.Tensor, output: torch.Tensor | None = None, root: int = 0, *,
           comm=None) -> torch.Tensor | None:
    """Gather ``tensor`` from every rank into ``output`` on rank ``root``, rank by rank.

    Args:
        tensor: this rank's contribution (the same number of elements on every rank).
        output: on ``root``, a tensor of ``world size * tensor.numel()`` elements, or None
            for a new one of shape ``(world size, *tensor.shape)``; None on every other rank.
        root: the rank that receives.
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``output`` on ``root``, None elsewhere.
    """
    return _gather(tensor, output, root, comm, False)


def igather(tensor: torch.Tensor, output: torch.Tensor | None = None, root: int = 0, *,
            comm=None) -> Handle:
    """Start ``gather`` without blocking; ``wait()`` returns ``output`` on ``root``, else None."""
    return _gather(tensor, output, root, comm, True)


def _scatter(output, tensor, root, comm, nonblocking):
    _check_tensor("output", output, written=True)
    base = _base(comm)
    _check_root(root, base)
    is_root = base.Get_rank() == root
    if not is_root:
        _root_only("tensor", tensor, root, base)
    elif tensor is None:
        raise ValueError(f"tensor is required on the root (rank {root}): world size "
                         f"({base.Get_size()}) x output.numel() elements to scatter")
    else:
        _check_tensor("tensor", tensor)
        _check_scaled("tensor", tensor, "output", output, base.Get_size())
    comm = _collective_comm(comm)
    if _checks._DEBUG:
        _check_same_call(comm, "scatter", nonblocking, root=root,
                         dtype=_dtype_name(output.dtype), numel=output.numel())
    if not is_root:
        _, (received,), copy_back = _stage((), (output,), nonblocking=nonblocking)
        return _start(comm, "Scatter", (None, _buffer(received), root), (output, received),
                      output, copy_back, nonblocking, ("scatter", output, "root", root))
    (sent,), (received,), copy_back = _stage((tensor,), (output,), nonblocking=nonblocking)
    args = (_buffer(sent, output.numel()), _buffer(received), root)
    return _start(comm, "Scatter", args, (output, tensor, sent, received), output, copy_back,
                  nonblocking, ("scatter", output, "root", root))


def scatter(output: torch.Tensor, tensor: torch.Tensor | None = None, root: int = 0, *,
            comm=None) -> torch.Tensor:
    """Give block ``rank`` of ``tensor`` on rank ``root`` to every rank's ``output``.

    Args:
        output: receives this rank's block (the same number of elements on every rank).
        tensor: on ``root``, ``world size`` blocks of ``output.numel()`` elements in flat
            order; None on every other rank.
        root: the rank that sends.
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``output``.
    """
    return _scatter(output, tensor, root, comm, False)


def iscatter(output: torch.Tensor, tensor: torch.Tensor | None = None, root: int = 0, *,
             comm=None) -> Handle:
    """Start ``scatter`` without blocking."""
    return _scatter(output, tensor, root, comm, True)


def _barrier_comm(comm, nonblocking: bool) -> MPI.Intracomm:
    comm = _collective_comm(comm)
    if _checks._DEBUG:
        _check_same_call(comm, "barrier", nonblocking)
    return comm


def barrier(*, comm=None) -> None:
    """Block until every rank of ``comm`` has entered the barrier."""
    _start(_barrier_comm(comm, False), "Barrier", (), (), None, None, False, ("barrier", None))


def ibarrier(*, comm=None) -> Handle:
    """Start a barrier without blocking."""
    return _start(_barrier_comm(comm, True), "Barrier", (), (), None, None, True, ("barrier", None))
