"""Making every rank's optimizer state equal to one rank's, as after resuming on one rank.

A checkpoint loaded on rank 0 only leaves the other ranks' optimizers as they
were: usually empty (no step taken yet, so no momentum or Adam moments), with
the hyperparameters they were built with. ``broadcast_optimizer_state`` gives
them the root's ``state_dict()``, as Horovod's function of that name does, and
the other ranks load it with ``load_state_dict``, which accepts an empty state
as readily as a full one and takes the param groups' lr, momentum, betas...
too. The state dict travels as a pickled skeleton whose tensors are replaced by
slots (shape, dtype, where they live); the tensors follow as tensor broadcasts:
each of at least 1 MiB where it lies (on the GPU if it is there), the smaller
ones packed into one host buffer per dtype, so a model's many small ``step``
counters cost one broadcast, not one each.
"""

from __future__ import annotations

import dataclasses

import torch

from .comm import agreement as _agreement
from . import comm as _comm
from .comm import chunking as _chunking
from . import objects as _objects

__all__ = ["broadcast_optimizer_state"]

# Below this a tensor rides in its dtype's packed host buffer, as in DDP's
# coalesced broadcast of module state (mpidp.comm.chunking's one threshold).
_INPLACE_BYTES = _chunking.DEFAULTS.inplace


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor of the root's state dict goes: its index in the broadcast order."""

    index: int
    shape: tuple
    dtype: torch.dtype
    on_gpu: bool


def _hollow(value, tensors: list):
    """``value`` with each tensor comm can send replaced by a ``_Slot``, appended to ``tensors``."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype not in _comm._DATATYPES:
            return value.cpu()  # pickled with the skeleton (complex moments, say)
        if value.device.type not in ("cpu", "cuda"):
            value = value.cpu()
        tensors.append(value)
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype, value.is_cuda)
    if type(value) is dict:
        return {key: _hollow(item, tensors) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_hollow(item, tensors) for item in value)
    return value


def _fill(value, tensors: list):
    """The inverse of ``_hollow``: slots replaced by the received tensors."""
    if isinstance(value, _Slot):
        return tensors[value.index]
    if type(value) is dict:
        return {key: _fill(item, tensors) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_fill(item, tensors) for item in value)
    return value


def _slots(value) -> list[_Slot]:
    if isinstance(value, _Slot):
        return [value]
    items = value.values() if type(value) is dict else value if type(value) in (list, tuple) else ()
    return [slot for item in items for slot in _slots(item)]


def _allocate(slot: _Slot) -> torch.Tensor:
    # load_state_dict moves each tensor to its parameter's device; landing on a
    # GPU when the root's was on one saves a trip through host memory.
    on_gpu = slot.on_gpu and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return torch.empty(slot.shape, dtype=slot.dtype, device=device)


def _broadcast_tensors(tensors: list[torch.Tensor], root: int, is_root: bool, comm) -> None:
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel() * tensor.element_size() >= _INPLACE_BYTES:
            _comm.broadcast(tensor, root, comm=comm)
        else:
            small.setdefault(tensor.dtype, []).append(tensor)
    for dtype, group in small.items():
        sizes = [t.numel() for t in group]
        if is_root:
            flat = torch.cat([t.reshape(-1).cpu() for t in group])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype)
        _comm.broadcast(flat, root, comm=comm)
        if not is_root:
            for tensor, piece in zip(group, flat.split(sizes)):
                tensor.copy_(piece.view(tensor.shape))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0, *,
                              comm=None) -> None:
    """Make every rank's optimizer state and hyperparameters equal to rank ``root``'s (collective).

    Call it after loading a checkpoint on ``root`` only, with the parameters
    already equal on every rank (``DistributedDataParallel`` broadcasts them
    when it is built). The root's optimizer is left as it is.

    Args:
        optimizer: this rank's optimizer, over the same parameters (same groups, same
            order) on every rank; its state may be empty.
        root: the rank whose state every rank takes.
        comm: None, an ``mpidp.comm.Pool`` or an mpi4py communicator.

    Raises:
        ValueError: on every rank, if a rank's optimizer cannot load the root's state dict
            (other param groups, say), naming the ranks and torch's message.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    base = _comm._base(comm)
    _comm._check_root(root, base)
    is_root = base.Get_rank() == root
    tensors: list[torch.Tensor] = []
    skeleton = _hollow(optimizer.state_dict(), tensors) if is_root else None
    skeleton = _objects.broadcast_object(skeleton, root, comm=comm)
    if not is_root:
        tensors = [_allocate(slot) for slot in sorted(_slots(skeleton), key=lambda s: s.index)]
    _broadcast_tensors(tensors, root, is_root, comm)
    error = None
    if not is_root:
        try:
            optimizer.load_state_dict(_fill(skeleton, tensors))
        except Exception as err:  # torch's checks (ValueError) and anything a hook raises
            error = f"{type(err).__name__}: {err}"
    _agreement.raise_together(_comm._collective_comm(comm), error, ValueError,
                             f"broadcast_optimizer_state: rank {root}'s state dict cannot be "
                             f"loaded on")
