"""Horovod's reductions: ``allreduce`` and ``grouped_allreduce`` in all their forms, ``reducescatter``.

Each reduces with MPI's sum, min, max or product through ``mpidp.comm``;
``Average`` is the sum times ``postscale_factor / size``, as in Horovod, and
``prescale_factor`` multiplies each rank's input first. ``_async`` forms return
a handle for ``synchronize``; a trailing ``_`` writes the result into the
input. A grouped allreduce packs its tensors into one flat buffer per dtype and
device, one message each. ``op=hvd.Adasum`` is refused.
"""

from __future__ import annotations

from numbers import Real

import torch

from .. import comm as _comm
from ..comm.checks import _check_tensor
from . import process_sets as _sets
from . import requests as _requests
from .compression import Compression

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "reducescatter", "reducescatter_async"]

# Horovod's values, so scripts that store or compare them keep working.
Average, Sum, Adasum, Min, Max, Product = range(6)
_MPI_OPS = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
_OP_NAMES = "hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product"
_OP_LABELS = {Average: "hvd.Average", Sum: "hvd.Sum", Min: "hvd.Min", Max: "hvd.Max",
              Product: "hvd.Product"}


def resolve_op(op, average) -> int:
    """The op a call asks for, from ``op`` and the deprecated ``average``."""
    if op is not None and average is not None:
        raise ValueError(f"op and average were both given (op={op!r}, average={average!r}): "
                         f"op supersedes the deprecated average; pass only op")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum and not isinstance(op, bool):
        raise NotImplementedError("op=hvd.Adasum (Horovod's adaptive summation) is not "
                                  "implemented by mpidp.horovod; use op=hvd.Average or hvd.Sum")
    if isinstance(op, bool) or op not in _MPI_OPS:
        raise ValueError(f"op must be {_OP_NAMES}, got {op!r}")
    return op


def process_set_of(process_set) -> _sets.ProcessSet:
    """The registered set a call runs on; this rank must belong to it."""
    if not isinstance(process_set, _sets.ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet, got {type(process_set).__name__}")
    from . import basics
    basics._world()
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: pass it to hvd.init(process_sets=...) "
                         f"or hvd.add_process_set first")
    if not process_set.included():
        raise ValueError(f"rank {basics.rank()} is not in {process_set}: only its ranks may call "
                         f"its collectives")
    return process_set


def _check_scales(prescale_factor, postscale_factor, dtype: torch.dtype, op: int) -> None:
    for label, value in (("prescale_factor", prescale_factor), ("postscale_factor", postscale_factor)):
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"{label} must be a real number, got {value!r}")
    if not dtype.is_floating_point and (op == Average or prescale_factor != 1
                                        or postscale_factor != 1):
        raise TypeError(f"op=hvd.Average and scale factors other than 1 need a floating-point "
                        f"tensor, got {dtype}; use op=hvd.Sum")


def _check_name(name) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {name!r}")


def _begin(tensors, inplace: bool, op, average, name, prescale_factor, postscale_factor,
           process_set, strategy=None) -> _requests.Request:
    """Start the allreduce of ``tensors`` (one message per dtype and device).

    ``strategy`` (an ``mpidp.ddp.overlap`` one, for the optimizer's buckets) reduces a CPU
    sum at once the way mpidp DDP does: in the node's shared memory where its window
    holds the tensor, else chunk by chunk (``Average`` still scales the sum after).
    """
    process_set = process_set_of(process_set)
    with _requests.checking(process_set, _requests.ALLREDUCE):
        op = resolve_op(op, average)
        _check_name(name)
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise ValueError(f"tensors must be a non-empty list of tensors, got {tensors!r}")
        for k, tensor in enumerate(tensors):
            _check_tensor(f"tensors[{k}]", _requests.wrap_tensor(tensor), written=inplace)
            _check_scales(prescale_factor, postscale_factor, tensor.dtype, op)
    groups: dict[tuple, list[int]] = {}
    for k, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(k)
    scale = postscale_factor / (process_set.data.Get_size() if op == Average else 1)
    detail = _detail(op, prescale_factor, postscale_factor)
    direct = strategy if op in (Average, Sum) else None  # scaled after the sum, as Horovod does
    outputs = [None] * len(tensors)
    parts = [_begin_group([_requests.wrap_tensor(tensors[k]) for k in members], members, outputs,
                          inplace, _MPI_OPS[op], prescale_factor, scale, name, process_set,
                          detail, direct)
             for members in groups.values()]
    if len(parts) > 1:
        return _requests.Request(parts, lambda: outputs, (), _requests.ALLREDUCE, name,
                                 process_set, 0)
    finish = parts[0].finish
    parts[0].finish = lambda: (finish(), outputs)[1]
    return parts[0]


def _detail(op: int, prescale_factor, postscale_factor) -> str:
    """What of a reduction every rank must give alike besides dtype and shape."""
    return (f"{_OP_LABELS[op]}, prescale_factor {prescale_factor}, "
            f"postscale_factor {postscale_factor}")


def _begin_group(tensors, members, outputs, inplace, mpi_op, prescale, scale, name, process_set,
                 detail, direct=None):
    if len(tensors) == 1:
        flat = tensors[0] if inplace and tensors[0].is_contiguous() else tensors[0].clone(
            memory_format=torch.contiguous_format)
    else:
        flat = torch.cat([t.reshape(-1) for t in tensors])
    if prescale != 1:
        flat.mul_(prescale)

    def launch():
        return [_comm.iallreduce(flat, mpi_op, comm=process_set.data)]

    def reduce_now():
        direct.start(flat)
        return []

    def finish():
        if scale != 1:
            flat.mul_(scale)
        offset = 0
        for k, tensor in zip(members, tensors):
            result = flat if len(tensors) == 1 else flat[offset:offset + tensor.numel()]
            result = result.view(tensor.shape)
            offset += tensor.numel()
            if inplace and result is not tensor:
                tensor.copy_(result)
                result = tensor
            outputs[k] = result

    shape = tuple(tensors[0].shape) if len(tensors) == 1 and tensors[0].dim() <= 8 \
        else (flat.numel(),)
    cpu = flat.device.type == "cpu"
    if direct is not None:  # where it goes depends on the device: every rank must agree on it
        detail = f"{detail}, {flat.device.type} memory"
    return _requests.begin(process_set, _requests.ALLREDUCE, launch, finish,
                           keep=(tensors, flat), name=name, nbytes=flat.nbytes,
                           direct=reduce_now if direct is not None and cpu else None,
                           dtype=flat.dtype, op=mpi_op, shape=shape, detail=detail)


def _single(request) -> int:
    finish = request.finish
    request.finish = lambda: finish()[0]
    return _requests.register(request)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=_sets.global_process_set) -> int:
    """Start reducing ``tensor`` over the process set into a new tensor; returns a handle.

    Args:
        tensor: this rank's input (left as it is).
        average: deprecated; True is ``op=hvd.Average``, False ``op=hvd.Sum``.
        name: a label for the timeline.
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        prescale_factor: multiplies each rank's input before the reduction.
        postscale_factor: multiplies the result (after the division of ``Average``).
        process_set: the ranks to reduce over (default: all).

    Returns:
        A handle for ``hvd.synchronize`` (which returns the new tensor) or ``hvd.poll``.
    """
    return _single(_begin([tensor], False, op, average, name, prescale_factor, postscale_factor,
                          process_set))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=_sets.global_process_set) -> int:
    """``allreduce_async`` that writes the result into ``tensor``."""
    return _single(_begin([tensor], True, op, average, name, prescale_factor, postscale_factor,
                          process_set))


def bucket_allreduce_async_(tensor, strategy, name, op, prescale_factor, postscale_factor,
                            process_set) -> int:
    """``allreduce_async_`` of a ``DistributedOptimizer`` bucket, reduced by ``strategy`` (see ``_begin``)."""
    return _single(_begin([tensor], True, op, None, name, prescale_factor, postscale_factor,
                          process_set, strategy))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=_sets.global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place over the process set; returns it."""
    return _requests.synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                                  postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    """Gradients flow back through an allreduce with the same op and scales."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, process_set, name):
        ctx.args = (op, prescale, postscale, process_set)
        return _requests.synchronize(allreduce_async(tensor, None, name, op, prescale,
                                                     postscale, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        op, prescale, postscale, process_set = ctx.args
        return (allreduce(grad_output, op=op, prescale_factor=prescale,
                          postscale_factor=postscale, process_set=process_set),
                None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0,
              process_set=_sets.global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the process set into a new tensor (differentiable).

    Args:
        compression: ``hvd.Compression.none``, ``fp16`` or ``bf16``: the dtype on the wire.
        (the others as ``allreduce_async``)

    Returns:
        A new tensor of ``tensor``'s shape and dtype.
    """
    process_set = process_set_of(process_set)
    with _requests.checking(process_set, _requests.ALLREDUCE):
        op = resolve_op(op, average)
        _check_name(name)
        compressed, context = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        reduced = _Allreduce.apply(compressed, op, prescale_factor, postscale_factor, process_set,
                                   name)
    else:
        reduced = _requests.synchronize(allreduce_async(compressed, None, name, op,
                                                        prescale_factor, postscale_factor,
                                                        process_set))
    return compression.decompress(reduced, context)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=_sets.global_process_set) -> int:
    """Start reducing a list of tensors as one message per dtype; ``synchronize`` gives new tensors."""
    return _requests.register(_begin(list(tensors) if isinstance(tensors, tuple) else tensors,
                                     False, op, average, name, prescale_factor,
                                     postscale_factor, process_set))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=_sets.global_process_set) -> int:
    """``grouped_allreduce_async`` that writes each result into its tensor."""
    return _requests.register(_begin(tensors, True, op, average, name, prescale_factor,
                                     postscale_factor, process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=_sets.global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors over the process set; returns new tensors (no autograd)."""
    if not isinstance(tensors, (list, tuple)):
        raise ValueError(f"tensors must be a non-empty list of tensors, got {tensors!r}")
    packed = [compression.compress(t) for t in tensors]
    reduced = _requests.synchronize(grouped_allreduce_async(
        [t for t, _ in packed], average, name, op, prescale_factor, postscale_factor, process_set))
    return [compression.decompress(t, context) for t, (_, context) in zip(reduced, packed)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=_sets.global_process_set):
    """Reduce a list of tensors in place over the process set; returns them."""
    return _requests.synchronize(grouped_allreduce_async_(tensors, average, name, op,
                                                          prescale_factor, postscale_factor,
                                                          process_set))


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


def reducescatter_async(tensor, name=None, op=Average, process_set=_sets.global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start a reduction of ``tensor`` whose rows are then split over the ranks; returns a handle.

    Rank ``r`` gets rows ``r * n // size ...`` of the sum: ``tensor.shape[0] // size`` rows,
    one more on the first ``tensor.shape[0] % size`` ranks, as in Horovod.

    Args:
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        (the others as ``allreduce_async``)
    """
    process_set = process_set_of(process_set)
    with _requests.checking(process_set, _requests.REDUCESCATTER):
        op = resolve_op(op, None)
        if op not in (Average, Sum):
            raise ValueError(f"op must be hvd.Average or hvd.Sum for reducescatter, got {op!r}")
        _check_name(name)
        _check_tensor("tensor", _requests.wrap_tensor(tensor))
        _check_scales(prescale_factor, postscale_factor, tensor.dtype, op)
        if tensor.dim() == 0:
            raise ValueError("tensor must have at least one dimension to split its rows, got 0-d")
    flat = _requests.wrap_tensor(tensor).clone(memory_format=torch.contiguous_format)
    if prescale_factor != 1:
        flat.mul_(prescale_factor)
    scale = postscale_factor / (process_set.data.Get_size() if op == Average else 1)
    started = {}

    def launch():
        handles, started["result"] = launch_reducescatter(flat, flat.shape[0], process_set)
        return handles

    def finish():
        output = started["result"]()
        return output.mul_(scale) if scale != 1 else output

    return _requests.register(_requests.begin(
        process_set, _requests.REDUCESCATTER, launch, finish, keep=(tensor, flat), name=name,
        nbytes=flat.nbytes, dtype=flat.dtype, op="sum", shape=tuple(flat.shape),
        detail=_detail(op, prescale_factor, postscale_factor)))


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=_sets.global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the process set and return this rank's rows of the result."""
    compressed, context = compression.compress(tensor)
    handle = reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                 postscale_factor)
    return compression.decompress(_requests.synchronize(handle), context)
