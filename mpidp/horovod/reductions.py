"""Horovod's allreductions: ``allreduce`` and ``grouped_allreduce`` in all their forms.

Each reduces with MPI's sum, min, max or product through ``mpidp.comm``;
``Average`` is the sum times ``postscale_factor / size``, as in Horovod, and
``prescale_factor`` multiplies each rank's input first (integer tensors are
scaled in float64 and rounded toward zero, as in Horovod: ``scale_``). ``_async`` forms return
a handle for ``synchronize``; a trailing ``_`` writes the result into the
input. A grouped allreduce packs its tensors into one flat buffer per dtype and
device, one message each. ``op=hvd.Adasum`` combines the ranks' tensors by Horovod's
adaptive summation (``adasum``), each tensor of a group with its own coefficients.
"""

from __future__ import annotations

from numbers import Real

import torch

from .. import comm as _comm
from ..comm.checks import _check_tensor
from . import adasum as _adasum
from . import process_sets as _sets
from . import requests as _requests
from .compression import Compression

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_"]

# Horovod's values, so scripts that store or compare them keep working.
Average, Sum, Adasum, Min, Max, Product = range(6)
_MPI_OPS = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "prod",
            Adasum: "adasum"}
_OP_NAMES = "hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max or hvd.Product"
_OP_LABELS = {Average: "hvd.Average", Sum: "hvd.Sum", Min: "hvd.Min", Max: "hvd.Max",
              Product: "hvd.Product", Adasum: "hvd.Adasum"}


_HALF = (torch.float16, torch.bfloat16)


class MixedDevicesError(ValueError, RuntimeError):
    """A group of tensors on more than one device: a bad argument (negotiated as one), and
    the RuntimeError Horovod's core raises for it."""


def resolve_op(op, average) -> int:
    """The op a call asks for, from ``op`` and the deprecated ``average``."""
    if op is not None and average is not None:
        raise ValueError(f"op and average were both given (op={op!r}, average={average!r}): "
                         f"op supersedes the deprecated average; pass only op")
    if op is None:
        op = Sum if average is False else Average
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


def _check_scales(prescale_factor, postscale_factor) -> None:
    for label, value in (("prescale_factor", prescale_factor), ("postscale_factor", postscale_factor)):
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"{label} must be a real number, got {value!r}")


def scale_(tensor: torch.Tensor, factor, divisor: int = 1) -> torch.Tensor:
    """Multiply ``tensor`` in place by ``factor / divisor``, as Horovod scales; returns it.

    Floating-point tensors are multiplied in their dtype (float16 on the CPU through
    float32, by torch; on a GPU by the factor rounded to float16 first, as Horovod's kernel); a plain division (``Average`` without a postscale factor) is a
    division, correctly rounded, as one process computing the mean would round it.
    Integer tensors are scaled in float64 and rounded toward zero, as Horovod does; a
    plain division is exact: the quotient rounded toward zero.
    """
    if tensor.dtype.is_floating_point:
        if factor == 1:
            return tensor.div_(divisor) if divisor != 1 else tensor
        if factor == divisor:
            return tensor
        if tensor.dtype == torch.float16 and tensor.is_cuda:  # Horovod's GPU kernel: a half factor
            return tensor.mul_(torch.tensor(factor / divisor, dtype=torch.float16,
                                            device=tensor.device))
        return tensor.mul_(factor / divisor)
    if factor == 1:
        return tensor.div_(divisor, rounding_mode="trunc") if divisor != 1 else tensor
    return tensor.copy_(tensor.double().mul_(factor / divisor))


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
        _check_scales(prescale_factor, postscale_factor)
        devices = {str(tensor.device) for tensor in tensors}
        if len(devices) > 1:  # Horovod's error too: one group, one device
            raise MixedDevicesError(f"tensors of one grouped allreduce must be on one "
                                    f"device, got {sorted(devices)}")
        if op == Adasum:
            for tensor in tensors:
                _adasum.check(tensor.dtype, process_set.data.Get_size())
    groups: dict[tuple, list[int]] = {}
    for k, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(k)
    divisor = process_set.data.Get_size() if op == Average else 1
    # a plain Average divides (Horovod's rounding: it scales in float64); a DistributedOptimizer
    # bucket (strategy given) is multiplied by 1 / size instead: with each rank's mean's 1 / B
    # that reproduces one process's mean over n B (docs/horovod-tests.md, "Same result as one process")
    scale = (postscale_factor / divisor, 1) if strategy is not None else (postscale_factor, divisor)
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
    scale_(flat, prescale)
    # a product of 16-bit floats is taken in float32 and rounded once, as torch's CUDA prod
    # does: rounded after each rank's factor, it overflows early (inf times 0 is nan) and
    # depends on the order of the ranks
    wide = flat.float() if mpi_op == "prod" and flat.dtype in _HALF else flat

    def launch():
        if mpi_op == "adasum":  # runs now, on this thread (adasum.py)
            _adasum.reduce_(flat, [t.numel() for t in tensors], process_set.data)
            return []
        return [_comm.iallreduce(wide, mpi_op, comm=process_set.data)]

    def reduce_now():
        direct.start(flat)
        return []

    def finish():
        if wide is not flat:
            flat.copy_(wide)
        scale_(flat, *scale)
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
    # one device type on every rank, as Horovod requires (and where the direct way goes
    # depends on it)
    detail = f"{detail}, {flat.device.type} memory"
    return _requests.begin(process_set, _requests.ALLREDUCE, launch, finish,
                           keep=(tensors, flat, wide), name=name, nbytes=flat.nbytes,
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
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Adasum`` (floating-point tensors,
            a power of 2 ranks; it blocks until done), ``hvd.Min``, ``hvd.Max`` or
            ``hvd.Product``.
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


class _GroupedAllreduce(torch.autograd.Function):
    """Each tensor's gradient: the grouped allreduce of the gradients, with the same op and scales.

    No tensor is saved, so each output may be backpropagated on its own, as in Horovod.
    """

    @staticmethod
    def forward(ctx, op, prescale, postscale, process_set, name, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_requests.synchronize(grouped_allreduce_async(
            list(tensors), None, name, op, prescale, postscale, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        reduced = grouped_allreduce(list(grads), op=op, prescale_factor=prescale,
                                    postscale_factor=postscale, process_set=process_set)
        return (None,) * 5 + tuple(reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=_sets.global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors over the process set; returns new tensors (differentiable)."""
    if not isinstance(tensors, (list, tuple)):
        raise ValueError(f"tensors must be a non-empty list of tensors, got {tensors!r}")
    packed = [compression.compress(t) for t in tensors]
    compressed = [t for t, _ in packed]
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in compressed):
        op = resolve_op(op, average)
        reduced = _GroupedAllreduce.apply(op, prescale_factor, postscale_factor, process_set,
                                          name, *compressed)
    else:
        reduced = _requests.synchronize(grouped_allreduce_async(
            compressed, average, name, op, prescale_factor, postscale_factor, process_set))
    return [compression.decompress(t, context) for t, (_, context) in zip(reduced, packed)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=_sets.global_process_set):
    """Reduce a list of tensors in place over the process set; returns them."""
    return _requests.synchronize(grouped_allreduce_async_(tensors, average, name, op,
                                                          prescale_factor, postscale_factor,
                                                          process_set))
