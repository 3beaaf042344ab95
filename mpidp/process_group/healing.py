"""torch.distributed groups over ``"mpidp"`` after a heal: made again over the survivors.

A torch ``ProcessGroup`` holds its rank and size in C++, fixed when it is made:
torch's DDP reducer divides by that size, FSDP and DeviceMesh read it, and no
call changes it (``ProcessGroup.__init__`` run again on the object leaves it as
it was). So a group cannot follow a heal in place. The rule instead, as a run
restarted at the new size would do it:

1. The default group is made again: every old group of mpidp's is closed
   (its revoked communicators released, its pending operations failed, every
   later call raising that a heal replaced it), ``destroy_process_group``
   forgets torch's tables, and ``init_process_group("mpidp")`` runs over the
   survivors (``mpidp.runtime.world()``), with a process-local store: the
   rendezvous store's server thread on rank 0 does not follow a heal.
2. Every group made with ``new_group`` is made again over its surviving
   members, their ranks those of the new world, with its timeout. Every
   survivor makes them in one order (the union of the survivors' groups,
   sorted by name, agreed), as torch's ``new_group`` wants; a group with no
   survivor is gone.
3. ``healed(group)`` names the group that stands for an old one now;
   ``dist.group.WORLD`` and calls without ``group=`` reach the new default
   group by themselves. torch's ``DistributedDataParallel`` follows with
   ``follow(ddp)`` (its ``_update_process_group``, which torch keeps for a
   world that shrinks: new buckets, the new size); ``mpidp.Healer`` calls it
   for the Checkpointer's model.

``adopt(group)`` (the backend's creator) names ``rebuild`` as the way every
communicator of a group is made again (``mpidp.communicators``), so that one
call per heal remakes them all. Groups built on a world whose default group is
not mpidp's cannot follow (the heal refuses them, naming them).
"""

from __future__ import annotations

import datetime
import weakref

import torch.distributed as dist
from mpi4py import MPI

from .. import communicators as _communicators
from .. import errors as _errors
from .. import spares as _spares
from ..comm import agreement

__all__ = ["adopt", "rebuild", "healed", "group_over", "follow", "problem", "ddp_problem", "arm",
           "takes", "raise_lost"]

_c10d = dist.distributed_c10d
_replaced: dict = {}  # an old group -> the group made for it by a heal (None: no survivor)
_over: dict = {}  # the last heal's new groups by their ranks (group_over)
_armed: list = []  # a Healer that can heal is there (arm)
_lost: list = []  # lost-rank errors a future did not carry (takes), until raise_lost


def arm() -> None:
    """A ``mpidp.Healer`` will heal a lost rank: ``takes`` keeps lost-rank errors from futures."""
    _armed[:] = [True]


def takes(error: BaseException) -> bool:
    """Whether a future's lost-rank ``error`` is kept for ``raise_lost`` instead (any thread).

    torch's DistributedDataParallel reads its buckets' futures in C++, which
    crashes (SIGSEGV) on a future that holds an error; so where a Healer can
    heal, a future whose operation lost a rank gets its tensors unreduced, and
    the Healer's ``guard()`` raises the error when the step ends: the step is
    taken back, and nothing computed from those tensors is kept.
    """
    if not _armed or not _errors.lost_rank(error):
        return False
    _lost.append(error)
    return True


def raise_lost() -> None:
    """Raise the first lost-rank error ``takes`` kept since the last heal (local)."""
    if _lost:
        raise _lost[0]


# Every group the backend made on this rank (the program's thread makes and heals them). Held
# weakly: a group torch has destroyed leaves. The backend's class is not imported here (the
# package imports this module), so "is it ours" is "was it adopted".
_adopted: weakref.WeakSet = weakref.WeakSet()


def _is_ours(group) -> bool:
    return group in _adopted


def adopt(group) -> None:
    """Have ``rebuild`` make ``group``'s communicators again after a heal (local)."""
    _adopted.add(group)
    for comm in (*group._pool.comms, group._chunk_comm, group._mpi):
        _communicators.set_rebuild(comm, rebuild)  # the world, not registered, is left out


def _members(group) -> list[int]:
    """``group``'s global ranks in group-rank order; [] for the default group."""
    if group is _c10d._world.default_pg:
        return []
    ranks = _c10d._world.pg_group_ranks.get(group, {})
    return sorted(ranks, key=ranks.get)


def _ours() -> list:
    """This rank's groups over "mpidp", the default first (torch's order of making them)."""
    return [group for group in _c10d._world.pg_map if _is_ours(group)]


def problem() -> str | None:
    """Why torch's groups cannot follow a heal (None: they can, or there are none; local)."""
    if not dist.is_initialized():
        return None
    default = _c10d._world.default_pg
    if not _is_ours(default) and _ours():
        return (f"torch.distributed groups over \"mpidp\" under a default group of backend "
                f"{dist.get_backend()!r}, which cannot be made again")
    store = _shared_store(default)
    if _is_ours(default) and store is not None:
        return (f"torch.distributed's store is shared ({store}), but a heal makes torch's groups "
                f"again over a process-local one: the shared store's keys live on rank 0 alone "
                f"(a lost rank 0 takes them, spares or not: a spare takes its number, not its "
                f"keys) and its clients cannot move onto the survivors mid-operation; give "
                f"mpidp.init_process_group store=\"local\" in a job that heals")
    return None


def _shared_store(default) -> str | None:
    """The kind of the default group's store under its prefixes, None where it is
    process-local (a ``HashStore``: ``store="local"``)."""
    store = _c10d._world.pg_map[default][1]
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return None if isinstance(store, dist.HashStore) else type(store).__name__


def ddp_problem(ddp) -> str | None:
    """Why torch's ``DistributedDataParallel`` ``ddp`` cannot follow a heal (None: it can; local)."""
    group = ddp.process_group
    if not _is_ours(group) or group is not _c10d._world.default_pg:
        return (f"torch's DistributedDataParallel follows a heal over the default group of "
                f"\"mpidp\" only, got {group!r}: a group of some ranks is made again over its "
                f"survivors, and the global batch is the whole world's")
    return None


def _close(group, why: str, default: bool) -> None:
    """Release a healed-over group's communicators (local) and fail its every use."""
    group._aborted = why
    group.abort()
    for comm in (*group._pool.comms, group._chunk_comm, *(() if default else (group._mpi,))):
        _communicators.release(comm)  # the default group's is the runtime's world
    group._pool.comms = []  # shutdown() frees nothing more


def _seconds(group) -> float | None:
    timeout = group._timeout
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None


def _union(facts: list[list[tuple]]) -> dict:
    """The groups any rank held, by name: ``(members, timeout seconds)`` (every rank makes
    them all, in one order, over the survivors)."""
    return {name: (members, seconds) for mine in facts for name, members, seconds in mine}


def rebuild(world: MPI.Intracomm) -> None:
    """Make torch's default group and every mpidp group again over ``world``.

    Collective over ``world`` (the survivors; ``mpidp.communicators.rebuild_all``
    calls it once per heal, ``mpidp.runtime.set_world(world)`` done).
    """
    _lost.clear()  # the old groups' errors
    groups = _ours()
    if not groups:
        return
    default = _c10d._world.default_pg
    old = default._mpi
    names = [_c10d._world.pg_names[group] for group in groups[1:]]
    # a joined spare's groups were over its world of one rank: the survivors' are the groups
    mine = [] if _spares.joined() else [(name, _members(group), _seconds(group))
                                        for name, group in zip(names, groups[1:])]
    _, union = agreement.judged(world, mine, _union,
                                "torch.distributed groups after a heal: which are there?")
    translated = _spares.renumbered(old, world)
    why = ("a heal replaced it after a lost rank: use mpidp.process_group.healing.healed(group) "
           "for the group over the survivors")
    for group in groups:
        _close(group, why, group is default)
    seconds = _seconds(default)
    dist.destroy_process_group()
    dist.init_process_group("mpidp", store=dist.HashStore(), rank=world.Get_rank(),
                            world_size=world.Get_size(),
                            **_timeout(seconds))
    _replaced[default] = _c10d._world.default_pg
    made, over = {}, {}
    for name in sorted(union):
        members, seconds = union[name]
        ranks = [translated[r] for r in members if translated[r] is not None]
        made[name] = dist.new_group(ranks, **_timeout(seconds)) if ranks else None
        if isinstance(made[name], dist.ProcessGroup):
            over[tuple(ranks)] = made[name]
    _over.clear()
    _over.update(over)
    for name, group in zip(names, groups[1:]):
        new = made.get(name)  # None on a joined spare for its own groups
        _replaced[group] = new if isinstance(new, dist.ProcessGroup) else None


def _timeout(seconds: float | None) -> dict:
    return {} if seconds is None else {"timeout": datetime.timedelta(seconds=seconds)}


def healed(group):
    """The group that stands for ``group`` after the heals so far: ``group`` itself if no
    heal replaced it, None if none of its members survived (local)."""
    while group in _replaced:
        group = _replaced[group]
    return group


def group_over(ranks):
    """The group the last heal made over ``ranks`` (of the world now), or None (local).

    For a spare that joined (``mpidp.stand_by``): it stood by outside the groups the
    trainers made, so it holds none for ``healed`` to follow; the heal that let it in
    made them all on it too, their members numbered as before (it took a lost rank's
    number). ``healed`` follows the group through later heals.
    """
    return _over.get(tuple(sorted(ranks)))


def follow(ddp) -> None:
    """Move torch's ``DistributedDataParallel`` onto the group that replaced its own (local).

    torch's ``_update_process_group`` resets its reducer and rebuilds its buckets
    at the next backward, with the new group's size as the divisor. With spares, a
    joined spare's buckets are still those of its construction, which torch keeps
    for the first step (the survivors' were laid out by their first backward): so
    every rank is given its parameters to lay out now, and the next forward's
    rebuild takes rank 0's layout on all of them (torch's ``sync_bucket_indices``).
    """
    ddp._update_process_group(healed(ddp.process_group))
    if _spares.launched():
        ddp.reducer._push_all_rebuilt_params()
