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

**Rebuilding.** An owner that can make its communicators again over a healed
world (the survivors of a lost rank, ``mpidp.healing``) names how with
``rebuild=`` (or ``set_rebuild``): ``rebuild(world)``, a bound method (held
weakly) or a module's function, that frees its revoked communicators and makes new ones over
``world``, registered again. ``rebuild_all(world)`` calls each once, in the
order the owners first registered (the same on every rank: communicators are
made collectively); ``unrebuildable()`` names the communicators whose owner
cannot, which the healing refuses to go on with.

Rule: an entry is added and removed by the thread that makes or frees the
communicator; the lock only guards the table, never an MPI call.

Imports ``mpi4py.MPI`` only inside its functions: ``mpidp.runtime`` imports this
module before it decides whether that import may initialise MPI (never in a
multiprocessing child).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

__all__ = ["Record", "made", "free", "forget", "release", "listing", "revoke_all", "identify",
           "fold", "set_rebuild", "rebuilders", "unrebuildable", "rebuild_all"]


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
_table: dict[int, tuple] = {}  # id(comm) -> (comm, record, weak rebuild method or None)
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


def _weak(rebuild):
    """A bound method held weakly (its owner may be collected); a module's function as is."""
    if rebuild is None:
        return None
    if hasattr(rebuild, "__self__") and hasattr(rebuild, "__func__"):
        return weakref.WeakMethod(rebuild)
    return lambda: rebuild


def made(comm, owner: str, issuer: str = "the program's thread", *, rebuild=None):
    """Register ``comm`` (an mpi4py communicator just made, collectively) under ``owner``; returns it.

    Args:
        rebuild: the owner's bound method ``rebuild(world)`` that makes it again over a
            healed world (module docstring), or None: it cannot be.
    """
    from mpi4py import MPI  # noqa: PLC0415 (see the module's docstring)

    if comm == MPI.COMM_NULL:
        return comm
    record = Record(owner, issuer, comm.Get_size(), _key(comm, True))
    with _lock:
        _table[id(comm)] = (comm, record, _weak(rebuild))
    return comm


def set_rebuild(comm, rebuild) -> None:
    """Name (or with None, drop) how ``comm``'s owner rebuilds it (local)."""
    with _lock:
        entry = _table.get(id(comm))
        if entry is not None:
            _table[id(comm)] = (entry[0], entry[1], _weak(rebuild))


def free(comm) -> None:
    """``comm.Free()`` (collective), and forget it."""
    forget(comm)
    comm.Free()


def forget(comm) -> None:
    """Drop ``comm`` from the registry (local)."""
    with _lock:
        _table.pop(id(comm), None)


def release(comm) -> None:
    """Forget a revoked ``comm`` and free it: local under ULFM, and never raises (a rebuild's first step)."""
    forget(comm)
    try:
        comm.Free()
    except Exception:  # noqa: BLE001 (a revoked communicator's handle is all that is left)
        pass


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
        return [record for comm, record, _ in _table.values() if comm != MPI.COMM_NULL]


def revoke_all() -> int:
    """Revoke every registered communicator (ULFM's ``MPI_Comm_revoke``); returns how many.

    Raises:
        NotImplementedError: the MPI library has no ``MPI_Comm_revoke`` (MPICH, Intel MPI;
            Open MPI 5 has it under ``mpirun --with-ft ulfm``).
    """
    from mpi4py import MPI  # noqa: PLC0415

    with _lock:
        comms = [comm for comm, _, _ in _table.values() if comm != MPI.COMM_NULL]
    for comm in comms:
        try:
            comm.Revoke()
        except (NotImplementedError, MPI.Exception) as error:
            raise NotImplementedError(
                f"this MPI library cannot revoke a communicator ({error}); a job that "
                f"survives a lost rank needs one with ULFM (Open MPI 5: mpirun --with-ft ulfm)"
            ) from error
    return len(comms)


def rebuilders() -> list:
    """The live objects whose bound methods rebuild registered communicators (local)."""
    with _lock:
        methods = [weak() for _, _, weak in _table.values() if weak is not None]
    owners = {id(m.__self__): m.__self__ for m in methods if m is not None and hasattr(m, "__self__")}
    return list(owners.values())


def unrebuildable() -> list[str]:
    """The owners (and issuers) of registered communicators that no owner can rebuild (local)."""
    with _lock:
        entries = list(_table.values())
    return sorted({f"{record.owner} ({record.issuer})" for _, record, weak in entries
                   if weak is None})


def rebuild_all(world) -> int:
    """Rebuild every registered communicator over ``world`` (collective over ``world``).

    Each owner's ``rebuild(world)`` runs once, oldest owner first; an entry whose
    owner is gone (collected without freeing it) is released. Returns how many
    owners rebuilt.

    Raises:
        RuntimeError: a communicator that no owner can rebuild (``unrebuildable``);
            check it, on every rank, before anything collective.
    """
    stuck = unrebuildable()
    if stuck:
        raise RuntimeError(f"cannot rebuild these communicators over the healed world: {stuck}")
    with _lock:
        entries = list(_table.values())
    calls, seen = [], set()
    for comm, _, weak in entries:
        method = weak()
        if method is None:
            release(comm)
            continue
        key = (id(getattr(method, "__self__", None)), getattr(method, "__func__", method))
        if key not in seen:
            seen.add(key)
            calls.append(method)
    for method in calls:
        method(world)
    return len(calls)
