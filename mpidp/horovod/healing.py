"""``mpidp.horovod`` after a heal: its world, process sets and optimizers over the survivors.

Horovod's state is mpidp's own communicators (``hvd.init``'s duplicate of the
world, the node's and the cross communicators, each process set's three), so
a heal (``mpidp.Healer``, ``mpidp.communicators.rebuild_all``) makes them again
over the survivors, as ``hvd.init`` would at the new size:

- ``hvd.size()``/``hvd.rank()`` and the node facts are the survivors';
- every process set keeps its id and its surviving members, renumbered as
  ranks of the new world (a set whose members were all lost is removed);
- pending handles are forgotten (their collectives cannot finish: the step
  that made them is taken back), and every ``DistributedOptimizer`` lays
  its buckets out again over its set (collective over the set, in the order
  the optimizers were made, the same on every rank).

Only a Horovod started over the whole world (``hvd.init()`` with no ``comm``)
follows; one over a communicator of the program's is not rebuilt (the heal
refuses it, naming its communicators).
"""

from __future__ import annotations

import weakref

from mpi4py import MPI

from .. import communicators as _communicators
from .. import runtime as _runtime
from .. import spares as _spares
from ..comm import agreement as _agreement
from . import process_sets as _sets
from . import state as _state_module
from .state import _state

__all__ = ["adopt", "track", "rebuild", "follows"]

_optimizers: list = []  # weak references to every DistributedOptimizer, oldest first
_over_world: list = []  # [True] while hvd.init's world is a duplicate of mpidp's whole world


def _comms() -> list:
    sets = [s for _, s in sorted(_sets._registry.items())]
    node = [c for s in sets if s._node and s._node[0] is not None
            for c in (s._node[0].node, s._node[0].cross)]
    return [_state.local, _state.cross, *(c for s in sets for c in (s.comm, s.data, s.control)
                                          if c is not None and c != MPI.COMM_NULL), *node]


def adopt(base=None) -> None:
    """Name ``rebuild`` for Horovod's communicators made so far (local), where ``hvd.init``
    was given mpidp's whole world: ``base``, its communicator, when it made them."""
    if base is not None:
        _over_world[:] = [base == _runtime.world()]
    if _over_world and _over_world[0]:
        for comm in _comms():
            _communicators.set_rebuild(comm, rebuild)


_sets.on_made.append(adopt)  # a set added later follows a heal too


def track(optimizer) -> None:
    """Lay ``optimizer``'s buckets out again after a heal (local)."""
    _optimizers[:] = [ref for ref in _optimizers if ref() is not None] + [weakref.ref(optimizer)]
    adopt()  # the set's shared-memory node, which its layout may have made


def follows(optimizer) -> bool:
    """Whether ``optimizer`` is a DistributedOptimizer that a heal carries on: over the global
    process set of a Horovod started over mpidp's whole world (local)."""
    return (any(ref() is optimizer for ref in _optimizers) and bool(_over_world)
            and _over_world[0] and optimizer._process_set is _sets.global_process_set)


def rebuild(world: MPI.Intracomm) -> None:
    """Horovod's world, process sets and optimizers again over ``world`` (collective over it;
    ``mpidp.communicators.rebuild_all`` calls it once per heal)."""
    kept = _spares.renumbered(_state.world, world)
    _state_module.forget_all()  # pending handles: their step is taken back
    # the survivors' sets (a joined spare's were registered as it stood by: its facts are none)
    mine = None if _spares.joined() else {number: s.ranks for number, s in _sets._registry.items()}
    _, table = _agreement.judged(world, mine, _survivors_sets,
                                 "hvd process sets after a heal: which are there?")
    for number, ranks in table.items():
        if number not in _sets._registry:  # one a joined spare did not register
            _sets._registry[number] = _sets.ProcessSet(ranks)
    entries = sorted(_sets._registry.items())
    sets = [s for _, s in entries]
    for comm in _comms():
        _communicators.release(comm)
    for process_set in sets:
        process_set.comm = process_set.data = process_set.control = process_set._node = None
    hvd_world = _state_module.make_world(world, "hvd.init (node sizes) after a heal")
    for number, process_set in entries:
        ranks = [kept[r] for r in table.get(number, ()) if kept[r] is not None]
        if process_set is _sets.global_process_set:
            ranks = list(range(world.Get_size()))
        if not ranks:  # every member lost (or a set the survivors do not hold): gone
            del _sets._registry[number]
            process_set.process_set_id = None
            continue
        process_set.ranks = ranks
        comm = (hvd_world if process_set is _sets.global_process_set else
                hvd_world.Create_group(hvd_world.Get_group().Incl(ranks)))
        process_set.process_set_id = None
        process_set._attach(comm, number)
    for ref in list(_optimizers):
        optimizer = ref()
        if optimizer is not None:
            optimizer._layout()
    adopt()


def _survivors_sets(facts: list) -> dict:
    """The process sets' ranks by id, from the survivors' registries (the judge of each rank's
    ``{id: ranks}``, None on a joined spare); the survivors' are alike."""
    return next((sets for sets in facts if sets is not None), {})
