"""Process-level MPI facts and the job-wide abort on an uncaught exception.

Importing mpidp initialises MPI through mpi4py (thread level MULTIPLE, the
mpi4py default). Under ``mpiexec`` with more than one rank, an uncaught
exception on any rank prints its traceback and calls ``MPI_Abort`` so the other
ranks do not wait forever in a collective. Set ``MPIDP_ABORT_ON_EXCEPTION=0``
before importing mpidp, or call ``abort_on_exception(False)``, to keep Python's
default behaviour.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback

from mpi4py import MPI

__all__ = ["rank", "size", "local_rank", "local_size", "barrier", "abort_on_exception",
           "require_mpi", "thread_level"]


def require_mpi() -> None:
    """Make sure MPI is initialised in this process; every mpidp entry point that talks MPI calls it.

    (Placeholder: MPI is initialised when mpi4py is imported. Issue 8, item 12
    makes this the one place MPI starts, and refuses in a multiprocessing child.)
    """


def thread_level() -> int:
    """The thread level the MPI library granted (``MPI.THREAD_SINGLE`` ... ``MPI.THREAD_MULTIPLE``)."""
    require_mpi()
    return MPI.Query_thread()


def rank() -> int:
    """Return this process's rank in ``MPI.COMM_WORLD``."""
    return MPI.COMM_WORLD.Get_rank()


def size() -> int:
    """Return the number of processes in ``MPI.COMM_WORLD``."""
    return MPI.COMM_WORLD.Get_size()


@functools.cache
def _node_comm() -> MPI.Intracomm:
    # Collective over COMM_WORLD; cached so every rank calls it exactly once.
    return MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)


def local_rank() -> int:
    """Return the rank within this node (the ranks that share memory with this one)."""
    return _node_comm().Get_rank()


def local_size() -> int:
    """Return the number of ranks on this node."""
    return _node_comm().Get_size()


def barrier() -> None:
    """Block until every rank of ``MPI.COMM_WORLD`` has called ``barrier``."""
    MPI.COMM_WORLD.Barrier()


_python_excepthook = sys.excepthook


def _abort_excepthook(exc_type, exc, tb) -> None:
    lines = traceback.format_exception(exc_type, exc, tb)
    prefix = f"[mpidp rank {rank()}/{size()}] "
    sys.stderr.write(prefix + "uncaught exception, aborting the MPI job:\n")
    sys.stderr.write("".join(prefix + line for text in lines for line in text.splitlines(True)))
    sys.stderr.flush()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)


def abort_on_exception(enable: bool = True) -> None:
    """Make an uncaught exception on one rank end the whole MPI job.

    Args:
        enable: install the hook (True) or restore Python's previous ``sys.excepthook``.
    """
    sys.excepthook = _abort_excepthook if enable else _python_excepthook


def _install_default_hook() -> None:
    setting = os.environ.get("MPIDP_ABORT_ON_EXCEPTION", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"MPIDP_ABORT_ON_EXCEPTION must be 0 or 1, got {setting!r}")
    if setting == "1" and size() > 1:
        abort_on_exception(True)
