"""``hvd.init`` and the facts of the process: ranks, sizes, what is built, the timeline.

``init`` duplicates the communicator it is given (``MPI.COMM_WORLD`` by
default), groups its ranks by node (``MPI_COMM_TYPE_SHARED``) for
``local_rank``/``local_size``, and by local rank for ``cross_rank``/
``cross_size`` (the ranks with the same local rank, one per node, as in
Horovod), registers the global process set and the ``process_sets`` given,
and acts on the ``HOROVOD_*`` variables (``settings``). Everything but the
``*_built``/``*_enabled`` facts needs it first and says so, as Horovod does.
"""

from __future__ import annotations

from mpi4py import MPI

from .. import _args
from .. import communicators as _communicators
from .. import runtime as _runtime
from . import healing as _healing
from . import process_sets as _sets
from . import settings as _settings
from . import state as _state_module
from .state import _NOT_INITIALIZED, _state, _world  # noqa: F401 (re-exported)
from .timeline import Timeline

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
           "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
           "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
           "cuda_built", "rocm_built", "start_timeline", "stop_timeline"]

def _initialized(fact):
    """``fact`` of the state, once ``init`` has run (else Horovod's error)."""
    _world()
    return fact


def _base(comm) -> MPI.Intracomm:
    if comm is None:  # mpidp's world: the trainers where spares stand by (mpidp.stand_by)
        return _runtime.world()
    if isinstance(comm, MPI.Intracomm):
        return comm
    if isinstance(comm, (list, tuple)):
        if not all(_args.is_int(r) and 0 <= r < MPI.COMM_WORLD.Get_size() for r in comm):
            raise ValueError(f"comm must list ranks of MPI.COMM_WORLD (0 to "
                             f"{MPI.COMM_WORLD.Get_size() - 1}), got {list(comm)}")
        if MPI.COMM_WORLD.Get_rank() not in comm:
            raise ValueError(f"hvd.init(comm={list(comm)}) on rank {MPI.COMM_WORLD.Get_rank()}, "
                             f"which is not in it: call hvd.init only on the ranks listed")
        world = MPI.COMM_WORLD
        return world.Create_group(world.Get_group().Incl(sorted(comm)))
    raise TypeError(f"comm must be None, a list of ranks or an mpi4py Intracomm, "
                    f"got {type(comm).__name__}")


def init(comm=None, process_sets=None) -> None:
    """Start Horovod's state over ``comm`` (collective; a second call does nothing).

    Args:
        comm: None (mpidp's world: ``MPI.COMM_WORLD``, or the ranks that train where
            spares stand by, ``mpidp.stand_by``), an mpi4py communicator (duplicated), or a
            list of ``MPI.COMM_WORLD`` ranks (called on those ranks only).
        process_sets: ``ProcessSet``s to register, the same on every rank, or
            "dynamic" (sets may be added later, as they always may here).
    """
    _runtime.require_mpi()
    if _state.world is not None:
        return
    if process_sets is not None and process_sets != "dynamic" and not isinstance(
            process_sets, (list, tuple)):
        raise TypeError(f"process_sets must be None, 'dynamic' or a list of ProcessSet, "
                        f"got {process_sets!r}")
    base = _base(comm)
    world = _state_module.make_world(base, "hvd.init (node sizes)")
    global_set = _sets.global_process_set
    global_set.ranks = list(range(world.Get_size()))
    global_set._attach(world, 0)
    _sets._registry[0] = global_set
    try:
        for process_set in process_sets if isinstance(process_sets, (list, tuple)) else ():
            _sets._register(process_set, world)
        _settings.apply(start_timeline)
        _healing.adopt(base)
    except BaseException:
        shutdown()
        raise


def shutdown() -> None:
    """Free Horovod's communicators and forget pending handles; ``init`` may follow again."""
    if _state.world is None:
        return
    _state_module.forget_all()
    stop_timeline()
    _sets._clear()  # frees the world too: the global set owns it
    for comm in (_state.local, _state.cross):
        _communicators.free(comm)
    _state.world = _state.local = _state.cross = None


def is_initialized() -> bool:
    """Whether ``init`` has run (and ``shutdown`` has not since)."""
    return _state.world is not None


def size() -> int:
    """Number of ranks of ``init``'s communicator."""
    return _world().Get_size()


def rank() -> int:
    """This process's rank in ``init``'s communicator."""
    return _world().Get_rank()


def local_size() -> int:
    """Number of ranks on this node."""
    return _initialized(_state.local).Get_size()


def local_rank() -> int:
    """This rank's rank among those of its node."""
    return _initialized(_state.local).Get_rank()


def cross_size() -> int:
    """Number of ranks with this rank's local rank (the number of nodes, on equal nodes)."""
    return _initialized(_state.cross).Get_size()


def cross_rank() -> int:
    """This rank's rank among the ranks with its local rank (its node's index, on equal nodes)."""
    return _initialized(_state.cross).Get_rank()


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks."""
    return _initialized(_state.homogeneous)


def mpi_threads_supported() -> bool:
    """Whether MPI granted ``MPI_THREAD_MULTIPLE``."""
    _world()
    return _runtime.thread_level() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True: mpidp's collectives are MPI's."""
    return True


def mpi_built() -> bool:
    """True: mpidp's collectives are MPI's."""
    return True


def gloo_enabled() -> bool:
    """False: mpidp never uses gloo."""
    return False


def gloo_built() -> bool:
    """False: mpidp never uses gloo."""
    return False


def nccl_built() -> int:
    """0: GPU tensors go through MPI (CUDA-aware or staged through the host), never NCCL."""
    return 0


def ddl_built() -> bool:
    """False (IBM DDL)."""
    return False


def ccl_built() -> bool:
    """False (oneCCL)."""
    return False


def cuda_built() -> bool:
    """Whether CUDA tensors can be communicated: torch has CUDA."""
    import torch
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """Whether torch was built for ROCm (its HIP tensors pass as CUDA ones)."""
    import torch
    return torch.version.hip is not None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every collective's start and completion, written to ``file_path`` by rank 0.

    Args:
        file_path: where ``stop_timeline`` (or ``shutdown``) writes the Chrome trace.
        mark_cycles: accepted for Horovod's signature; there are no cycles to mark.
    """
    _args.check_bool("mark_cycles", mark_cycles)
    if _world().Get_rank() == 0:
        stop_timeline()
        _state.timeline = Timeline(file_path, 0)


def stop_timeline() -> None:
    """Write the timeline started by ``start_timeline`` and stop recording."""
    timeline, _state.timeline = _state.timeline, None
    if timeline is not None:
        timeline.stop()
