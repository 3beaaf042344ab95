"""Horovod's ``reducescatter`` and ``grouped_reducescatter``, with their gradients.

The sum (``Average``: the sum divided by the set's size, as ``allreduce``) of
every rank's tensor, of which rank ``r`` keeps its rows:
``tensor.shape[0] // size`` of them, one more on the first
``tensor.shape[0] % size`` ranks, as in Horovod. ``prescale_factor`` and
``postscale_factor`` scale as in ``allreduce``. A grouped reducescatter runs one
collective per tensor, started together. The gradient is Horovod 0.28's: the
allgather of the gradients, times the set's size for ``hvd.Sum``.
"""

from __future__ import annotations

import torch

from .. import comm as _comm
from ..comm.checks import _check_tensor
from . import process_sets as _sets
from . import requests as _requests
from .collectives import allgather, grouped_allgather
from .compression import Compression
from .reductions import (
    Adasum, Average, Sum, _check_name, _check_scales, _detail, process_set_of, resolve_op, scale_,
)

__all__ = ["reducescatter", "reducescatter_async", "grouped_reducescatter",
           "grouped_reducescatter_async"]


def launch_reducescatter(flat: torch.Tensor, rows: int, process_set) -> tuple:
    """Start the sum behind a reducescatter of ``flat`` (``rows`` rows); joined ranks call it too.

    Returns:
        (the started Handles, a function giving this rank's rows of the sum).
    """
    size, rank = process_set.data.Get_size(), process_set.data.Get_rank()
    counts = [rows // size + (r < rows % size) for r in range(size)]
    if rows % size == 0:
        output = flat.new_empty((counts[rank], *flat.shape[1:]))
        handle = _comm.ireduce_scatter(output, flat, "sum", comm=process_set.data)
        return [handle], lambda: output
    handle = _comm.iallreduce(flat, "sum", comm=process_set.data)
    offset = sum(counts[:rank])
    return [handle], lambda: flat.narrow(0, offset, counts[rank]).clone()


def _begin(tensor, name, op, process_set, prescale_factor, postscale_factor) -> _requests.Request:
    process_set = process_set_of(process_set)
    with _requests.checking(process_set, _requests.REDUCESCATTER):
        op = resolve_op(op, None)
        if op == Adasum:  # Horovod raises a RuntimeError here too
            raise NotImplementedError("op=hvd.Adasum has no reducescatter (as in Horovod); use "
                                      "hvd.Average or hvd.Sum")
        if op not in (Average, Sum):
            raise ValueError(f"op must be hvd.Average or hvd.Sum for reducescatter, got {op!r}")
        _check_name(name)
        _check_tensor("tensor", _requests.wrap_tensor(tensor))
        _check_scales(prescale_factor, postscale_factor)
        if tensor.dim() == 0:
            raise ValueError("tensor must have at least one dimension to split its rows, got 0-d")
    flat = scale_(_requests.wrap_tensor(tensor).clone(memory_format=torch.contiguous_format),
                  prescale_factor)
    divisor = process_set.data.Get_size() if op == Average else 1
    started = {}

    def launch():
        handles, started["result"] = launch_reducescatter(flat, flat.shape[0], process_set)
        return handles

    return _requests.begin(
        process_set, _requests.REDUCESCATTER, launch,
        lambda: scale_(started["result"](), postscale_factor, divisor), keep=(tensor, flat),
        name=name, nbytes=flat.nbytes, dtype=flat.dtype, op="sum", shape=tuple(flat.shape),
        detail=_detail(op, prescale_factor, postscale_factor))


def reducescatter_async(tensor, name=None, op=Average, process_set=_sets.global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start a reduction of ``tensor`` whose rows are then split over the ranks; returns a handle.

    Args:
        tensor: this rank's input, at least one dimension (left as it is).
        name: a label for the timeline.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        process_set: the ranks to reduce over (default: all).
        prescale_factor, postscale_factor: as ``allreduce``'s.

    Returns:
        A handle for ``hvd.synchronize``, which returns this rank's rows.
    """
    return _requests.register(_begin(tensor, name, op, process_set, prescale_factor,
                                     postscale_factor))


def grouped_reducescatter_async(tensors, name=None, op=Average,
                                process_set=_sets.global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> int:
    """Start a reducescatter of each tensor of a list; ``synchronize`` returns the list of results."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"tensors must be a non-empty list of tensors, got {tensors!r}")
    parts = [_begin(t, name, op, process_set, prescale_factor, postscale_factor)
             for t in tensors]
    results = [None] * len(parts)
    for k, part in enumerate(parts):  # waiting for the group waits for each part, once
        part.finish = lambda k=k, finish=part.finish: results.__setitem__(k, finish())
    return _requests.register(_requests.Request(
        parts, lambda: results, (), _requests.REDUCESCATTER, name, process_set_of(process_set),
        0))


def _gradient(grads: list, op: int, process_set) -> list:
    """Horovod 0.28's gradient of a reducescatter: the allgather, times the size for Sum."""
    gathered = grouped_allgather(grads, process_set=process_set) if len(grads) > 1 \
        else [allgather(grads[0], process_set=process_set)]
    factor = process_set.size() if op == Sum else 1
    return [g.mul_(factor) if factor != 1 else g for g in gathered]


class _Reducescatter(torch.autograd.Function):
    """The reducescatter of one tensor or a group, differentiable (``_gradient``)."""

    @staticmethod
    def forward(ctx, op, process_set, name, prescale, postscale, *tensors):
        handle = grouped_reducescatter_async(list(tensors), name, op, process_set, prescale,
                                             postscale)
        ctx.op, ctx.process_set = resolve_op(op, None), process_set  # checked on every rank
        return tuple(_requests.synchronize(handle))

    @staticmethod
    def backward(ctx, *grads):
        grads = [g.contiguous() for g in grads]
        return (None,) * 5 + tuple(_gradient(grads, ctx.op, ctx.process_set))


def _reducescatter(tensors, name, compression, op, process_set, prescale_factor,
                   postscale_factor) -> list:
    packed = [compression.compress(t) for t in tensors]
    compressed = [t for t, _ in packed]
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in compressed):
        reduced = _Reducescatter.apply(op, process_set_of(process_set), name, prescale_factor,
                                       postscale_factor, *compressed)
    else:
        reduced = _requests.synchronize(grouped_reducescatter_async(
            compressed, name, op, process_set, prescale_factor, postscale_factor))
    return [compression.decompress(t, context) for t, (_, context) in zip(reduced, packed)]


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=_sets.global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the process set and return this rank's rows (differentiable).

    Args:
        compression: ``hvd.Compression.none``, ``fp16`` or ``bf16``: the dtype on the wire.
        (the others as ``reducescatter_async``)
    """
    return _reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                          postscale_factor)[0]


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=_sets.global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    """Reducescatter each tensor of a list; returns this rank's rows of each (differentiable)."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"tensors must be a non-empty list of tensors, got {tensors!r}")
    return _reducescatter(list(tensors), name, compression, op, process_set, prescale_factor,
                          postscale_factor)
