"""Spare ranks: the last K ranks of a launch stand by to take the place of a lost one (ULFM).

A ``Healer`` goes on at N-1 ranks after a lost rank; with spares the job keeps
its size. Launched at N+K ranks::

    import mpidp
    mpidp.stand_by(spares=K)          # first thing: N ranks train, the last K stand by
    ...                               # the model, DDP, optimizer, Checkpointer, Healer,
                                      # built on every rank, spares too
    for x, y in healer.batches(loader, steps=total):   # a spare waits in here
        with healer.guard():
            ...

What happens, in order:

1. **Stand by.** ``stand_by(spares=K)`` (collective over ``MPI.COMM_WORLD``)
   makes the first N ranks the world (``mpidp.runtime.world()``) and gives
   each of the last K a world of its own rank alone. A duplicate of
   ``MPI.COMM_WORLD``, the launch's communicator, keeps all of them together.
2. **Build alike.** A spare runs the script's constructors as every rank
   does, over its one-rank world: it then holds the same owners of
   communicators as a trainer, registered in the same order
   (``mpidp.communicators``), so that a heal's ``rebuild_all`` makes the same
   collective calls on a joining spare as on the survivors. Then it waits in
   ``Healer.batches()`` (``wait``): in a nonblocking barrier over the launch's
   communicator, tested with sleeps growing from 1 ms to 50 ms, so a spare
   holds no core.
3. **Wake.** A training rank is lost: the survivors revoke every registered
   communicator, the launch's among them, and the spares' barrier fails out
   (it also fails on the lost rank itself, whichever comes first).
4. **Replace** (``replace``, collective over the launch's survivors). All of
   them shrink the launch's communicator; each survivor tells its rank in
   the old world; the lost ranks' numbers go, lowest first, to the spares,
   lowest launch rank first; a split keyed by those numbers makes the new
   world. The survivors keep their ranks and a spare takes the lost one's
   number, hence its share of the data. With no spare left the new world is
   the survivors alone, one rank fewer. Spares left over stand by again.
5. **Heal.** The Healer goes on as without spares, the joined spare with the
   survivors: every owner rebuilds its communicators over the new world,
   the state comes from a survivor, the data is dealt again.
6. **End.** The trainers, done, enter the barrier (``release``); a spare
   whose barrier completes was never needed, and ``Healer.batches()`` ends
   its process (status 0) instead of returning to the script.

Without ULFM the spares stand by the same way and leave at the end; a lost
rank ends the job, as without spares. A joined spare gets the survivors'
torch.distributed groups and Horovod process sets, numbered as before
(``renumbered``): it stood outside them. Tested with mpidp's DDP, ZeRO stage
1, SyncBatchNorm, torch's DDP with a group and mpidp.horovod with a process
set (docs/healing.md, "What follows a heal").

Rules (docs/concurrency.md): ``stand_by``, ``wait``, ``replace`` and
``release`` run on the program's thread; the launch's communicator is used by
nothing else. ``stand_by`` comes before anything makes a communicator over
the world (a DDP, a Checkpointer, the default pool).
"""

from __future__ import annotations

import atexit
import dataclasses

from mpi4py import MPI

from . import communicators as _communicators
from . import errors as _errors
from . import runtime
from . import watchdog as _watchdog
from .comm import agreement
from .comm import ibarrier
from .comm import progress as _progress
from .comm.handle import collective

__all__ = ["stand_by", "standing_by", "launched", "spares_left", "trainers", "joined", "numbering",
           "renumbered", "wait", "replace", "release", "Replacement"]

# A spare tests its barrier with sleeps up to 50 ms from the start (the engine's back-off,
# without its spin): no core held, and woken well within the heal's other costs.
_LONGEST_SLEEP = 50e-3
_OWNER = "mpidp.spares: the launch's ranks, spares included"

# Written by the program's thread only, at stand_by and at each replace (collective moments).
_launch: list = []  # the launch's communicator: a duplicate of COMM_WORLD, then its shrinks
_spare = [False]  # this rank stands by
_left = [0]  # how many spares stand by
_trainers = [0]  # the launch's ranks less its spares: the world a spare joins
_released = [False]  # a trainer's release() ran
_joined = [False]  # this rank was a spare until the last replace
_numbering: list = []  # the last replace's old world's numbers -> ranks of the new world


def stand_by(spares: int) -> bool:
    """Let the last ``spares`` ranks of the launch stand by to replace lost ones (collective).

    Call it on every rank of ``MPI.COMM_WORLD`` right after ``import mpidp``, before
    anything makes a communicator over the world. See the module's docstring.

    Args:
        spares: how many of the launch's ranks stand by (0: none, the world stays
            ``MPI.COMM_WORLD``).

    Returns:
        Whether this rank trains now (False on a spare).

    Raises:
        ValueError: on every rank: ``spares`` is not an int from 0 to the launch's size
            less one, differs between ranks, or the world was fixed already (a second
            call, a heal) or has communicators made over it.
    """
    runtime.require_mpi()
    launch = MPI.COMM_WORLD
    size = launch.Get_size()
    problem = None
    if type(spares) is not int or not 0 <= spares < size:
        problem = f"spares must be an int from 0 to {size - 1} (the launch's size less one), " \
                  f"got {spares!r}"
    elif runtime.world() is not launch:
        problem = "stand_by() was called already, or a heal changed the world"
    elif _communicators.rebuilders():
        problem = (f"communicators were made over the world already, by "
                   f"{sorted({type(o).__name__ for o in _communicators.rebuilders()})}: call "
                   f"stand_by() before them")
    agreement.decide(launch, (spares, problem), lambda facts: _refusal(spares, facts),
                     "mpidp.stand_by(): the spares")
    if spares == 0:
        return True
    rank, trainers = launch.Get_rank(), size - spares
    _launch[:] = [_communicators.made(launch.Dup(), _OWNER, rebuild=_kept)]
    world = launch.Split(0 if rank < trainers else rank, rank)
    _spare[0], _left[0], _trainers[0] = rank >= trainers, spares, trainers
    runtime.set_world(world, heal=False)
    if not _spare[0]:  # a trainer that leaves otherwise (a preemption's stop) lets them go too
        atexit.register(release)
    return not _spare[0]


def _refusal(spares, facts: list[tuple]) -> ValueError | None:
    """``stand_by``'s error from every rank's ``(spares, problem)``, or None."""
    problems = sorted({p for _, p in facts if p} |
                      ({f"spares differs between ranks: {[s for s, _ in facts]}"}
                       if len({repr(s) for s, _ in facts}) > 1 else set()))
    return ValueError(f"mpidp.stand_by(spares={spares!r}): {'; '.join(problems)}") if problems \
        else None


def _kept(_world) -> None:
    """The launch's communicator in ``rebuild_all``: ``replace`` made it again already."""


def launched() -> bool:
    """Whether ``stand_by`` set spares aside in this job (the same on every rank)."""
    return bool(_launch)


def standing_by() -> bool:
    """Whether this rank is a spare that has not joined the world (local)."""
    return _spare[0]


def spares_left() -> int:
    """How many spares stand by now (as of this rank's last ``stand_by`` or ``replace``)."""
    return _left[0]


def trainers() -> int:
    """The size of the world a spare joins: the launch's ranks less the spares (a spare stands
    by only while no heal has shrunk the world); 0 without spares."""
    return _trainers[0]


def joined() -> bool:
    """Whether this rank stood by until the last ``replace`` and joined the world there (local):
    it holds no state of the old world, and its owners take the survivors' facts."""
    return _joined[0]


def numbering() -> list:
    """The last ``replace``'s old world's ranks as ranks of the new world, None where one was
    lost with no spare left: a spare counts as the rank whose place it took (the same on
    every rank of the new world, joined spares included)."""
    return list(_numbering)


def renumbered(old: MPI.Comm, world: MPI.Intracomm) -> list:
    """``old``'s ranks as ranks of the healed ``world``, None for a lost one (local).

    ``old``: the world before the heal or a communicator over the same ranks in the same
    order (its duplicate). With spares, ``numbering()`` (the same on every rank, on a
    joined spare too, whose own ``old`` is its one-rank world); without, the ranks'
    translation.
    """
    if launched():
        return numbering()
    translated = MPI.Group.Translate_ranks(old.Get_group(), list(range(old.Get_size())),
                                           world.Get_group())
    return [None if rank == MPI.UNDEFINED else rank for rank in translated]


def wait() -> bool:
    """A spare stands by (collective over the launch's communicator with ``release`` or
    ``replace``): True when a heal needs the spares, False when the training ended.

    The barrier's completion means every trainer called ``release``; its failure, a
    revoked launch's communicator or a lost member of it, that a heal has begun.
    """
    comm = _launch[0]
    barrier = ibarrier(comm=comm)
    try:
        _progress.poll(lambda: _progress.test(barrier),
                       backoff=_progress.Backoff(spin=0.0, yield_for=0.0, max_sleep=_LONGEST_SLEEP))
    except Exception as error:
        if not _errors.lost_rank(error):
            raise
        return True
    _second_barrier(comm)
    return False


def release() -> None:
    """The trainers, done, let the spares go (collective over the launch's communicator).

    Two barriers: past the second, every spare has seen the first complete, so a
    trainer that then ends (without MPI_Finalize after a heal: to ULFM, a lost rank)
    cannot fail a spare's first one. A failure in the first (a rank lost at the
    very end) goes through ``replace`` with every trainer done, which the spares
    take as the end. Runs once: from ``Healer.batches()`` at the end, else at
    exit (a stop for a preemption). A no-op without spares.
    """
    if not _launch or _spare[0] or _released[0]:
        return
    _released[0] = True
    comm = _launch[0]
    try:  # nonblocking, as the spares' (MPI matches no blocking call with a nonblocking one)
        ibarrier(comm=comm).wait()
    except Exception as error:
        if not _errors.lost_rank(error):
            raise
        comm.Revoke()
        replace(None, done=True)
        return
    _second_barrier(comm)


def _second_barrier(comm) -> None:
    try:
        collective(comm, "Barrier", (), "mpidp spares: every spare saw the end")
    except Exception as error:  # a trainer that passed it ended: the end stands
        if not _errors.lost_rank(error):
            raise


@dataclasses.dataclass(frozen=True)
class Replacement:
    """What ``replace`` decided, the same on every rank that took part.

    Attributes:
        world: the new world on its members; None on a spare that stands by still
            (and on every rank when ``done``).
        lost: the lost trainers, as ranks of ``MPI.COMM_WORLD``.
        joined: the spares that took their places (ranks of ``MPI.COMM_WORLD``), in
            the order of ``lost``.
        left: spares that stand by still.
        ok: whether every survivor said it can heal.
        numbers: the lost trainers' ranks in the old world.
        size: the old world's size.
        done: the trainers had finished (``release`` failed): the spares may leave.
    """

    world: MPI.Intracomm | None
    lost: list
    joined: list
    left: int
    ok: bool
    numbers: list = dataclasses.field(default_factory=list)
    size: int = 0
    done: bool = False


def _no_trainer(roles: list[tuple]) -> RuntimeError | None:
    """``replace``'s error when no trainer survived (and none had finished), else None."""
    if any(role is not None for role, _ in roles):
        return None
    return RuntimeError("mpidp spares: every training rank was lost; resume from the last "
                        "checkpoint")


def replace(world: MPI.Intracomm | None, ok: bool = True, *, done: bool = False) -> Replacement:
    """Shrink the launch's communicator and make the new world, a spare in each lost rank's place.

    Collective over the launch's survivors: every surviving trainer (``world``: its
    old world, revoked; ``ok``: whether it can heal) and every spare (``world``
    None). The spares' places follow the module's docstring, step 4.
    """
    old = _launch[0]
    launch = _watchdog.watched("mpidp spares: the launch's shrink (MPI_Comm_shrink)", old.Shrink)
    _communicators.release(old)
    _launch[0] = _communicators.made(launch, _OWNER, rebuild=_kept)
    me = None
    if world is not None:
        group = world.Get_group()
        me = (world.Get_rank(), MPI.Group.Translate_ranks(
            group, list(range(world.Get_size())), MPI.COMM_WORLD.Get_group()), ok)
        group.Free()
    roles = agreement.decide(launch, ("done" if done else me, MPI.COMM_WORLD.Get_rank()),
                             _no_trainer, "mpidp spares: who stands where?")
    if any(role == "done" for role, _ in roles):
        return Replacement(None, [], [], _left[0], True, done=True)
    trainers = {role[0]: role for role, _ in roles if role is not None}
    members = next(iter(trainers.values()))[1]
    lost = [number for number in range(len(members)) if number not in trainers]
    spares = [index for index, (role, _) in enumerate(roles) if role is None]
    takes = dict(zip(spares, lost))
    number = me[0] if me is not None else takes.get(launch.Get_rank())
    new = launch.Split(MPI.UNDEFINED if number is None else 0, number or 0)
    _left[0] = len(spares) - len(takes)
    kept = sorted([*trainers, *lost[:len(takes)]])
    _numbering[:] = [kept.index(n) if n in kept else None for n in range(len(members))]
    _joined[0] = number is not None and _spare[0]
    if _joined[0]:  # joined: leaves as the trainers do
        _spare[0] = False
        atexit.register(release)
    return Replacement(None if number is None else new, [members[n] for n in lost],
                       [roles[index][1] for index in takes], _left[0],
                       all(role[2] for role in trainers.values()), lost, len(members))
