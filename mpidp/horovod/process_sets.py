"""Process sets: subsets of the ranks that run collectives among themselves.

A ``ProcessSet`` names ranks of the communicator ``hvd.init`` was given. Once
registered (by ``hvd.init(process_sets=...)`` or ``add_process_set``, which are
collective over every rank, in the same order everywhere, as in Horovod), each
member holds two duplicates of the set's communicator: one for the data of the
set's collectives and one for their control messages (``requests``). The communicators are mpidp's own, so the set's traffic
never mixes with other traffic.
"""

from __future__ import annotations

import threading

import torch
from mpi4py import MPI

from .. import _args
from ..comm import agreement as _agreement
from ..ddp import options as _ddp_options
from .. import communicators as _communicators
from .. import spares as _spares
from . import state as _state

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


class ProcessSet:
    """Ranks that run collectives among themselves (``process_set=`` on every collective).

    Args:
        ranks_or_comm: the ranks (of the communicator ``hvd.init`` was given), or an
            mpi4py communicator whose ranks they are (translated when registered).
    """

    def __init__(self, ranks_or_comm):
        self._given = None
        if isinstance(ranks_or_comm, MPI.Comm):
            self._given, self.ranks = ranks_or_comm, None
        else:
            try:
                ranks = sorted(ranks_or_comm)
            except TypeError:
                raise TypeError(f"ranks_or_comm must be a list of ranks or an mpi4py "
                                f"communicator, got {ranks_or_comm!r}") from None
            if not ranks or not all(_args.is_int(r) and r >= 0 for r in ranks) \
                    or len(set(ranks)) != len(ranks):
                raise ValueError(f"ranks_or_comm must hold distinct ranks >= 0, at least one, "
                                 f"got {list(ranks_or_comm)}")
            self.ranks = ranks
        self.process_set_id = None
        self.comm = self.data = self.control = None  # set on members when registered
        self.lock = threading.Lock()  # a collective's control and data messages start together
        self._node = None  # (mpidp.comm.shm.Node or None,) once asked for: see shared_node

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    def included(self) -> bool:
        """Whether this rank belongs to the set (False before it is registered)."""
        return self.data is not None

    def size(self) -> int | None:
        """Number of ranks in the set (None before it is registered)."""
        return None if self.ranks is None or self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This rank's rank within the set (None where it is not a member)."""
        return self.data.Get_rank() if self.data is not None else None

    def shared_node(self):
        """The set's ranks grouped by node for shared-memory reduction, or None (collective, once).

        None where the nodes hold one rank of the set each, or different numbers,
        or ``MPIDP_SHARED_MEMORY=0``. The Node's communicators carry the barriers of
        the set's optimizers, which reduce under ``lock``, one bucket at a time.
        """
        if self._node is None:
            self._node = (_ddp_options.shared_memory_node(None, self.comm, torch.device("cpu")),)
        return self._node[0]

    def _attach(self, comm: MPI.Intracomm, process_set_id: int) -> None:
        self.process_set_id = process_set_id
        if comm != MPI.COMM_NULL:
            owner = f"hvd process set {process_set_id}"
            self.comm = _communicators.made(comm, owner)
            self.data = _communicators.made(comm.Dup(), owner + ": its data")
            self.control = _communicators.made(comm.Dup(), owner + ": its control messages")

    def _detach(self) -> None:
        if self._node is not None and self._node[0] is not None:
            self._node[0].free()
        self._node = None
        for comm in (self.data, self.control, self.comm):
            if comm is not None and comm != MPI.COMM_NULL:
                _communicators.free(comm)
        self.comm = self.data = self.control = None
        self.process_set_id = None


global_process_set = ProcessSet([0])  # its ranks are set by hvd.init
_registry: dict[int, ProcessSet] = {}


def _translate(given: MPI.Comm, world: MPI.Intracomm) -> list[int] | None:
    if given == MPI.COMM_NULL:
        return None
    ranks = MPI.Group.Translate_ranks(given.Get_group(), list(range(given.Get_size())),
                                      world.Get_group())
    return sorted(ranks)


def _register(process_set: ProcessSet, world: MPI.Intracomm) -> ProcessSet:
    """Collective over ``world``: check every rank names the same set, then make its communicators."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet or a list of ranks, "
                        f"got {type(process_set).__name__}")
    ranks = process_set.ranks
    if process_set._given is not None:
        ranks = _translate(process_set._given, world)
    # a spare (mpidp.stand_by) names the ranks of the world it may join, and is in no set
    # until it joins: a heal that lets it in makes the sets' communicators (healing.rebuild)
    spare = _spares.standing_by()
    size = _spares.trainers() if spare else world.Get_size()
    problem = None
    if process_set.process_set_id is not None:
        problem = f"{process_set} is registered already"
    elif ranks is not None and ranks[-1] >= size:
        problem = f"ranks {ranks} go beyond the {size} ranks of hvd.init's communicator"
    elif ranks is not None and any(p.ranks == ranks for p in _registry.values()):
        problem = f"a process set with ranks {ranks} is registered already"
    every = _agreement.decide(world, (problem, ranks), _judge_ranks,
                              "add_process_set (ranks check)")
    process_set.ranks = next(r for _, r in every if r is not None)
    comm = MPI.COMM_NULL if spare else world.Create_group(world.Get_group().Incl(process_set.ranks))
    process_set._attach(comm, max(_registry, default=-1) + 1)
    _registry[process_set.process_set_id] = process_set
    return process_set


def _judge_ranks(reports: list) -> ValueError | None:
    """Every rank's (problem, ranks): a problem anywhere, or ranks that differ."""
    problems = [problem for problem, _ in reports]
    if any(problems):
        return ValueError(f"add_process_set: {_agreement.by_rank(problems)}")
    named = [ranks for _, ranks in reports if ranks is not None]
    if not named or any(ranks != named[0] for ranks in named):
        named = _agreement.by_rank([str(ranks) for _, ranks in reports])
        return ValueError(f"add_process_set: every rank must name the same ranks, in the same "
                          f"order of calls, got {named}")
    return None


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (collective over every rank, same sets in the same order).

    Args:
        process_set: a ``ProcessSet`` or a list of ranks.

    Returns:
        The registered ``ProcessSet``.
    """
    world = _state._world()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    _register(process_set, world)
    for made in on_made:
        made()
    return process_set


# What runs after add_process_set made a set's communicators, on the program's thread:
# mpidp.horovod.healing adds its adopt (so that they follow a heal) when it is imported.
on_made: list = []


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` and free its communicators (collective over every rank).

    Returns:
        True if it was registered, False if not (or if it is the global set, which stays).
    """
    _state._world()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    if process_set is global_process_set or _registry.get(process_set.process_set_id) \
            is not process_set:
        return False
    del _registry[process_set.process_set_id]
    process_set._detach()
    return True


def _clear() -> None:
    for process_set in list(_registry.values()):
        process_set._detach()
    _registry.clear()
