"""Every communicator mpidp makes, with its owner and the thread that issues on it.

Each place that creates a communicator (``Dup``, ``Split``, ``Create_group``...)
registers it here at that collective moment with ``made(comm, owner, issuer)``,
and its ``Free`` goes through ``free(comm)``. ``listing()`` names them all, for
reports and for a job that must revoke and rebuild what it owns after a lost
rank (``revoke_all``, where the MPI library has User-Level Failure Mitigation).

Each gets a ``key`` that names it alike on every one of its ranks, for the flight
recorder (``mpidp.recorder``), whose files ``python -m mpidp trace`` lines up across
ranks: its members as ranks of ``COMM_WORLD`` and how many communicators over the
same members this process registered before it ("ranks 0-3 #2"). Communicators are
made collectively, in the same order on all their ranks, so the count agrees.

Rule: an entry is added and removed by the thread that makes or frees the
communicator; the lock only guards the table, never an MPI call.

Imports ``mpi4py.MPI`` only inside its functions: ``mpidp.runtime`` imports this
module before it decides whether that import may initialise MPI (never in a
multiprocessing child).
"""

from __future__ import annotations

import dataclasses
import threading

__all__ = ["Record", "made", "free", "listing", "revoke_all", "identify", "fold"]


@dataclasses.dataclass(frozen=True)
class Record:
    """One communicator of mpidp's.

    Attributes:
        owner: what made it and uses it ("DDP 0x7f.. control", "the default pool").
        issuer: the thread that issues its collectives ("the program's thread", "the
            progress thread", "the watchdog's thread"...).
        size: its number of ranks.
        key: its name, the same on each of its ranks ("ranks 0-3 #2", see above).
    """

    owner: str
    issuer: str
    size: int
    key: str = ""


_lock = threading.Lock()
_table: dict[int, tuple] = {}  # id(comm) -> (comm, record)
_counts: dict[tuple, int] = {}  # (members, registered?) -> communicators keyed so far


def _members(comm) -> tuple[int, ...]:
    """The ranks of ``comm`` as ranks of ``COMM_WORLD`` (local: groups only)."""
    from mpi4py import MPI  # noqa: PLC0415

    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def fold(ranks) -> str:
    """Sorted ranks as runs: "0-2, 5"."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _key(comm, registered: bool) -> str:
    members = _members(comm)
    with _lock:
        count = _counts.get((members, registered), 0)
        _counts[members, registered] = count + 1
    return f"ranks {fold(members)} {'' if registered else '(not made by mpidp) '}#{count}"


def made(comm, owner: str, issuer: str = "the program's thread"):
    """Register ``comm`` (an mpi4py communicator just made, collectively) under ``owner``; returns it."""
    from mpi4py import MPI  # noqa: PLC0415 (see the module's docstring)

    if comm == MPI.COMM_NULL:
        return comm
    record = Record(owner, issuer, comm.Get_size(), _key(comm, True))
    with _lock:
        _table[id(comm)] = (comm, record)
    return comm


def free(comm) -> None:
    """``comm.Free()`` (collective), and forget it."""
    with _lock:
        _table.pop(id(comm), None)
    comm.Free()


def identify(comm) -> Record:
    """The record of ``comm``: its registered one, or one made now for a communicator
    mpidp did not make (``COMM_WORLD``, a program's own), keyed at its first use here."""
    from mpi4py import MPI  # noqa: PLC0415

    with _lock:
        found = _table.get(id(comm))
    if found is not None:
        return found[1]
    for name in ("COMM_WORLD", "COMM_SELF"):
        if comm == getattr(MPI, name):
            return Record(f"MPI.{name}", "the program's thread", comm.Get_size(), name)
    return Record(comm.Get_name() or "a communicator of the program's", "the program's thread",
                  comm.Get_size(), _key(comm, False))


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
