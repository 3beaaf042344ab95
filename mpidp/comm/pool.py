"""``Pool``, duplicates of a communicator handed out round-robin; what a ``comm`` stands for.

Round-robin over duplicated communicators lets several collectives progress at
once, as the DDP paper's round-robin process groups do; collectives must still
be issued in the same order on every rank.
"""

from __future__ import annotations

import itertools
import os
import threading

from mpi4py import MPI

from .. import _args, settings
from .. import communicators as _communicators
from .. import runtime as _runtime
from .. import watchdog as _watchdog

__all__ = ["Pool", "default_pool"]


class Pool:
    """Duplicates of one communicator, handed out round-robin.

    Args:
        comm: the communicator to duplicate (default: the world, ``mpidp.runtime.world()``).
        size: how many duplicates (>= 1). Creating a pool is collective over ``comm``.
    """

    def __init__(self, comm: MPI.Intracomm | None = None, size: int = 2):
        _runtime.require_mpi()
        _args.check_int("pool size", size, minimum=1)
        base = _runtime.world() if comm is None else comm
        if not isinstance(base, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py Intracomm, got {type(base).__name__}")
        slot = _watchdog.begin("MPI_Comm_dup for a Pool (collective)")
        try:
            owner = f"a pool of {size} over {base.Get_name() or 'a communicator'}"
            self.comms = [_communicators.made(base.Dup(), owner) for _ in range(size)]
        finally:
            slot.current = None
        # itertools.cycle's next() is one C call: atomic under the GIL, so two threads
        # never take the same turn. Which member a collective gets still follows the
        # order the threads issue in; the rule (docs/concurrency.md) is that one thread
        # issues a given pool's collectives, or the program orders them itself.
        self._cycle = itertools.cycle(self.comms)

    @property
    def rank(self) -> int:
        return self.comms[0].Get_rank()

    @property
    def size(self) -> int:
        return self.comms[0].Get_size()

    def next(self) -> MPI.Intracomm:
        """Return the next communicator of the pool (round-robin)."""
        return next(self._cycle)

    def free(self) -> None:
        """Free the duplicated communicators (collective)."""
        for comm in self.comms:
            _communicators.free(comm)
        self.comms = []


def env_size() -> int:
    """``MPIDP_POOL_SIZE`` (default 2): the size of the default pool and of a backend group's."""
    return settings.get("MPIDP_POOL_SIZE")


_default: list = []  # the default pool, once made
_default_lock = threading.Lock()


def default_pool() -> Pool:
    """Return the pool over the world (``MPI.COMM_WORLD``, or its survivors after a heal)
    used when ``comm`` is None.

    Its size comes from ``MPIDP_POOL_SIZE`` (default 2). Created on first use,
    which is collective; two threads that use it first at once make it once
    (the lock), not twice in an order that may differ between ranks.
    """
    if _default:
        return _default[0]
    with _default_lock:
        if not _default:
            pool = Pool(_runtime.world(), env_size())
            for comm in pool.comms:
                _communicators.set_rebuild(comm, _forget_default)
            _default.append(pool)
    return _default[0]


def _forget_default(_world) -> None:
    """After a heal (``mpidp.healing``): the next use makes the pool over the survivors."""
    with _default_lock:
        for comm in _default[0].comms if _default else []:
            _communicators.release(comm)
        _default.clear()


# A forked child must not reuse the parent's cached pool: forgetting it makes
# the child's first collective go through require_mpi(), which refuses there.
os.register_at_fork(after_in_child=_default.clear)


def _base(comm) -> MPI.Intracomm:
    """The communicator ``comm`` stands for, to check ranks and sizes against.

    Takes no pool member and creates no default pool: an argument error found
    with it leaves this rank in step with the others.
    """
    _runtime.require_mpi()  # one flag; a clear error in a multiprocessing child
    if comm is None:
        return _runtime.world()
    if isinstance(comm, Pool):
        if not comm.comms:
            raise ValueError("comm is a Pool that has been freed")
        return comm.comms[0]
    if isinstance(comm, MPI.Intracomm):
        return comm
    raise TypeError(f"comm must be None, an mpidp.comm.Pool or an mpi4py Intracomm, "
                    f"got {type(comm).__name__}")


def _collective_comm(comm) -> MPI.Intracomm:
    """Take the communicator a collective runs on; call it only once every argument is checked."""
    if comm is None:
        return default_pool().next()
    if isinstance(comm, Pool):
        return comm.next()
    if isinstance(comm, MPI.Intracomm):
        return comm
    raise TypeError(f"comm must be None, an mpidp.comm.Pool or an mpi4py Intracomm, "
                    f"got {type(comm).__name__}")


def _p2p_comm(comm) -> MPI.Intracomm:
    # Point-to-point messages between two ranks are ordered only within one
    # communicator, so a pool always uses its first member.
    if comm is None:
        return default_pool().comms[0]
    if isinstance(comm, Pool):
        return comm.comms[0]
    return comm
