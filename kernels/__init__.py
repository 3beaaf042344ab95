"""Flatten (pack) and unflatten (unpack) many tensors into one flat buffer.

Installed as ``mpidp.kernels``. The reducer calls ``pack``/``unpack`` for every
device; this implementation uses torch ops (one ``cat`` for pack, one
``_foreach_copy_`` for unpack), which is right on any device. A fused
single-launch CUDA path belongs here too (issue 4) and keeps these signatures.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["pack", "unpack"]


def _check(tensors: Sequence[torch.Tensor], flat: torch.Tensor, flat_name: str) -> None:
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
    _check(tensors, out, "out")
    if tensors:
        with torch.no_grad():
            torch.cat([t.reshape(-1).to(out.dtype) for t in tensors], out=out)
            if scale is not None:
                out.mul_(scale)
    return out


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float | None = None) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (the reverse of ``pack``).

    Args:
        flat: contiguous 1-d tensor with exactly the tensors' total number of elements.
        tensors: destination tensors, overwritten in place; dtypes may differ from ``flat``.
        scale: if given, each tensor receives ``slice * scale``.
    """
    _check(tensors, flat, "flat")
    if not tensors:
        return
    with torch.no_grad():
        torch._foreach_copy_(list(tensors), _views(flat, tensors))
        if scale is not None:
            torch._foreach_mul_(list(tensors), scale)
