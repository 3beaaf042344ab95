"""Keeping the ranks' model replicas alike: their signatures compared, rank 0's values broadcast.

Data parallelism only averages gradients correctly when every rank holds the
same model: the same parameters and buffers (names, shapes, dtypes, which
ones train) and the same DDP settings, in the same order, since the buckets
are laid out from them. ``check_replicas`` gathers each rank's signature and
raises the same description of the first difference on every rank (no rank
raises alone, docs/concurrency.md, rule 5); ``broadcast_coalesced`` gives every rank rank
0's values (``DistributedDataParallel``'s ``init_sync``, buffer broadcasts and
``join()``).
"""

from __future__ import annotations

import torch
from mpi4py import MPI
from torch import nn

from .. import comm as _comm
from ..comm import chunking as _chunking
from ..comm.agreement import decide
from ..kernels import pack, unpack

__all__ = ["broadcast_coalesced", "check_replicas", "first_mismatch", "signature"]


def signature(module: nn.Module, settings: dict) -> list[tuple]:
    """What must be equal across ranks: ``settings``, then each parameter's and buffer's form."""
    entries = [("setting", key, value) for key, value in settings.items()]
    for name, param in module.named_parameters():
        entries.append(("parameter", name, tuple(param.shape), str(param.dtype).removeprefix("torch."),
                        param.requires_grad))
    for name, buffer in module.named_buffers():
        entries.append(("buffer", name, tuple(buffer.shape), str(buffer.dtype).removeprefix("torch.")))
    return entries


def _describe(entry: tuple) -> str:
    if entry[0] == "setting":
        return f"{entry[1]}={entry[2]!r}"
    text = f"{entry[0]} {entry[1]!r} with shape {entry[2]}, dtype {entry[3]}"
    return text + (f", requires_grad={entry[4]}" if entry[0] == "parameter" else "")


def _tensor_count(signature: list[tuple]) -> int:
    return sum(entry[0] != "setting" for entry in signature)


def first_mismatch(signatures: list[list[tuple]]) -> str | None:
    """Describe the first difference between rank 0's signature and another rank's, if any."""
    reference = signatures[0]
    for rank, theirs in enumerate(signatures):
        if theirs == reference:
            continue
        for mine, other in zip(reference, theirs):
            if mine != other:
                return f"rank {rank} has {_describe(other)} where rank 0 has {_describe(mine)}"
        longer, owner = (theirs, rank) if len(theirs) > len(reference) else (reference, 0)
        return (f"rank {rank} has {_tensor_count(theirs)} parameters and buffers but rank 0 has "
                f"{_tensor_count(reference)}; the first extra one, on rank {owner}, is "
                f"{_describe(longer[min(len(theirs), len(reference))])}")
    return None


def check_replicas(comm: MPI.Intracomm, module: nn.Module, settings: dict, label: str,
                   what: str) -> None:
    """Raise ``ValueError(f"{what}: {difference}")`` on every rank if the replicas differ (collective).

    Args:
        comm: the ranks to compare.
        module: this rank's replica.
        settings: the options that must be equal too (name: value).
        label: how the stall watchdog names the allgather.
        what: the start of the message.
    """
    def judge(signatures):
        mismatch = first_mismatch(signatures)
        return None if mismatch is None else ValueError(f"{what}: {mismatch}")

    decide(comm, signature(module, settings), judge, label)


def broadcast_coalesced(tensors, root: int = 0, *, comm=None,
                        inplace_bytes: int = _chunking.DEFAULTS.inplace) -> None:
    """Broadcast ``tensors`` from ``root``: large ones in place, small ones coalesced.

    Tensors of at least ``inplace_bytes`` are broadcast where they lie (a copy
    would only cost memory); the others go in one broadcast per (dtype, device).

    Args:
        tensors: tensors to overwrite on non-root ranks (any shapes, contiguous or not).
        root: the rank whose values everyone receives.
        comm: None, an ``mpidp.comm.Pool`` or an mpi4py communicator.
        inplace_bytes: size from which a tensor is broadcast on its own.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    is_root = _rank_of(comm) == root
    for tensor in tensors:
        tensor = tensor.detach()
        if tensor.numel() * tensor.element_size() < inplace_bytes:
            groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        elif tensor.is_contiguous():
            _comm.broadcast(tensor, root, comm=comm)
        else:
            staged = tensor.contiguous()
            _comm.broadcast(staged, root, comm=comm)
            tensor.copy_(staged)
    for (dtype, device), group in groups.items():
        flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=device)
        if is_root:
            pack(group, flat)
        _comm.broadcast(flat, root, comm=comm)
        if not is_root:
            unpack(flat, group)


def _rank_of(comm) -> int:
    """This rank in ``comm``; None is the world (its survivors after a heal), as the broadcast's."""
    return _comm._base(comm).Get_rank()
