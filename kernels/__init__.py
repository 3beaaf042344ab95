"""Flatten (pack) and unflatten (unpack) many tensors into one flat buffer.

Installed as ``mpidp.kernels``. The reducer calls ``pack``/``unpack`` whatever
the device. CUDA tensors of one dtype, contiguous and on one device, are
copied by one fused kernel launch (``pack.cu``, compiled by CuPy on first use
and cached; see ``_cuda.py``); everything else, CPU tensors included, uses
torch ops (``cat``, ``_foreach_copy_``) with the same results.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

__all__ = ["pack", "unpack", "fused"]

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_warned_no_cupy = False


def fused(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> bool:
    """Whether ``pack``/``unpack`` of these tensors takes the one-launch CUDA kernel."""
    global _warned_no_cupy
    if flat.device.type != "cuda" or not tensors:
        return False
    if len({t.dtype for t in tensors}) != 1 or not all(t.is_contiguous() for t in tensors):
        return False
    from ._cuda import PAIRS
    if (tensors[0].dtype, flat.dtype) not in PAIRS:
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        if not _warned_no_cupy:
            warnings.warn("mpidp.kernels: CuPy is not installed, so CUDA tensors are packed with "
                          "torch ops (a launch per tensor); pip install 'mpidp[cuda]'", RuntimeWarning)
            _warned_no_cupy = True
        return False
    return True


def _check(tensors: Sequence[torch.Tensor], flat: torch.Tensor, flat_name: str, scale) -> None:
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"{flat_name} must be a torch.Tensor, got {type(flat).__name__}")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{flat_name} must be a contiguous 1-d tensor, got shape "
                         f"{tuple(flat.shape)} with strides {tuple(flat.stride())}")
    total = 0
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device != flat.device:
            raise ValueError(f"tensors[{i}] is on {tensor.device} but {flat_name} is on "
                             f"{flat.device}; all must share one device")
        total += tensor.numel()
    if total != flat.numel():
        raise ValueError(f"{flat_name} must have {total} elements (the tensors' total), "
                         f"got {flat.numel()}")
    if scale is not None:
        for i, dtype in enumerate([flat.dtype] + [t.dtype for t in tensors]):
            if dtype not in _FLOATING:
                where = flat_name if i == 0 else f"tensors[{i - 1}]"
                raise TypeError(f"scale needs floating-point tensors, but {where} is {dtype}")


def _views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    views, offset = [], 0
    for tensor in tensors:
        views.append(flat[offset:offset + tensor.numel()].view(tensor.shape))
        offset += tensor.numel()
    return views


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Copy ``tensors`` one after another into the flat tensor ``out``.

    Args:
        tensors: tensors on ``out``'s device, any shapes and sizes (empty ones too).
        out: contiguous 1-d tensor with exactly their total number of elements;
            its dtype may differ (values are cast).
        scale: if given, ``out`` receives ``tensor * scale``.

    Returns:
        ``out``.
    """
    _check(tensors, out, "out", scale)
    if fused(tensors, out):
        from . import _cuda
        _cuda.pack(list(tensors), out, scale)
    elif tensors:
        with torch.no_grad():
            if scale is None:
                torch.cat([t.reshape(-1).to(out.dtype) for t in tensors], out=out)
            else:  # scale before rounding, in float (double if either side is), as the kernel does
                acc = _accumulate(tensors[0].dtype, out.dtype)
                out.copy_(torch.cat([t.reshape(-1).to(acc) for t in tensors]).mul_(scale))
    return out


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float | None = None) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (the reverse of ``pack``).

    Args:
        flat: contiguous 1-d tensor with exactly the tensors' total number of elements.
        tensors: destination tensors, overwritten in place; dtypes may differ from ``flat``.
        scale: if given, each tensor receives ``slice * scale``.
    """
    _check(tensors, flat, "flat", scale)
    if fused(tensors, flat):
        from . import _cuda
        _cuda.unpack(flat, list(tensors), scale)
        return
    if not tensors:
        return
    views = _views(flat, tensors)
    with torch.no_grad():
        if scale is None:
            torch._foreach_copy_(list(tensors), views)
        else:  # scale before rounding, in float (double if either side is), as the kernel does
            acc = _accumulate(flat.dtype, tensors[0].dtype)
            torch._foreach_copy_(list(tensors), torch._foreach_mul([v.to(acc) for v in views], scale))


def _accumulate(src: torch.dtype, dst: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in (src, dst) else torch.float32
