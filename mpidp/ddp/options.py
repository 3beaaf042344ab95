"""DistributedDataParallel's options: checked at the public boundary, then turned into a reducer's.

Every check here is local and raises on the rank that calls it; the ranks
pass the same arguments, and what must also agree across ranks (the model
and the resolved settings) is compared by ``mpidp.ddp.replica.check_replicas``.
The messages name the argument, the rule and the value (``mpidp._args``).
"""

from __future__ import annotations

import torch
from mpi4py import MPI
from torch import nn

from .. import _args, runtime, settings
from . import overlap as _overlap
from ..comm import shm as _shm
from ..comm import chunking as _chunking
from ..sampler import micro_batch_counts

__all__ = ["base_comm", "check_flags", "check_micro_batches", "check_module", "check_overlap",
           "check_reproducible", "check_sizes", "check_supported", "module_device",
           "reducer_options", "shared_memory_node", "sparse_names"]

# torch's arguments that mpidp refuses, and what to use instead
_UNSUPPORTED = {
    "delay_all_reduce_named_params": "leave those parameters out with requires_grad=False and "
                                     "reduce them yourself with mpidp.comm.allreduce",
    "param_to_hook_all_reduce": "the same",
    "mixed_precision": "run the forward under torch.autocast; gradients are reduced in the "
                       "parameters' dtype",
    "device_mesh": "pass an mpi4py communicator as comm",
    "bucket_cap_mb_list": "bucket_cap_mb and first_bucket_mb",
}


def check_supported(**given) -> None:
    """Raise ``ValueError`` for a torch argument mpidp does not support, given as other than None."""
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"{name} is not supported by mpidp.DistributedDataParallel, "
                             f"got {value!r}; use {_UNSUPPORTED[name]}")


def check_sizes(**sizes) -> None:
    """Raise ``ValueError`` unless each size in MiB is a number > 0 or None ("auto" too for one)."""
    for name, value in sizes.items():
        if name == "inplace_threshold_mb":
            if value != "auto":
                _args.check_number(name, value, optional=True, also=', None or "auto"')
        else:
            _args.check_number(name, value, optional=True)


def check_flags(*, optional: bool = False, **flags) -> None:
    """Raise ``TypeError`` unless each flag is a bool (or None where ``optional``)."""
    for name, value in flags.items():
        _args.check_bool(name, value, optional=optional)


def check_module(module: nn.Module) -> None:
    """Raise ``ValueError`` if ``module`` holds layers that need torch.distributed."""
    torch_sync_bn = [name for name, child in module.named_modules()
                     if isinstance(child, nn.SyncBatchNorm)]
    if torch_sync_bn:
        raise ValueError(
            f"module holds torch.nn.SyncBatchNorm ({', '.join(map(repr, torch_sync_bn))}), "
            f"which needs torch.distributed and would compute local statistics here; "
            f"convert it with mpidp.SyncBatchNorm.convert_sync_batchnorm(module) (or "
            f"nn.BatchNorm for local statistics) before wrapping")


def base_comm(comm, process_group) -> MPI.Intracomm:
    """The communicator to train over, given as ``comm`` or ``process_group`` (default: the
    world, ``MPI.COMM_WORLD`` or its survivors after a heal)."""
    if comm is not None and process_group is not None:
        raise ValueError("pass the communicator as comm or as process_group, not both")
    base = comm if comm is not None else process_group
    if base is None:
        return runtime.world()
    name = "comm" if comm is not None else "process_group"
    if not isinstance(base, MPI.Intracomm):
        raise TypeError(f"{name} must be None or an mpi4py Intracomm, got {type(base).__name__}; "
                        f"mpidp communicates through MPI, not through a torch.distributed "
                        f"process group")
    return base


def module_device(module: nn.Module, device_ids, output_device) -> torch.device:
    """The one device ``module`` lies on, checked against torch's ``device_ids``/``output_device``."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    device = tensors[0][1].device
    for name, tensor in tensors:
        if tensor.device != device or device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name!r} is on {tensor.device} but {tensors[0][0]!r} is on "
                             f"{device}; DistributedDataParallel needs the whole module on "
                             f"one device, the CPU or one GPU per rank")
    if not device_ids and output_device is None:  # torch takes [] as None too
        return device
    if device.type == "cpu":
        raise ValueError(f"device_ids and output_device must be None for a CPU module, got "
                         f"device_ids={device_ids!r}, output_device={output_device!r}")
    if not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1:
        raise ValueError(f"device_ids must be None or hold one device, the module's "
                         f"({device}), got {device_ids!r}")
    for name, value in (("device_ids[0]", device_ids[0]), ("output_device", output_device)):
        if value is None:
            continue
        target = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
        if target != device:
            raise ValueError(f"{name} must be the module's device {device}, got {value!r}; "
                             f"move the module there first (one GPU per rank)")
    return device


def sparse_names(module: nn.Module) -> set[str]:
    """Names of the parameters whose gradients are sparse, found as torch's DDP finds them."""
    found = set()
    for prefix, child in module.named_modules():
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse:
            found.update(f"{prefix}.{name}" if prefix else name
                         for name, _ in child.named_parameters(recurse=False))
    return found


def shared_memory_node(wanted: bool | None, base: MPI.Intracomm, device: torch.device):
    """The ranks grouped by node for shared-memory reduction, or None (collective).

    Args:
        wanted: the ``shared_memory`` option (None: ``MPIDP_SHARED_MEMORY``, else when usable).
        base: the communicator trained over.
        device: the module's device (shared memory reduces CPU gradients only).
    """
    if wanted is None:
        wanted = settings.get("MPIDP_SHARED_MEMORY")  # the default for every DDP
    if wanted is False or base.Get_size() == 1 or device.type != "cpu":
        if wanted and device.type != "cpu":
            raise ValueError(f"shared_memory=True reduces CPU gradients; the module is on "
                             f"{device} (leave shared_memory=None)")
        return None
    node = _shm.node_of(base)  # usable or not, the same on every rank; this DDP's own
    if not node.usable:
        node.free()
        if wanted:
            raise ValueError(f"shared_memory=True needs every node to hold the same number "
                             f"(> 1) of the communicator's ranks, but {node.reason}")
        return None
    return node


def reducer_options(options: dict, overlap: str, shared) -> dict:
    """The ``mpidp.ddp.reducer.Reducer`` keywords for DDP ``options`` (sizes in bytes, "auto" resolved).

    Args:
        options: the DDP's checked options (``DistributedDataParallel._options``).
        overlap: the resolved strategy name.
        shared: the shared-memory node the buckets will live in, or None.
    """
    solo = options["inplace_threshold_mb"]
    if solo == "auto":  # measured: docs/performance-ddp.md, "Shared-memory reduction"
        in_window = shared is not None and options["gradient_as_bucket_view"]
        solo = None if in_window else _chunking.INPLACE_MB  # else copied both ways
    sizes = _chunking.Sizes.of(bucket_cap_mb=options["bucket_cap_mb"],
                               first_bucket_mb=options["first_bucket_mb"],
                               chunk_mb=options["chunk_mb"], inplace_mb=solo)
    return dict(bucket_cap_bytes=sizes.bucket_cap, first_bucket_bytes=sizes.first_bucket,
                find_unused_parameters=options["find_unused_parameters"],
                gradient_as_bucket_view=options["gradient_as_bucket_view"],
                predict_order=options["predict_gradient_order"], overlap=overlap,
                chunk_bytes=sizes.chunk, solo_bytes=sizes.inplace,
                static_graph=options["static_graph"], stragglers=options["stragglers"])


def check_reproducible(*, gradient_as_bucket_view: bool, static_graph: bool,
                       sparse: list[str]) -> None:
    """Raise ``ValueError`` for an option that ``reproducible=True`` cannot honour."""
    for name, value in (("gradient_as_bucket_view", gradient_as_bucket_view),
                        ("static_graph", static_graph)):
        if value:
            raise ValueError(f"{name} must be False with reproducible=True (each micro-batch's "
                             f"gradient is kept apart from .grad), got {value!r}")
    if sparse:
        raise ValueError(f"reproducible=True reduces dense gradients only, but {sparse} have "
                         f"sparse gradients (nn.Embedding(sparse=True)); use sparse=False")


def check_micro_batches(micro_batches, *, reproducible: bool, world: int) -> None:
    """Raise ``ValueError`` unless ``micro_batches`` is None, or an int >= 1 given with
    ``reproducible=True`` that deals to ``world`` ranks (at least one each)."""
    if micro_batches is None:
        return
    _args.check_int("micro_batches", micro_batches, minimum=1)
    if not reproducible:
        raise ValueError(f"micro_batches is the number of micro-batches of a step in "
                         f"reproducible mode; pass it with reproducible=True, got "
                         f"micro_batches={micro_batches!r} and reproducible=False")
    micro_batch_counts(micro_batches, world)  # raises for more ranks than micro-batches


def check_overlap(overlap) -> None:
    """Raise ``ValueError`` unless ``overlap`` names a strategy of ``mpidp.ddp.overlap``."""
    if overlap not in _overlap.NAMES:
        raise ValueError(f"overlap must be one of {', '.join(map(repr, _overlap.NAMES))}, "
                         f"got {overlap!r}")
