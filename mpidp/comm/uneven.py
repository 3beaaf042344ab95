"""Collectives whose blocks may differ in size by rank: ``alltoall`` with splits, ``allgatherv``.

What one rank cannot check alone (``alltoall``'s splits against the senders',
``allgatherv``'s row shapes) is exchanged first, in small nonblocking steps that
the ``i``-forms too complete before they return (driven, never waited on, on the
progress thread), and a disagreement raises the same ``ValueError`` on every rank.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from mpi4py import MPI

from .. import _args
from . import agreement as _agreement
from . import checks as _checks
from .checks import _check_same_call, _check_tensor, _ranks
from .dtypes import _DTYPES, _buffer, _dtype_name, _vbuffer
from .handle import Handle, _start, collective
from .pool import _base, _collective_comm
from .staging import _stage

__all__ = ["alltoall", "ialltoall", "allgatherv", "iallgatherv"]


def _row_numel(name: str, tensor: torch.Tensor) -> int:
    if tensor.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension to split into rows, "
                         f"got a 0-d tensor")
    return math.prod(tensor.shape[1:])


def _rows_per_rank(name: str, splits, rows: int, size: int) -> list[int]:
    """Check ``splits`` (None: equal) against a tensor of ``rows`` rows; return rows per rank."""
    if splits is None:
        if rows % size:
            raise ValueError(f"{name} is None, so the first dimension must divide by the world "
                             f"size ({size}), got {rows}")
        return [rows // size] * size
    if not isinstance(splits, (list, tuple)) or len(splits) != size:
        raise ValueError(f"{name} must be a list of world size ({size}) row counts, got {splits!r}")
    if not all(_args.is_int(n) and n >= 0 for n in splits):
        raise ValueError(f"{name} must hold ints >= 0, got {list(splits)}")
    if sum(splits) != rows:
        raise ValueError(f"{name} must add up to the first dimension ({rows}), "
                         f"got {list(splits)} (sum {sum(splits)})")
    return list(splits)


def _check_splits_agree(comm: MPI.Intracomm, receives: list[int], sends: list[int],
                        row_numel: int, dtype: torch.dtype, label) -> None:
    """Check, on every rank alike, that each rank receives from each what the sender sends.

    MPI requires every receive count to equal the matching send count; a smaller
    one fails on the receiver alone, a larger one leaves garbage unnoticed. Each
    step is a ``handle.collective`` (driven, never waited on, on the progress
    thread); the whole table is gathered only when some rank found a fault.
    """
    code = _DTYPES.index(dtype)
    outgoing = np.array([[rows, row_numel, code] for rows in sends], dtype=np.int64)
    incoming = np.empty_like(outgoing)
    collective(comm, "Alltoall", ([outgoing, 3, MPI.INT64_T], [incoming, 3, MPI.INT64_T]), label)
    mismatched = any(peer_row_numel != row_numel or peer_code != code or rows != receives[peer]
                     for peer, (rows, peer_row_numel, peer_code) in enumerate(incoming.tolist()))
    if _agreement.any_failed(comm, mismatched, label):
        mine = np.array([*sends, *receives, row_numel, code], dtype=np.int64)
        _agreement.decide_rows(comm, mine, _splits_disagree, label)


def _splits_disagree(table: np.ndarray) -> ValueError:
    """The splits check's judge, once some rank found a fault: rows of each rank's sends,
    receives, row size and dtype code."""
    size = len(table)
    faults = []
    for rank, row in enumerate(table.tolist()):
        want, numel, kind = row[size:2 * size], row[2 * size], row[2 * size + 1]
        for peer, peer_row in enumerate(table.tolist()):
            rows, peer_numel, peer_kind = peer_row[rank], peer_row[2 * size], peer_row[2 * size + 1]
            if peer_numel != numel or peer_kind != kind:
                faults.append(f"rank {peer} sends rows of {peer_numel} elements of "
                              f"{_dtype_name(_DTYPES[peer_kind])}, rank {rank} receives "
                              f"rows of {numel} elements of {_dtype_name(_DTYPES[kind])}")
            elif rows != want[peer]:
                faults.append(f"rank {peer}'s input_splits[{rank}] is {rows}, rank {rank}'s "
                              f"output_splits[{peer}] is {want[peer]}")
    more = f" (and {len(faults) - 4} more)" if len(faults) > 4 else ""
    return ValueError(f"alltoall splits disagree across ranks: {'; '.join(faults[:4])}{more}; "
                      f"each rank's output_splits[j] must equal rank j's input_splits[rank], "
                      f"of rows with the same number of elements and dtype")


def _alltoall(output, tensor, output_splits, input_splits, comm, nonblocking, check_splits=True):
    _check_tensor("output", output, written=True)
    _check_tensor("tensor", tensor)
    if output.dtype != tensor.dtype:
        raise TypeError(f"output and tensor must have the same dtype, "
                        f"got {output.dtype} and {tensor.dtype}")
    size = _base(comm).Get_size()
    uneven = output_splits is not None or input_splits is not None
    if uneven:
        row_numel = _row_numel("tensor", tensor)
        if _row_numel("output", output) != row_numel:
            raise ValueError(f"output and tensor must have rows (all dimensions but the first) "
                             f"of the same number of elements, got {_row_numel('output', output)} "
                             f"and {row_numel}")
        receives = _rows_per_rank("output_splits", output_splits, output.shape[0], size)
        sends = _rows_per_rank("input_splits", input_splits, tensor.shape[0], size)
    elif output.numel() != tensor.numel() or tensor.numel() % size:
        raise ValueError(f"without splits, output and tensor must have the same number of "
                         f"elements, divisible by the world size ({size}), got "
                         f"{output.numel()} and {tensor.numel()}")
    comm = _collective_comm(comm)
    if _checks._DEBUG:
        shape = dict(splits="uneven", row_numel=row_numel) if uneven else dict(numel=tensor.numel())
        _check_same_call(comm, "alltoall", nonblocking, dtype=_dtype_name(tensor.dtype), **shape)
    if uneven and (check_splits or _checks._DEBUG):
        _check_splits_agree(comm, receives, sends, row_numel, tensor.dtype,
                            ("alltoall's splits check", tensor))
    (sent,), (received,), copy_back = _stage((tensor,), (output,), nonblocking=nonblocking)
    if uneven:
        args = (_vbuffer(sent, [n * row_numel for n in sends]),
                _vbuffer(received, [n * row_numel for n in receives]))
    else:  # mpi4py counts both buffers per rank
        args = (_buffer(sent, tensor.numel() // size), _buffer(received, tensor.numel() // size))
    return _start(comm, "Alltoallv" if uneven else "Alltoall", args,
                  (output, tensor, sent, received), output, copy_back, nonblocking,
                  ("alltoall", tensor))


def alltoall(output: torch.Tensor, tensor: torch.Tensor, output_splits=None, input_splits=None, *,
             comm=None, check_splits: bool = True) -> torch.Tensor:
    """Send block ``j`` of ``tensor`` to rank ``j``, receiving block ``j`` of ``output`` from it.

    Like torch's ``all_to_all_single``. Without splits, both tensors are world
    size equal blocks in flat order. With splits, blocks are rows (slices along
    the first dimension), and a None side is world size equal row blocks. The
    splits are checked across ranks before the exchange (a small alltoall and
    an allreduce, blocking even in ``ialltoall``): each rank's
    ``output_splits[j]`` must equal rank ``j``'s ``input_splits[rank]``, or
    every rank raises the same ``ValueError``.

    Args:
        output: receives the blocks, rank by rank.
        tensor: the blocks to send, rank by rank (same dtype as ``output``).
        output_splits: rows to receive from each rank, or None.
        input_splits: rows to send to each rank, or None.
        comm: None, a ``Pool`` or an mpi4py communicator.
        check_splits: False skips the check (not under ``MPIDP_DEBUG``) where
            every rank derived the splits from one table that all ranks agreed
            on (as ``DistributedDataParallel(reproducible=True)`` does each step).

    Returns:
        ``output``.
    """
    return _alltoall(output, tensor, output_splits, input_splits, comm, False, check_splits)


def ialltoall(output: torch.Tensor, tensor: torch.Tensor, output_splits=None, input_splits=None,
              *, comm=None, check_splits: bool = True) -> Handle:
    """Start ``alltoall`` without blocking (the splits check before it does block).

    ``check_splits`` as for ``alltoall``: False where each rank's ``output_splits``
    are the senders' ``input_splits``, exchanged already (Horovod's ``alltoall``).
    """
    return _alltoall(output, tensor, output_splits, input_splits, comm, True, check_splits)


def _allgatherv(tensor, comm, nonblocking):
    _check_tensor("tensor", tensor)
    row_shape = tuple(tensor.shape[1:])
    _row_numel("tensor", tensor)
    comm = _collective_comm(comm)
    dtype = _dtype_name(tensor.dtype)
    if _checks._DEBUG:
        _check_same_call(comm, "allgatherv", nonblocking, dtype=dtype, row_shape=row_shape)
    headers = _exchange_rows(comm, tensor, row_shape, ("allgatherv's shape exchange", tensor))
    kinds = [(shape, name) for _, shape, name in headers]
    if kinds.count(kinds[0]) != len(kinds):
        ranks_of: dict[tuple, list[int]] = {}
        for rank, kind in enumerate(kinds):
            ranks_of.setdefault(kind, []).append(rank)
        held = "; ".join(f"{_ranks(ranks)}: rows of shape {shape}, {name}"
                         for (shape, name), ranks in ranks_of.items())
        raise ValueError(f"allgatherv: tensors must have the same dtype and the same shape after "
                         f"the first dimension on every rank, got {held}")
    sizes = [rows for rows, _, _ in headers]
    output = tensor.new_empty((sum(sizes), *row_shape))
    row_numel = math.prod(row_shape)
    (sent,), (received,), copy_back = _stage((tensor,), (output,), nonblocking=nonblocking)
    args = (_buffer(sent), _vbuffer(received, [rows * row_numel for rows in sizes]))
    return _start(comm, "Allgatherv", args, (output, tensor, sent, received), (output, sizes),
                  copy_back, nonblocking, ("allgatherv", tensor))


def _exchange_rows(comm: MPI.Intracomm, tensor: torch.Tensor, row_shape: tuple, label) -> list:
    """Every rank's (rows, row shape, dtype name), in fixed-size nonblocking steps.

    The first step gathers the row counts, dtypes and a digest of the row shapes;
    only where those differ does a second step gather the shapes themselves.
    """
    digest = int.from_bytes(hashlib.blake2b(repr(row_shape).encode(), digest_size=7).digest(),
                            "little")
    mine = np.array([tensor.shape[0], _DTYPES.index(tensor.dtype), len(row_shape), digest],
                    dtype=np.int64)
    every = _agreement.gather_rows(comm, mine, label)
    shapes = [row_shape] * len(every)
    if len(set(map(tuple, every[:, 2:].tolist()))) > 1:  # the same on every rank
        width = max(1, int(every[:, 2].max()))
        padded = np.zeros(width, dtype=np.int64)
        padded[:len(row_shape)] = row_shape
        table = _agreement.gather_rows(comm, padded, label)
        shapes = [tuple(table[r, :int(every[r, 2])].tolist()) for r in range(len(every))]
    return [(int(rows), shape, _dtype_name(_DTYPES[int(code)]))
            for (rows, code, _, _), shape in zip(every.tolist(), shapes)]


def allgatherv(tensor: torch.Tensor, *, comm=None) -> tuple[torch.Tensor, list[int]]:
    """Concatenate every rank's ``tensor`` along the first dimension, which may differ by rank.

    Like Horovod's ``allgather``: the other dimensions and the dtype must be the
    same on every rank (checked in the first step, a small allgather of the
    shapes, which blocks even in ``iallgatherv``; a mismatch raises the same
    ``ValueError`` on every rank).

    Args:
        tensor: this rank's rows, at least one dimension.
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        (a new tensor of every rank's rows in rank order, on ``tensor``'s device;
        the number of rows from each rank). ``output.split(sizes)`` gives each rank's.
    """
    return _allgatherv(tensor, comm, False)


def iallgatherv(tensor: torch.Tensor, *, comm=None) -> Handle:
    """Start ``allgatherv`` without blocking; ``wait()`` returns ``(output, sizes)``."""
    return _allgatherv(tensor, comm, True)
