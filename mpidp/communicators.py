"""Every communicator mpidp makes, with its owner and the thread that issues on it.

Each place that creates a communicator (``Dup``, ``Split``, ``Create_group``...)
registers it here at that collective moment with ``made(comm, owner, issuer)``,
and its ``Free`` goes through ``free(comm)``. ``listing()`` names them all, for
reports and for a job that must revoke and rebuild what it owns after a lost
rank (``revoke_all``, where the MPI library has User-Level Failure Mitigation).

Rule: an entry is added and removed by the thread that makes or frees the
communicator; the lock only guards the table, never an MPI call.

Imports ``mpi4py.MPI`` only inside its functions: ``mpidp.runtime`` imports this
module before it decides whether that import may initialise MPI (never in a
multiprocessing child).
"""

from __future__ import annotations

import dataclasses
import threading

__all__ = ["Record", "made", "free", "listing", "revoke_all"]


@dataclasses.dataclass(frozen=True)
class Record:
    """One communicator of mpidp's.

    Attributes:
        owner: what made it and uses it ("DDP 0x7f.. control", "the default pool").
        issuer: the thread that issues its collectives ("the program's thread", "the
            progress thread", "the watchdog's thread"...).
        size: its number of ranks.
    """

    owner: str
    issuer: str
    size: int


_lock = threading.Lock()
_table: dict[int, tuple] = {}  # id(comm) -> (comm, record)


def made(comm, owner: str, issuer: str = "the program's thread"):
    """Register ``comm`` (an mpi4py communicator just made, collectively) under ``owner``; returns it."""
    from mpi4py import MPI  # noqa: PLC0415 (see the module's docstring)

    if comm == MPI.COMM_NULL:
        return comm
    record = Record(owner, issuer, comm.Get_size())
    with _lock:
        _table[id(comm)] = (comm, record)
    return comm


def free(comm) -> None:
    """``comm.Free()`` (collective), and forget it."""
    with _lock:
        _table.pop(id(comm), None)
    comm.Free()


def listing() -> list[Record]:
    """The communicators mpidp holds now, oldest first."""
    from mpi4py import MPI  # noqa: PLC0415

    with _lock:
        return [record for comm, record in _table.values() if comm != MPI.COMM_NULL]


def revoke_all() -> int:
    """Revoke every registered communicator (ULFM's ``MPI_Comm_revoke``); returns how many.

    Raises:
        NotImplementedError: the MPI library has no ``MPI_Comm_revoke`` (MPICH, Intel MPI;
            Open MPI 5 has it under ``mpirun --with-ft ulfm``).
    """
    from mpi4py import MPI  # noqa: PLC0415

    with _lock:
        comms = [comm for comm, _ in _table.values() if comm != MPI.COMM_NULL]
    for comm in comms:
        try:
            comm.Revoke()
        except (NotImplementedError, MPI.Exception) as error:
            raise NotImplementedError(
                f"this MPI library cannot revoke a communicator ({error}); a job that "
                f"survives a lost rank needs one with ULFM (Open MPI 5: mpirun --with-ft ulfm)"
            ) from error
    return len(comms)
