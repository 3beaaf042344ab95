"""Horovod's adaptive summation, ``op=hvd.Adasum``, over a process set of 2^k ranks.

Two ranks' vectors ``a`` and ``b`` combine as

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

per tensor (a grouped reduction gives each tensor its own coefficients): parallel
vectors give their mean, orthogonal ones their sum. A vector whose squared norm is
below 1e-8 keeps the coefficient 1 (it counts as zero). Over 2^k ranks the
combination runs as a binary tree in rank order, as Horovod's MPI implementation
pairs them: at distance d = 1, 2, 4, ... rank r and rank r ^ d exchange their whole
current vectors (point-to-point, on the set's data communicator) and both compute
the combination of the lower rank's block with the higher one's, in that order, so
every rank of the set ends with the same bits. Memory: one more vector; traffic:
log2(size) whole vectors per rank.

The exchange blocks the calling thread: a request of ``op=hvd.Adasum`` runs when it
starts (``requests.begin``), after the negotiation and under the set's lock, so no
other thread of this rank issues on the set meanwhile, and its handle is complete at
once. Its messages (tag ``_TAG``) are the only point-to-point ones mpidp.horovod sends
on a set's data communicator; the partners of a level post them in the same order. Dot products and norms are summed in float64; the result is rounded once to
the tensor's dtype.
"""

from __future__ import annotations

import torch

from .. import comm as _comm

__all__ = ["check", "check_size", "reduce_"]

_TAG = 0x4ADA  # every exchange of this module on the set's point-to-point communicator
_ZERO = 1e-8  # a squared norm below it: the coefficient stays 1


def check(dtype: torch.dtype, size: int) -> None:
    """Refuse what Adasum cannot reduce (a ValueError naming the rule and the value)."""
    if not dtype.is_floating_point:
        raise ValueError(f"op=hvd.Adasum needs floating-point tensors (float16, bfloat16, "
                         f"float32, float64), got {dtype}")
    check_size(size)


class AdasumSizeError(ValueError, NotImplementedError):
    """Adasum over a number of ranks that is not a power of 2: a bad argument, and the
    NotImplementedError Horovod raises for it."""


def check_size(size: int) -> None:
    """Refuse a process set whose size is not a power of 2."""
    if size & (size - 1):
        raise AdasumSizeError(f"op=hvd.Adasum needs a process set of a power of 2 ranks, as in "
                         f"Horovod, got {size} ranks")


def _combine(low: torch.Tensor, high: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The combination of ``low`` (the lower ranks' vector) and ``high``, tensor by tensor."""
    out = torch.empty_like(low)
    offset = 0
    for count in counts:
        a = low[offset:offset + count].double()
        b = high[offset:offset + count].double()
        dot = torch.dot(a, b)
        coefficients = []
        for own in (a, b):
            norm = torch.dot(own, own)
            coefficients.append(torch.where(norm >= _ZERO, 1 - dot / (2 * norm),
                                            torch.ones_like(norm)))
        out[offset:offset + count] = coefficients[0] * a + coefficients[1] * b
        offset += count
    return out


def reduce_(flat: torch.Tensor, counts: list[int], comm) -> None:
    """Replace ``flat`` (tensors of ``counts`` elements, one after another) by the Adasum of
    every rank's ``flat`` over ``comm`` (collective over ``comm``; blocks)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    flat = flat.view(-1)  # contiguous: a flat buffer or one tensor
    other = torch.empty_like(flat)
    distance = 1
    while distance < size:
        partner = rank ^ distance
        receive = _comm.irecv(other, partner, _TAG, comm=comm)
        send = _comm.isend(flat, partner, _TAG, comm=comm)
        receive.wait()
        send.wait()
        low, high = (flat, other) if rank & distance == 0 else (other, flat)
        flat.copy_(_combine(low, high, counts))
        distance *= 2
