"""Horovod's PyTorch API over mpidp: ``import mpidp.horovod as hvd`` runs horovod.torch scripts.

One module per concept: ``basics`` (init and the process's facts),
``process_sets``, ``requests`` (handles, ``poll``/``synchronize``, the
negotiation that starts each collective and ``HorovodInternalError``),
``reductions`` (allreduce), ``adasum`` (``op=hvd.Adasum``), ``scatter`` (reducescatter),
``collectives`` (allgather, broadcast, alltoall, barrier, objects), ``join``,
``compression``, ``optimizer`` (``DistributedOptimizer``), ``functions``
(broadcasting parameters and optimizer state), ``settings`` (``HOROVOD_*``)
and ``timeline``. What Horovod has and mpidp does not (elastic training,
``hvd.run``) raises an error that says so. docs/horovod.md has the whole table.
"""

from __future__ import annotations

from ..ddp.syncbn import SyncBatchNorm
from .basics import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
    mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size, start_timeline,
    stop_timeline,
)
from .collectives import (
    allgather, allgather_async, allgather_object, alltoall, alltoall_async, barrier, broadcast,
    broadcast_, broadcast_async, broadcast_async_, broadcast_object, grouped_allgather,
    grouped_allgather_async, sparse_allreduce_async,
)
from .compression import Compression, Compressor
from .functions import broadcast_optimizer_state, broadcast_parameters
from .join import join
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .reductions import (
    Adasum, Average, Max, Min, Product, Sum, allreduce, allreduce_, allreduce_async,
    allreduce_async_, grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
    grouped_allreduce_async_,
)
from .requests import HorovodInternalError, poll, synchronize
from .scatter import (
    grouped_reducescatter, grouped_reducescatter_async, reducescatter, reducescatter_async,
)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "barrier", "join", "broadcast_object", "allgather_object",
    "poll", "synchronize", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Compression", "Compressor", "DistributedOptimizer",
    "broadcast_parameters", "broadcast_optimizer_state", "SyncBatchNorm", "HorovodInternalError",
]

# Horovod names with no meaning here: each raises an error that says why.
_REFUSED = {
    "elastic": "elastic training (hvd.elastic): an MPI job keeps its ranks from start to end; "
               "restart it from a checkpoint instead",
    "run": "horovodrun's Python launcher (horovod.run): launch with mpiexec or srun",
}


def __getattr__(name: str):
    why = _REFUSED.get(name)
    if why is not None:
        raise NotImplementedError(f"hvd.{name} is not provided by mpidp.horovod: {why}")
    raise AttributeError(f"module 'mpidp.horovod' has no attribute {name!r}")
