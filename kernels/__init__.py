"""Flatten (pack) and unflatten (unpack) many tensors into one flat buffer.

Installed as ``mpidp.kernels``. The reducer calls ``pack``/``unpack`` whatever
the device. CUDA tensors of one dtype, contiguous and on one device, whether
cast (float32 to bfloat16, say) and scaled on the way or not, are copied by one fused
kernel launch (``pack.cu``, compiled by CuPy on first use and cached; see
``_cuda.py``), plain copies too unless ``PLAIN_COPIES_BY_KERNEL`` is False;
everything else, CPU tensors included, uses torch ops (``cat``,
``_foreach_copy_``) with the same results.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch._utils import _unflatten_dense_tensors

__all__ = ["pack", "unpack", "fused"]

# Plain copies (one dtype, no scale) of CUDA tensors take the kernel too, unless this is
# False (then torch._foreach_copy_ into views). On an H100 (bench/kernel_bench.py) a
# 24 MiB bucket of 116 tensors took 17 us of GPU time by the kernel (1.1x the speed of
# one flat device copy) against 41 us by _foreach_copy_, and 107 us per call against
# 288 us with the views made: the Python-side preparation is most of either call.
PLAIN_COPIES_BY_KERNEL = True
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_warned_no_cupy = False


def fused(tensors: Sequence[torch.Tensor], flat: torch.Tensor, scale: float | None = None) -> bool:
    """Whether ``pack``/``unpack`` of these tensors (with ``scale``) takes the CUDA kernel."""
    if flat.device.type != "cuda" or not tensors:
        return False
    dtype = tensors[0].dtype
    if dtype == flat.dtype and scale is None and not PLAIN_COPIES_BY_KERNEL:
        return False
    return _fusable(dtype, flat.dtype, all(t.dtype == dtype and t.is_contiguous() for t in tensors))


def _fusable(dtype: torch.dtype, flat_dtype: torch.dtype, uniform: bool) -> bool:
    global _warned_no_cupy
    from ._cuda import PAIRS
    if not uniform or (dtype, flat_dtype) not in PAIRS:
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        if not _warned_no_cupy:
            warnings.warn("mpidp.kernels: CuPy is not installed, so CUDA tensors are packed with "
                          "torch ops (a launch per tensor); pip install 'mpidp[cuda12]' (or cuda13)", RuntimeWarning)
            _warned_no_cupy = True
        return False
    return True


def _check(tensors: Sequence[torch.Tensor], flat: torch.Tensor, flat_name: str, scale):
    """Validate the call; return (sizes, addresses) for the CUDA kernel, or None for torch ops.

    As few looks at each tensor as the choice needs: a bucket may hold hundreds,
    and each Python-level look costs a fraction of a microsecond, which adds up
    to more than a GPU takes for the copy.
    """
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"{flat_name} must be a torch.Tensor, got {type(flat).__name__}")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{flat_name} must be a contiguous 1-d tensor, got shape "
                         f"{tuple(flat.shape)} with strides {tuple(flat.stride())}")
    device = flat.get_device()
    sizes = []
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.get_device() != device:
            raise ValueError(f"tensors[{i}] is on {tensor.device} but {flat_name} is on "
                             f"{flat.device}; all must share one device")
        sizes.append(tensor.numel())
    if sum(sizes) != flat.numel():
        raise ValueError(f"{flat_name} must have {sum(sizes)} elements (the tensors' total), "
                         f"got {flat.numel()}")
    if scale is not None:
        for i, dtype in enumerate([flat.dtype] + [t.dtype for t in tensors]):
            if dtype not in _FLOATING:
                where = flat_name if i == 0 else f"tensors[{i - 1}]"
                raise TypeError(f"scale needs floating-point tensors, but {where} is {dtype}")
    if device < 0 or not tensors:
        return None
    first = tensors[0].dtype
    if first == flat.dtype and scale is None and not PLAIN_COPIES_BY_KERNEL:
        return None  # see PLAIN_COPIES_BY_KERNEL
    if not _fusable(first, flat.dtype, all(t.dtype == first and t.is_contiguous() for t in tensors)):
        return None
    return tuple(sizes), tuple(t.data_ptr() for t in tensors)


def _views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive slices of ``flat`` shaped like ``tensors`` (one call into C++)."""
    return list(_unflatten_dense_tensors(flat, tensors))


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
    plan = _check(tensors, out, "out", scale)
    if plan is not None:
        from . import _cuda
        _cuda.pack(*plan, tensors[0].dtype, out, scale)
    elif tensors:
        with torch.no_grad():
            if scale is None and all(t.dtype == out.dtype for t in tensors):
                torch._foreach_copy_(_views(out, tensors), list(tensors))
            elif scale is None:
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
    plan = _check(tensors, flat, "flat", scale)
    if plan is not None:
        from . import _cuda
        _cuda.unpack(flat, *plan, tensors[0].dtype, scale)
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
