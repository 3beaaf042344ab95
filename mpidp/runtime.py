"""Where MPI starts, and process-level MPI facts: the world, ranks, threads.

**Where MPI starts.** MPI belongs to the process that ``mpiexec``/``srun``
launched, and mpidp initialises it there at import: importing mpidp imports
``mpi4py.MPI``, which initialises MPI at once (mpi4py's ``rc.initialize``), so
code that uses mpi4py directly after ``import mpidp`` keeps working. A process
that ``multiprocessing`` started (a DataLoader worker, under fork, spawn or
forkserver) must never initialise MPI: spawn and forkserver re-import the main
script in the worker, and an MPI started there fails to reach the launcher.
There, importing mpidp turns mpi4py's automatic initialisation and
finalisation off before ``mpi4py.MPI`` is first imported (so ``import mpidp``
first, then ``from mpi4py import MPI``, is safe in a worker too), skips all of
mpidp's start-up, and anything of mpidp that needs MPI raises ``RuntimeError``.
``require_mpi()`` is that one check; every mpidp entry point that talks MPI
calls it. If MPI is not initialised yet in the launched process (the user set
``mpi4py.rc.initialize = False`` before importing mpidp), ``require_mpi()``
initialises it, the only place mpidp does, and finalises it at exit.

MPI starts at import, not lazily: import already talks to the other ranks
(threads, the CUDA decision, the abort hooks), and mpi4py users expect it.

**Thread level.** mpidp asks for ``MPI_THREAD_MULTIPLE`` (mpi4py's default
``rc.thread_level``), which its communication thread needs. A lower
``mpi4py.rc.thread_level`` set before importing mpidp is honoured, and an MPI
the user initialised first is taken as it is; ``thread_level()`` returns what
the library granted.

**Abort.** How a rank ends (the job-wide abort on an uncaught exception or a
non-zero ``sys.exit``) is ``mpidp.exits``, which ``_start()`` arms at import;
``abort_on_exception`` is re-exported here.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import sys
import threading

import mpi4py

from . import communicators, errors, settings

__all__ = ["rank", "size", "local_rank", "local_size", "abort_on_exception", "require_mpi",
           "thread_level", "thread_level_name", "in_multiprocessing_child", "world", "healed"]


def _started_by_multiprocessing() -> bool:
    """Whether multiprocessing started this process, or is preparing it (per CPython 3.11)."""
    if multiprocessing.parent_process() is not None:  # set in every child once it runs
        return True
    # spawn and forkserver re-import __main__, and unpickle the process object,
    # with this flag set and parent_process() still None.
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return True
    # The forkserver itself imports set_forkserver_preload() modules outside that window.
    forkserver = sys.modules.get("multiprocessing.forkserver")
    frame = sys._getframe() if forkserver is not None else None
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


_child = _started_by_multiprocessing()
if _child:
    # Must run before anything imports mpi4py.MPI: that import initialises MPI.
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False

from mpi4py import MPI  # noqa: E402  (initialises MPI here, in the launched process)

from . import exits  # noqa: E402  (imports mpi4py.MPI)
from .exits import abort_on_exception  # noqa: E402, F401  (public here too)

_ready = False  # MPI checked and usable in this process: require_mpi()'s fast path


def _forked() -> None:
    global _child, _ready
    _child, _ready = True, False


os.register_at_fork(after_in_child=_forked)


def in_multiprocessing_child() -> bool:
    """Whether this process was started by multiprocessing (or forked): no MPI here."""
    return _child


_LEVELS = {"single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED,
           "serialized": MPI.THREAD_SERIALIZED, "multiple": MPI.THREAD_MULTIPLE}


def thread_level_name(level: int) -> str:
    """``MPI.THREAD_SERIALIZED`` -> ``"serialized"``."""
    return {value: name for name, value in _LEVELS.items()}.get(level, str(level))


def require_mpi() -> None:
    """Make sure MPI is usable in this process; every mpidp entry point that talks MPI calls it.

    Raises:
        RuntimeError: in a process started by multiprocessing (or forked), where MPI
            must not be used, or after MPI was finalised.
    """
    if not _ready:
        _start_mpi()


def _start_mpi() -> None:
    global _ready
    if _child:
        raise RuntimeError(
            "MPI is not available in a multiprocessing child (a DataLoader worker, a Pool "
            "worker, a forked process): only the process that mpiexec/srun launched talks "
            "to MPI. Read mpidp.rank()/size() there and pass them to the worker")
    if MPI.Is_finalized():
        raise RuntimeError("MPI has already been finalized in this process")
    if not MPI.Is_initialized():  # mpi4py.rc.initialize was False: mpidp starts MPI
        if mpi4py.rc.threads:
            MPI.Init_thread(_LEVELS[mpi4py.rc.thread_level])
        else:
            MPI.Init()
        atexit.register(_finalize)  # registered first, so it runs after the abort check
    _ready = True


def _finalize() -> None:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def thread_level() -> int:
    """The thread level the MPI library granted (``MPI.THREAD_SINGLE`` ... ``MPI.THREAD_MULTIPLE``)."""
    require_mpi()
    return MPI.Query_thread()


# The world mpidp trains over: MPI.COMM_WORLD, until mpidp.spares sets spare ranks aside or
# mpidp.healing replaces it with the survivors of a lost rank (ULFM's shrink). Written only
# there, by the program's thread, at a moment collective over the ranks concerned.
_world: list = []
_healed = [False]


def world() -> MPI.Intracomm:
    """The ranks mpidp works over: ``MPI.COMM_WORLD``, or its survivors after a heal."""
    require_mpi()
    return _world[0] if _world else MPI.COMM_WORLD


def healed() -> bool:
    """Whether a lost rank was healed here (``world()`` is the survivors)."""
    return _healed[0]


def set_world(comm: MPI.Intracomm, *, heal: bool = True) -> None:
    """Make ``comm`` the world: the survivors, collectively shrunk (``mpidp.healing``), or with
    ``heal=False`` the ranks that train while spares stand by (``mpidp.spares``)."""
    _world[:] = [comm]
    _healed[0] = _healed[0] or heal
    errors.judge_losses_over(comm)


def rank() -> int:
    """Return this process's rank in the world (``MPI.COMM_WORLD``, or its survivors after a heal)."""
    return world().Get_rank()


def size() -> int:
    """Return the number of processes in the world (``MPI.COMM_WORLD``, or its survivors)."""
    return world().Get_size()


@functools.cache
def _node_comm() -> MPI.Intracomm:
    # Collective over the world; cached so every rank calls it exactly once.
    comm = world().Split_type(MPI.COMM_TYPE_SHARED)
    return communicators.made(comm, "mpidp.runtime: this node's ranks", rebuild=_rebuild_node)


def _rebuild_node(_world) -> None:
    """Over the survivors (``set_world`` first; collective, from ``communicators.rebuild_all``)."""
    communicators.release(_node_comm())
    _node_comm.cache_clear()
    _node_comm()


def local_rank() -> int:
    """Return the rank within this node (the ranks that share memory with this one)."""
    return _node_comm().Get_rank()


def local_size() -> int:
    """Return the number of ranks on this node."""
    return _node_comm().Get_size()


# --- torch.compile ---------------------------------------------------------------------

_untraced_lock = threading.Lock()


def keep_out_of_torch_compile(cls: type, names) -> None:
    """Mark methods ``names`` of ``cls`` as never traced by torch.compile (idempotent).

    torch.compile runs each marked method as it is, between graphs: what calls MPI
    or keeps Python state cannot be traced. Called where an object of ``cls`` is
    first made, not at import: ``torch.compiler.disable`` loads torch._dynamo, which
    took more than a second of ``import mpidp``. A model is compiled after that object
    exists, so the mark is always in place before any tracing.
    """
    import torch  # noqa: PLC0415  (runtime itself needs no torch)

    with _untraced_lock:
        for name in names:
            method = cls.__dict__.get(name) or getattr(cls, name)
            if not getattr(method, "_mpidp_untraced", False):
                method = torch.compiler.disable(method)
                method._mpidp_untraced = True
                setattr(cls, name, method)


def _start() -> None:
    """What importing mpidp does in the launched process (never in a multiprocessing child)."""
    require_mpi()
    exits.arm(_mpi_is_ours)
    if _abort_from_env() and size() > 1:
        exits.abort_on_exception(True)


def _mpi_is_ours() -> bool:
    return _ready


def _abort_from_env() -> bool:
    return settings.get("MPIDP_ABORT_ON_EXCEPTION")
