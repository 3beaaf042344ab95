"""Horovod's world: the communicators ``hvd.init`` made, and what ``hvd.shutdown`` must reset.

The lowest module of mpidp.horovod: basics, process_sets and requests read the
world here, and a module holding per-run state registers what to forget at
shutdown (``on_shutdown``), so that none of them imports another upwards.
"""

from __future__ import annotations

from mpi4py import MPI

from .. import communicators as _communicators
from ..comm import agreement as _agreement
from .timeline import Timeline

_NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class _State:
    world: MPI.Intracomm | None = None
    local: MPI.Intracomm | None = None
    cross: MPI.Intracomm | None = None
    homogeneous = True
    timeline: Timeline | None = None


_state = _State()


def _world() -> MPI.Intracomm:
    if _state.world is None:
        raise ValueError(_NOT_INITIALIZED)
    return _state.world


def make_world(base: MPI.Intracomm, label: str) -> MPI.Intracomm:
    """Horovod's world (a duplicate of ``base``), its node's ranks and one rank per node, and
    whether every node holds as many ranks, into ``_state`` (collective over ``base``;
    ``label``: the node sizes' allgather, as the stall watchdog names it)."""
    world = _communicators.made(base.Dup(), "hvd.init: Horovod's world")
    local = _communicators.made(world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank()),
                                "hvd.init: the node's ranks")
    cross = _communicators.made(world.Split(local.Get_rank(), world.Get_rank()),
                                "hvd.init: one rank per node")
    _, homogeneous = _agreement.judged(world, local.Get_size(),
                                       lambda sizes: len(set(sizes)) == 1, label)
    _state.world, _state.local, _state.cross, _state.homogeneous = world, local, cross, homogeneous
    return world


_forgetters: list = []  # called by hvd.shutdown, before the communicators are freed


def on_shutdown(forget) -> None:
    """Have ``hvd.shutdown`` call ``forget()`` (a module's per-run state), once per shutdown."""
    _forgetters.append(forget)


def forget_all() -> None:
    for forget in _forgetters:
        forget()
