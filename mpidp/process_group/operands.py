"""How the backend's operands become buffers ``mpidp.comm`` moves, and the checks they pass.

torch hands a collective lists of tensors (one per device, or one per rank);
the backend takes one tensor per call, moves dtypes MPI has no datatype for as
bytes and complex ones as real pairs, packs lists into one flat tensor, and
unpacks the result once the operation is done. The checks run before
anything is started, and their messages name torch's call and argument.
"""

from __future__ import annotations

import torch

from .. import comm as _comm

__all__: list[str] = []  # private to the backend: mpidp.process_group.operations imports them by name


def _as_moved(tensor: torch.Tensor) -> torch.Tensor:
    """A view of ``tensor`` that mpidp.comm can move: complex as real, other dtypes as bytes."""
    if tensor.is_complex():
        return torch.view_as_real(tensor)
    if tensor.dtype in _comm._DATATYPES:
        return tensor
    if not tensor.is_contiguous():
        raise TypeError(f"a non-contiguous tensor of dtype {tensor.dtype} cannot be moved "
                        f"(mpidp moves it as bytes); pass a contiguous tensor")
    # a trailing dimension of bytes: rows stay rows (all_to_all_single's splits), 0-d works
    return tensor.unsqueeze(-1).view(torch.uint8)


def _one(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{what}: the mpidp backend takes one tensor per call (one device per "
                         f"rank), got {len(tensors)}")
    # as with gloo and NCCL, a tensor that requires grad is communicated (outside autograd)
    tensor = tensors[0]
    return tensor.detach() if isinstance(tensor, torch.Tensor) and tensor.requires_grad else tensor


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """As with gloo and NCCL, a tensor that requires grad is communicated (outside autograd)."""
    return tensor.detach() if tensor.requires_grad else tensor


def _flat(tensors) -> torch.Tensor:
    """One contiguous tensor holding ``tensors`` one after the other."""
    return torch.cat([_detached(t).reshape(-1) for t in tensors]) if len(tensors) > 1 else \
        _detached(tensors[0]).reshape(-1).contiguous()


def _check_same_sizes(name: str, tensors, numel: int) -> None:
    sizes = [t.numel() for t in tensors]
    if any(n != numel for n in sizes):
        raise ValueError(f"{name}: every tensor must have {numel} elements (the mpidp backend "
                         f"needs equal sizes), got {sizes}")


def _check_dtypes(name: str, tensors, dtype: torch.dtype) -> None:
    bad = sorted({str(t.dtype) for t in tensors if t.dtype != dtype})
    if bad:
        raise TypeError(f"{name}: every tensor must have dtype {dtype}, got {', '.join(bad)}")


def _check_world_list(what: str, name: str, tensors, size: int, numel: int,
                      dtype: torch.dtype) -> None:
    """``tensors`` is one tensor per rank of a group of ``size``, each of ``numel`` ``dtype``s."""
    if len(tensors) != size:
        raise ValueError(f"{what}: {name} must have world size ({size}) tensors, "
                         f"got {len(tensors)}")
    _check_same_sizes(f"{what}: {name}", tensors, numel)
    _check_dtypes(f"{what}: {name}", tensors, dtype)


def _unpack(flat: torch.Tensor, outputs):
    """A step that copies consecutive blocks of ``flat`` into ``outputs``."""
    def copy():
        offset = 0
        for out in outputs:
            n = out.numel()
            out.copy_(flat[offset:offset + n].view_as(out))
            offset += n
    return copy
