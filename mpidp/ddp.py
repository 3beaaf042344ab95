"""DistributedDataParallel: torch's DDP interface, with MPI underneath."""

from __future__ import annotations

import contextlib
from numbers import Real

import torch
from mpi4py import MPI
from torch import nn

from . import comm as _comm
from . import overlap as _overlap
from . import topology
from .kernels import pack, unpack
from .reducer import Reducer

__all__ = ["DistributedDataParallel", "DDP", "broadcast_coalesced"]

_MB = 1024 * 1024

# torch DDP's first bucket: "Experiments showed 1MB is a reasonable value", and
# a small first bucket lets the first allreduce start early in the backward.
_FIRST_BUCKET_MB = 1.0


def broadcast_coalesced(tensors, root: int = 0, *, comm=None, inplace_bytes: int = 1 << 20) -> None:
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
    if comm is None:
        return MPI.COMM_WORLD.Get_rank()
    return comm.rank if isinstance(comm, _comm.Pool) else comm.Get_rank()


def _signature(module: nn.Module, settings: dict) -> list[tuple]:
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


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


class DistributedDataParallel(nn.Module):
    """Data parallelism over MPI: wrap a model, train on each rank's shard of the data.

    The interface is torch's ``DistributedDataParallel``: construct once per
    rank after building the model, call it like the model, and after
    ``loss.backward()`` every ``param.grad`` holds the average over all ranks,
    so any optimizer works unchanged.

    Args:
        module: the model; identical on every rank (names, shapes, dtypes are checked).
        comm: the mpi4py communicator to train over (default ``MPI.COMM_WORLD``).
        bucket_cap_mb: gradient bucket capacity in MiB (> 0).
        find_unused_parameters: after each forward, find the parameters that
            the output does not depend on and treat their gradients as ready.
        broadcast_buffers: broadcast rank 0's buffers before each synced forward.
        gradient_as_bucket_view: make ``.grad`` a view into the bucket (saves
            one copy of the gradients in memory and time).
        pool_size: how many duplicated communicators carry bucket allreduces
            round-robin (>= 1).
        first_bucket_mb: capacity of the first bucket in MiB (default 1, capped
            at ``bucket_cap_mb``).
        predict_gradient_order: after the first synced backward, rebuild the
            buckets in the order gradients actually arrived on rank 0 (as
            torch DDP does); results are identical either way.
        overlap: how bucket allreduces run beside the backward pass:
            "inline" (blocking, from the hook as soon as a bucket is ready),
            "thread" (a communication thread) or "nonblocking" (nonblocking
            collectives polled from the hooks); "auto" picks "inline" for CPU
            models and "thread" for GPU models; see ``mpidp.overlap``.
        chunk_mb: largest single allreduce in MiB; bigger buckets are reduced
            in chunks of this size.
        inplace_threshold_mb: gradients of at least this many MiB skip the
            buckets and are reduced in place (fusing them saves no latency and
            copying them costs memory bandwidth); None puts every gradient in
            a bucket, as torch does.
    """

    def __init__(self, module: nn.Module, *, comm: MPI.Intracomm | None = None,
                 bucket_cap_mb: float = 25, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, gradient_as_bucket_view: bool = False,
                 pool_size: int = 2, first_bucket_mb: float | None = None,
                 predict_gradient_order: bool = True, overlap: str = "auto",
                 chunk_mb: float = 4, inplace_threshold_mb: float | None = 1):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if comm is not None and not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be None or an mpi4py Intracomm, got {type(comm).__name__}")
        for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb),
                            ("chunk_mb", chunk_mb), ("inplace_threshold_mb", inplace_threshold_mb)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, Real)
                                      or not value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        for name, value in (("find_unused_parameters", find_unused_parameters),
                            ("broadcast_buffers", broadcast_buffers),
                            ("gradient_as_bucket_view", gradient_as_bucket_view),
                            ("predict_gradient_order", predict_gradient_order)):
            _check_flag(name, value)
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ValueError(f"pool_size must be an int >= 1, got {pool_size!r}")
        if overlap not in _overlap.NAMES:
            raise ValueError(f"overlap must be one of {', '.join(map(repr, _overlap.NAMES))}, "
                             f"got {overlap!r}")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("module has no parameter that requires grad; "
                             "DistributedDataParallel has nothing to synchronise")
        tensors = list(module.named_parameters()) + list(module.named_buffers())
        device = tensors[0][1].device
        for name, tensor in tensors:
            if tensor.device != device or device.type not in ("cpu", "cuda"):
                raise ValueError(f"{name!r} is on {tensor.device} but {tensors[0][0]!r} is on "
                                 f"{device}; DistributedDataParallel needs the whole module on "
                                 f"one device, the CPU or one GPU per rank")
        if first_bucket_mb is None:
            first_bucket_mb = min(_FIRST_BUCKET_MB, bucket_cap_mb)

        base = MPI.COMM_WORLD if comm is None else comm
        settings = dict(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                        find_unused_parameters=find_unused_parameters,
                        broadcast_buffers=broadcast_buffers,
                        gradient_as_bucket_view=gradient_as_bucket_view, pool_size=pool_size,
                        predict_gradient_order=predict_gradient_order, overlap=overlap,
                        chunk_mb=chunk_mb, inplace_threshold_mb=inplace_threshold_mb)
        # Gather first, then every rank decides the same: no rank may raise alone
        # and leave the others in the Dup() below.
        mismatch = first_mismatch(base.allgather(_signature(module, settings)))
        if mismatch is not None:
            raise ValueError(f"DistributedDataParallel: the model or its settings differ "
                             f"across ranks: {mismatch}")
        topology.warn_about_binding(base)  # names the line that built this DDP

        self.module = module
        self.pool = _comm.Pool(base, pool_size)
        self.control = base.Dup()
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        if self.pool.size > 1:
            broadcast_coalesced(list(module.parameters()) + list(module.buffers()),
                                comm=self.control)
        self.reducer = Reducer(named, self.pool, self.control,
                               bucket_cap_bytes=int(bucket_cap_mb * _MB),
                               first_bucket_bytes=int(first_bucket_mb * _MB),
                               find_unused_parameters=find_unused_parameters,
                               gradient_as_bucket_view=gradient_as_bucket_view,
                               predict_order=predict_gradient_order, overlap=overlap,
                               chunk_bytes=int(chunk_mb * _MB),
                               solo_bytes=None if inplace_threshold_mb is None
                               else int(inplace_threshold_mb * _MB))

    def forward(self, *args, **kwargs):
        self.reducer.raise_pending_error()
        sync = self.require_backward_grad_sync
        if sync and self.broadcast_buffers and self.pool.size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                broadcast_coalesced(buffers, comm=self.control)
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self.reducer.prepare(output, sync)
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, inside this context.

        The first backward after leaving it reduces the accumulated sum.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous


DDP = DistributedDataParallel
