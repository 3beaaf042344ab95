"""``Healer``: go on training at N-1 ranks when a rank is lost, where MPI has ULFM.

A rank or node that dies mid-training ends an ordinary MPI job. With
User-Level Failure Mitigation (Open MPI 5 under ``mpirun --with-ft ulfm``) the
library instead fails every operation that needs the lost rank with
``MPI_ERR_PROC_FAILED`` (``mpidp.errors.RankLostError``), and the survivors can
go on. ``Healer`` does it for mpidp's ``DistributedDataParallel`` with a
``Checkpointer``::

    healer = mpidp.Healer(checkpointer)
    for x, y in healer.batches(loader, steps=total):   # re-split after a lost rank
        with healer.guard():                            # a lost rank here: heal, retry
            ...; loss.backward(); optimizer.step(); checkpointer.step()

What happens, in order:

1. **Detect.** A collective inside ``guard()`` fails with a lost rank. This
   rank revokes every communicator mpidp registered and the world
   (``MPI_Comm_revoke``), so that every survivor, whatever it waits in, fails
   out of it too; ``guard()`` swallows the error.
2. **Agree and shrink.** At the next batch, every survivor agrees
   (``MPI_Comm_agree``, ``mpidp.comm.agreement.survivors_agree``) that all of them
   can heal (no communicator that cannot be rebuilt), then shrinks the world
   (``MPI_Comm_shrink``), which becomes ``mpidp.runtime.world()``.
3. **Rebuild.** ``mpidp.communicators.rebuild_all``: each owner makes its
   communicators again over the survivors (the DDP's pool, control
   communicator and shared-memory node, a SyncBatchNorm's channel, the
   Checkpointer's, the default pool, the watchdog's, the store's).
4. **State.** A survivor whose step failed takes back the state it had when
   that step began (``guard()`` copies it: model, optimizer, scheduler,
   scaler, ``extra``, generators, the step count and the sampler's
   position), since a step that failed after ``optimizer.step()`` left it
   half-done. Each survivor then holds the state after some number of whole
   steps of the N-rank run, which may differ by one between survivors. The
   lowest rank among those with the most steps broadcasts its state to all.
   With a ``ZeroRedundancyOptimizer`` (stage 1) there is no whole replica:
   each rank also steps the previous rank's shard (a partner copy,
   ``mpidp.zero.partner``), ``guard()`` keeps two copies, and the survivors
   go back to the oldest step any of them stands at; their own shards and
   the lost rank's copy are then laid out over the survivors.
5. **Re-split.** The sampler deals the same global order to N-1 ranks from
   that step's position, with the global batch kept (``batch_size`` becomes
   global batch / (N-1), which must divide; with the sampler's micro-batches,
   each rank's share of them, N-1 at most their number), and the loop goes on.

The run after a heal is a run that changed its world size at that step, as a
resume from a checkpoint at N-1 ranks would (``docs/healing.md``).

Where the library has no ULFM (``ulfm()`` False: MPICH, Open MPI without
``--with-ft ulfm``), ``guard()`` and ``batches()`` do nothing more than the
plain loop and cost nothing: the launcher ends the job when a rank dies, and
the next launch resumes from the last whole checkpoint.

**Spares** (``mpidp.stand_by``, ``mpidp.spares``): launched at N+K ranks, N train
and K wait in ``batches()``; a heal then shrinks the launch's ranks instead of the
world's, and a spare takes the lost rank's number, its share of the data and a
survivor's state (step 4), so the run goes on at N ranks as if nothing was lost.
With no spare left it goes on at N-1 ranks as above.

Rules: ``guard()``, ``batches()`` and a heal run on the program's thread; a
heal is collective over the survivors (and the spares, with spares), at the
next batch after the failure.
Every collective of a step must run inside ``guard()``: one outside it that
meets a revoked communicator raises, and the job ends.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time

import torch
from mpi4py import MPI
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import BatchSampler, DataLoader

from . import exits, generators, runtime
from . import spares as _spares
from .comm import agreement
from .comm.handle import collective
from . import communicators as _communicators
from . import errors as _errors
from . import watchdog as _watchdog
from .checkpoint import Checkpointer
from .ddp.data_parallel import DistributedDataParallel
from .ddp.replica import broadcast_coalesced
from .process_group import fsdp as _fsdp
from .process_group import healing as _torch_groups
from .zero import ZeroRedundancyOptimizer

__all__ = ["Healer", "ulfm"]


def ulfm() -> bool:
    """Whether this MPI library goes on after a lost rank: Open MPI under ``mpirun --with-ft ulfm``.

    The same on every rank: the launcher sets it for the whole job.
    """
    runtime.require_mpi()
    return exits.ulfm()


def _leave_without_finalize() -> None:
    """After a heal: run the other exit handlers, then end the process without MPI_Finalize.

    Open MPI 5.0's MPI_Finalize waits forever for the lost rank (measured with the
    5.0.11 wheel under ``--with-ft ulfm``; open-mpi/ompi issue 11404), so a healed
    process ends here, once every handler registered before this one has run.
    """
    atexit.unregister(_leave_without_finalize)
    atexit._run_exitfuncs()
    status = 0
    if exits._exit_request is not None:  # sys.exit(n), or exit_for_requeue's status
        status = exits._exit_status(exits._exit_request[0])
    elif getattr(sys, "last_value", None) is not None:  # an uncaught exception ended __main__
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (a closed stream must not stop the exit)
            pass
    os._exit(status)


def _leave_at_exit() -> None:
    """From a heal on (a spare's too, joined or not): end without MPI_Finalize (idempotent)."""
    atexit.unregister(_leave_without_finalize)
    atexit.register(_leave_without_finalize)


def _lost_ranks(old: MPI.Intracomm, world: MPI.Intracomm, named_in=None) -> list[int]:
    """The ranks of ``old`` missing from ``world``, named as ``named_in`` does (default
    ``MPI.COMM_WORLD``, as the launcher)."""
    kept = set(MPI.Group.Translate_ranks(world.Get_group(), list(range(world.Get_size())),
                                         old.Get_group()))
    gone = [rank for rank in range(old.Get_size()) if rank not in kept]
    return sorted(MPI.Group.Translate_ranks(old.Get_group(), gone,
                                            (named_in or MPI.COMM_WORLD).Get_group()))


def _unhealable(model, optimizer) -> list[str]:
    """What a heal cannot carry on with: communicators no owner rebuilds, and DDPs and ZeRO
    optimizers other than the Checkpointer's, whose states a heal would not make alike."""
    others = [f"{type(o).__name__} {id(o):#x}" for o in _communicators.rebuilders()
              if isinstance(o, (DistributedDataParallel, ZeroRedundancyOptimizer))
              and o is not model and o is not optimizer]
    torch_groups = _torch_groups.problem()
    return _communicators.unrebuildable() + others + ([torch_groups] if torch_groups else [])


def _horovod_trains(optimizer) -> bool:
    """Whether ``optimizer`` is ``mpidp.horovod``'s DistributedOptimizer over Horovod's whole
    world, which a heal carries on (``mpidp.horovod.healing``; imported only by a program's
    ``import mpidp.horovod``)."""
    horovod = sys.modules.get("mpidp.horovod.healing")
    return horovod is not None and horovod.follows(optimizer)


def _copy(state, into=None):
    """``state`` with every tensor copied: into ``into``'s tensors where it has the same shape
    (no allocation: a step's copy reuses the last one's memory), else into new ones."""
    leaves, spec = tree_flatten(state)
    if into is not None:
        old, old_spec = tree_flatten(into)
        if old_spec == spec and all(
                not isinstance(t, torch.Tensor) or (isinstance(b, torch.Tensor) and b.shape == t.shape
                                                    and b.dtype == t.dtype and b.device == t.device)
                for t, b in zip(leaves, old)):
            return tree_unflatten([b.copy_(t) if isinstance(t, torch.Tensor) else t
                                   for t, b in zip(leaves, old)], spec)
    return tree_unflatten([t.detach().clone() if isinstance(t, torch.Tensor) else t
                           for t in leaves], spec)


def _fsdp_common_step(facts: list, lost: list[int], size: int) -> tuple[str | None, int | None]:
    """(why the FSDP2 survivors cannot go on, or None; the step they go back to), from each
    survivor's ``(its old rank, steps it holds its own shards of, steps it holds the previous
    rank's of)`` and the lost ranks' numbers in the old world of ``size`` ranks."""
    neighbours = [rank for rank in lost if (rank + 1) % size in lost]
    if neighbours:
        return (f"ranks {neighbours} and the next of each were lost together: their FSDP2 "
                f"shards had no other copy"), None
    common = set.intersection(*(set(own) for _, own, _ in facts))
    partners = {rank: set(theirs) for rank, _, theirs in facts}
    for rank in lost:
        common &= partners[(rank + 1) % size]
    if not common:
        return (f"no step of which every survivor holds its own FSDP2 shards and the partner "
                f"copies of lost ranks {lost}"), None
    return None, max(common)


def _rebuilt_problem(made, scheduler) -> str | None:
    """What is wrong with ``rebuild()``'s ``made`` (None: nothing; local)."""
    if not isinstance(made, tuple) or len(made) != 3:
        return f"got {type(made).__name__} {made!r:.80}"
    model, optimizer, new_scheduler = made
    if not _fsdp.is_fsdp(model):
        return f"its model is a {type(model).__name__}, not torch's FSDP2 (fully_shard)"
    if (new_scheduler is None) != (scheduler is None):
        return (f"its scheduler must be None exactly where the Checkpointer's is, got "
                f"{type(new_scheduler).__name__} for {type(scheduler).__name__}")
    if new_scheduler is not None and getattr(new_scheduler, "optimizer", None) is not optimizer:
        return "its scheduler must schedule the optimizer it returns"
    return _fsdp.problem(model, optimizer)


def _most_steps(counts: list[tuple[int, bool]]) -> int:
    """The rank whose state all take: the most whole steps, a survivor before a joining spare
    (the judge of each rank's ``(steps, survivor)``)."""
    return counts.index(max(counts))


def _common_step(facts: list, lost: list[int], size: int) -> tuple[str | None, int]:
    """(why the ZeRO survivors cannot go on, or None; the step they go back to), from each
    survivor's ``(step it stands at, steps it holds copies of)`` (None: a joining spare) and
    the lost ranks' numbers in the old world of ``size`` ranks (the same on every rank)."""
    facts = [fact for fact in facts if fact is not None]
    steps = min(at for at, _ in facts)
    if any(at != steps and steps not in kept for at, kept in facts):
        return (f"the survivors stand at steps {sorted({at for at, _ in facts})} and some "
                f"hold no copy of step {steps}"), steps
    neighbours = [rank for rank in lost if (rank + 1) % size in lost]
    if neighbours:
        return (f"ranks {neighbours} and the next of each were lost together: their "
                f"ZeroRedundancyOptimizer shards had no other copy"), steps
    return None, steps


class Healer:
    """Keep a ``Checkpointer``'s training going at N-1 ranks when a rank is lost (ULFM).

    Construct it on every rank after the ``Checkpointer`` (collective). See the
    module's docstring for the loop and what a heal does.

    Args:
        checkpointer: the run's ``mpidp.Checkpointer``, with an mpidp
            ``DistributedDataParallel`` over the world as its model (or torch's
            over the default group of ``"mpidp"``, ``mpidp.process_group.healing``,
            or a module stepped by ``mpidp.horovod``'s ``DistributedOptimizer``,
            ``mpidp.horovod.healing``, or torch's FSDP2 over that group with
            ``rebuild``) and an ``mpidp.DistributedSampler`` with ``batch_size``.
        rebuild: with torch's FSDP2 (``fully_shard``) only, and then required: a callable
            that makes the model, its optimizer and LR scheduler again over the default
            group of the moment and returns ``(model, optimizer, scheduler)`` (scheduler
            None where the Checkpointer has none). A heal calls it on every survivor,
            loads the state of the step it goes back to into what it returns, and puts
            them in the Checkpointer, where the loop takes them at each batch
            (``mpidp.process_group.fsdp``, docs/healing-frameworks.md).

    Attributes:
        active: whether this job can heal (``ulfm()`` and more than one rank).
        heals: one dict per heal: ``step``, ``lost`` (their ranks in ``MPI.COMM_WORLD``),
            ``world`` (the ranks after), ``seconds`` (from this rank's detection
            to the end of the heal), ``root`` (whose state was taken; None with
            ZeRO and FSDP2, where each survivor takes back its own).

    Raises:
        TypeError, ValueError: on every rank: not a Checkpointer, or one without
            a sampler; ``rebuild`` without FSDP2; and, where this job can heal, what
            cannot: torch's FSDP2 without ``rebuild``, with spares or over another group,
            a DDP over a group of its own, a ``ZeroRedundancyOptimizer`` in stage 2 or over a
            communicator of its own (stage 1 over the world heals: its
            constructor here starts the partner copies, collectively), a DDP
            over a communicator other than the world, a second DDP or ZeRO, or
            communicators that no owner can rebuild (``mpidp.horovod`` over a
            communicator of the program's, torch.distributed's MPI or TCP store,
            a ``SyncBatchNorm`` over a communicator of the program's). Where
            it cannot heal, the loop is the plain one whatever trains in it.
    """

    def __init__(self, checkpointer: Checkpointer, *, rebuild=None):
        self.active = ulfm() and (runtime.size() > 1 or _spares.launched())
        error = None
        try:
            self._check(checkpointer, self.active, rebuild)
        except (TypeError, ValueError) as caught:
            error = caught
        comm = checkpointer._comm if isinstance(checkpointer, Checkpointer) else runtime.world()
        agreement.agree(comm, error, "Healer(): can every rank heal?")
        self.checkpointer = checkpointer
        self._zero = checkpointer.optimizer if self.active and isinstance(
            checkpointer.optimizer, ZeroRedundancyOptimizer) else None
        if self._zero is not None:
            self._zero.keep_partner_copy()
        self._rebuild = rebuild
        self._fsdp = _fsdp.Shards(checkpointer.model, checkpointer.optimizer) if (
            self.active and _fsdp.is_fsdp(checkpointer.model)) else None
        if self.active:
            _torch_groups.arm()
        self.heals: list[dict] = []
        self._lost: float | None = None  # when this rank met the lost rank, until the heal
        self._snapshot: dict | None = None  # the state at the start of the step in guard()
        # the last copies, oldest first, whose memory the next ones reuse: one, or with ZeRO
        # or FSDP2 two (their survivors go back to a step they all can, _take_zero_state)
        self._copies: list[dict] = []

    @staticmethod
    def _check(checkpointer, active: bool, rebuild=None) -> None:
        if not isinstance(checkpointer, Checkpointer):
            raise TypeError(f"checkpointer must be an mpidp.Checkpointer, got "
                            f"{type(checkpointer).__name__}")
        fsdp = _fsdp.is_fsdp(checkpointer.model)
        if rebuild is not None and (not callable(rebuild) or not fsdp):
            raise TypeError(f"rebuild must be a callable, given with a model of torch's FSDP2 "
                            f"(fully_shard) only, got {type(rebuild).__name__} with a "
                            f"{type(checkpointer.model).__name__}")
        if checkpointer.sampler is None:
            raise ValueError("Healer needs the Checkpointer's sampler and batch_size, to "
                             "deal the batches (and re-split them after a lost rank)")
        if not active:
            return
        model = checkpointer.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            problem = _torch_groups.ddp_problem(model)
            if problem:
                raise ValueError(f"Healer: {problem}")
        elif fsdp:
            Healer._check_fsdp(model, checkpointer.optimizer, rebuild)
        elif not isinstance(model, DistributedDataParallel):
            if not _horovod_trains(checkpointer.optimizer):
                raise TypeError(f"Healer heals mpidp.DistributedDataParallel, torch's over "
                                f"\"mpidp\", or a module stepped by mpidp.horovod's "
                                f"DistributedOptimizer over the whole world, got "
                                f"{type(model).__name__} (FSDP cannot carry a lost rank's shards)")
        elif not model._over_world:
            raise ValueError("Healer: the DistributedDataParallel trains over a communicator "
                             "of its own; only one over the world (comm=None) follows a heal")
        zero = checkpointer.optimizer
        if isinstance(zero, ZeroRedundancyOptimizer) and not zero._over_world:
            raise ValueError(f"Healer: the ZeroRedundancyOptimizer must be stage=1 over the "
                             f"world (comm=None) to follow a heal, got stage={zero.stage}"
                             f"{'' if zero.stage == 2 else ' over a communicator of its own'}: "
                             f"a lost rank's shard is rebuilt from the copy its partner rank "
                             f"keeps by stepping it too, which needs the whole gradients")
        stuck = _unhealable(model, zero)
        if stuck:
            raise ValueError(f"Healer: these cannot follow a heal after a lost rank: {stuck} "
                             f"(what a heal rebuilds: "
                             f"docs/healing.md#what-a-heal-cannot-carry-on-with)")

    @staticmethod
    def _check_fsdp(model, optimizer, rebuild) -> None:
        if rebuild is None:
            raise ValueError("Healer: torch's FSDP2 needs rebuild=, a callable that makes the "
                             "model, optimizer and scheduler again over the survivors (FSDP2 "
                             "cannot shard a module again over another group), got None")
        if _spares.launched():
            raise ValueError("Healer: torch's FSDP2 does not follow a heal with spare ranks "
                             "yet (mpidp.stand_by(spares=K) with K > 0); launch without spares")
        problem = _fsdp.problem(model, optimizer)
        if problem:
            raise ValueError(f"Healer: {problem}")

    # -- the loop ------------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self):
        """Run one training step; a lost rank inside it is healed at the next batch (local).

        Copies the state at entry (while this job can heal), so that a step
        that failed half-way can be taken back. Any other error passes through.
        """
        if not self.active:
            yield
            return
        self._snapshot = self._capture()
        if self._fsdp is not None:  # the partner copy of this step's start
            try:
                self._fsdp.exchange(self.checkpointer._comm, self._snapshot["fsdp"])
            except Exception as error:
                if not _errors.lost_rank(error):
                    raise
                self._lost_now()  # the step's first collective fails, and it is taken back
        try:
            yield
            _torch_groups.raise_lost()  # one torch's DDP could not be told of in its backward
        except Exception as error:
            if not _errors.lost_rank(error):
                raise
            self._lost_now()
        else:
            self._snapshot = None  # the step is whole: the state now is the one to offer

    def batches(self, loader: DataLoader, steps: int):
        """Yield ``loader``'s batches, epoch after epoch, until the Checkpointer counts ``steps``.

        Heals (collective over the survivors) before the next batch after a lost
        rank, then goes on from the step the survivors agreed on, with the data
        re-split. On a spare (``mpidp.stand_by``) it waits until a heal needs it,
        then trains; if none does, it ends the process (status 0) when the
        training ends, so the script's lines after the loop run on trainers only.
        ``loader`` must draw from the Checkpointer's sampler, with its
        ``batch_size``; both are changed in place by a heal.

        Raises:
            ValueError: (on every rank) ``loader`` does not draw from the
                Checkpointer's sampler with its batch_size, or yields no batch.
        """
        checkpointer = self.checkpointer
        self._check_loader(loader)
        sampler = checkpointer.sampler
        while True:
            if _spares.standing_by() and self._lost is None:
                self._stand_by()
            if self._lost is not None:
                self._heal(loader)
                if _spares.standing_by():
                    continue
            if checkpointer.steps >= steps:
                if self._finished():
                    _spares.release()
                    return
                continue
            fresh, yielded = sampler.start == 0, 0
            for batch in loader:
                yielded += 1
                yield batch
                if self._lost is not None or checkpointer.steps >= steps:
                    break
            else:
                if fresh and not yielded:
                    raise ValueError(f"the loader yields no batch in epoch {sampler.epoch}")
                sampler.set_epoch(sampler.epoch + 1)

    def _check_loader(self, loader) -> None:
        checkpointer = self.checkpointer
        problem = None
        if not isinstance(loader, DataLoader) or loader.sampler is not checkpointer.sampler:
            problem = "loader must be a DataLoader whose sampler is the Checkpointer's"
        elif (type(loader.batch_sampler) is not BatchSampler
              or loader.batch_sampler.batch_size != checkpointer.batch_size):
            problem = (f"loader must take batch_size={checkpointer.batch_size} (the "
                       f"Checkpointer's) samples per batch from its sampler")
        agreement.raise_together(checkpointer._comm, problem, ValueError, "Healer.batches():")

    def _finished(self) -> bool:
        """Whether every rank is done too (collective): a survivor must not leave while others heal."""
        if not self.active:
            return True
        try:
            agreement.any_failed(self.checkpointer._comm, False, "Healer: is every rank done?")
        except Exception as error:
            if not _errors.lost_rank(error):
                raise
            self._lost_now()
            return False
        return True

    def _stand_by(self) -> None:
        """A spare waits (``mpidp.spares.wait``): a heal needs it, or the training ended."""
        if not _spares.wait():
            raise SystemExit(0)
        self._lost = time.monotonic()

    def _lost_now(self) -> None:
        """Revoke everything at once, so that every survivor fails out of what it waits in."""
        if self._lost is None:
            self._lost = time.monotonic()
        runtime.world().Revoke()
        _communicators.revoke_all()

    # -- the state -----------------------------------------------------------------------

    def _parts(self) -> dict:
        checkpointer = self.checkpointer
        optimizer = checkpointer.optimizer if self._zero is None else self._zero._healing.local_state()
        if self._fsdp is not None:  # its shards are in the copy's "fsdp"
            optimizer = None
        parts = {"optimizer": optimizer, "scheduler": checkpointer.scheduler,
                 "scaler": checkpointer.scaler}
        parts.update({f"extra:{name}": obj for name, obj in checkpointer.extra.items()})
        return {name: obj for name, obj in parts.items() if obj is not None}

    def _position(self) -> tuple:
        c = self.checkpointer
        return c.steps, c._epoch, c._base, c._batches, c.sampler.epoch, c.sampler.start

    def _capture(self) -> dict:
        """This rank's state at the start of a step, copied (the step changes it in place)
        into the memory of the oldest copy kept."""
        keep = 1 if self._zero is None and self._fsdp is None else 2
        last = self._copies[0] if len(self._copies) >= keep else {}
        if self._fsdp is not None:
            model = {"fsdp": self._fsdp.capture(self.checkpointer._comm.Get_size(),
                                                last.get("fsdp"))}
        else:
            model = {"model": _copy(self.checkpointer._module().state_dict(), last.get("model"))}
        copy = {**model, "rng": generators.states(), "position": self._position(),
                **{name: _copy(obj.state_dict(), last.get(name))
                   for name, obj in self._parts().items()}}
        self._copies = [*self._copies[len(self._copies) - keep + 1:], copy]
        return copy

    def _restore(self, snapshot: dict) -> None:
        self._copies = []  # the optimizer may now hold these very tensors: copy afresh
        c = self.checkpointer
        if "model" in snapshot:  # FSDP2's comes whole from every rank's (_take_fsdp_state)
            c._module().load_state_dict(snapshot["model"])
        for name, obj in self._parts().items():
            obj.load_state_dict(snapshot[name])
        generators.restore(snapshot["rng"])
        c.steps, c._epoch, c._base, c._batches, epoch, start = snapshot["position"]
        c.sampler.epoch, c.sampler.start = epoch, start

    # -- the heal ------------------------------------------------------------------------

    def _heal(self, loader: DataLoader) -> None:
        """Agree, shrink, rebuild, take the state, re-split (collective over the survivors)."""
        detected, self._lost = self._lost, None
        c = self.checkpointer
        joining = _spares.standing_by()
        old = runtime.world()
        stuck = [] if joining else _unhealable(c.model, self._zero)
        whole = joining or agreement.survivors_agree(old, not stuck,
                                                     "Healer: can every survivor heal?")
        turn = self._new_world(old, whole, joining)
        world, lost, joined, whole = turn.world, turn.lost, turn.joined, turn.ok
        if world is None:  # a spare that stands by still
            return
        global_batch = c._global_batch()
        unfit = c.sampler.dealing_problem(world.Get_size(), global_batch)
        why, steps = None, None
        if not whole:
            why = f"communicators that cannot be rebuilt: {stuck or 'on another rank'}"
        elif unfit:
            why = unfit
        elif self._zero is not None:
            why, steps = self._zero_step(world, turn.numbers, turn.size, joining)
        elif self._fsdp is not None:
            why, steps = self._fsdp_step(world, turn.numbers, turn.size, old.Get_rank())
        if why is not None:  # the same on every survivor: all raise it, the job ends
            raise RuntimeError(f"mpidp.Healer: rank(s) {lost} of MPI_COMM_WORLD were lost at "
                               f"step {c.steps} and the run cannot go on at "
                               f"{world.Get_size()} ranks: {why}. Resume from the last "
                               f"checkpoint in {c.directory} at a size that fits")
        _leave_at_exit()
        runtime.set_world(world)
        _communicators.rebuild_all(world)
        if isinstance(c.model, torch.nn.parallel.DistributedDataParallel):
            _torch_groups.follow(c.model)
        if self._zero is not None:
            root = self._take_zero_state(world, steps, turn.numbers, joining)
        elif self._fsdp is not None:
            root = self._take_fsdp_state(world, steps, turn.numbers, old.Get_rank())
        else:
            if self._snapshot is not None:  # this rank's step failed: back to its start
                self._restore(self._snapshot)
                self._snapshot = None
            root = self._take_state(world, joining)
        self._resplit(world, global_batch, loader)
        seconds = time.monotonic() - detected
        self.heals.append(dict(step=c.steps, lost=lost, world=world.Get_size(),
                               seconds=seconds, root=root, joined=joined))
        if world.Get_rank() == 0:
            whose = (f"the state of rank {root}" if root is not None else
                     f"each survivor's own state of that step, the "
                     f"{'ZeRO' if self._zero is not None else 'FSDP2'} shards re-split")
            if _spares.launched():
                whose += (f"; spare rank(s) {joined} of MPI_COMM_WORLD took their place, "
                          f"{_spares.spares_left()} spare(s) left" if joined else
                          "; no spare left")
            print(f"mpidp: rank(s) {lost} of MPI_COMM_WORLD lost; healed in {seconds:.2f} s, "
                  f"going on at {world.Get_size()} ranks from step {c.steps} ({whose})",
                  flush=True)

    def _new_world(self, old: MPI.Intracomm, whole: bool, joining: bool) -> _spares.Replacement:
        """The survivors shrunk, or with spares the launch's survivors made into a world with a
        spare in each lost rank's place (``mpidp.spares``); its world is None on a spare that
        stands by still (collective)."""
        if not _spares.launched():
            world = _watchdog.watched("Healer: the world's shrink (MPI_Comm_shrink)", old.Shrink)
            return _spares.Replacement(world, _lost_ranks(old, world), [], 0, whole,
                                       _lost_ranks(old, world, old), old.Get_size())
        _leave_at_exit()
        turn = _spares.replace(None if joining else old, whole)
        if turn.done:  # the trainers had finished: a spare leaves as at the end
            raise SystemExit(0)
        return turn

    def _take_state(self, world: MPI.Intracomm, joining: bool = False) -> int:
        """Every rank takes the state of the one with the most whole steps, a survivor rather
        than a spare that joins with as many (collective). With ZeRO, whose shards come from
        the survivors' pieces (``_take_zero_state``), the optimizer's hyperparameters only."""
        c = self.checkpointer
        _, root = agreement.judged(world, (c.steps, not joining), _most_steps,
                                   "Healer: how many steps has each?")
        parts = self._parts()
        if self._zero is not None:
            parts.pop("optimizer")
        state = None
        if world.Get_rank() == root:
            state = {"position": self._position(), "rng": None,
                     **{name: obj.state_dict() for name, obj in parts.items()}}
            if self._zero is not None:
                state["zero groups"] = [self._zero._hyper(g) for g in self._zero.param_groups]
        state = collective(world, "bcast", (state, root), "Healer: the state's broadcast")
        module = c._module()
        broadcast_coalesced([*module.parameters(), *module.buffers()], root, comm=world)
        if world.Get_rank() != root:
            for name, obj in parts.items():
                obj.load_state_dict(state[name])
            for group, hyper in zip(self._zero.param_groups if self._zero else (),
                                    state.get("zero groups", ())):
                group.update(hyper)
        c.steps, c._epoch, c._base, c._batches, epoch, start = state["position"]
        c.sampler.epoch, c.sampler.start = epoch, start
        return root

    def _zero_step(self, world: MPI.Intracomm, lost: list[int], size: int,
                   joining: bool) -> tuple[str | None, int]:
        """With ZeRO: the step every survivor can go back to, or why there is none (collective;
        ``lost``: the lost ranks' numbers in the old world of ``size`` ranks).

        A shard lives on its rank and, as a partner copy, on the next one; so the
        survivors go on from one step whose state each holds a copy of: the
        oldest any of them stands at (a survivor whose step failed went back to
        its start). They differ by at most one step, and each keeps two copies.
        A joining spare holds none and says so (None).
        """
        mine = self._snapshot["position"][0] if self._snapshot is not None else \
            self.checkpointer.steps
        have = [copy["position"][0] for copy in self._copies]
        _, verdict = agreement.judged(world, None if joining else (mine, have),
                                      lambda facts: _common_step(facts, lost, size),
                                      "Healer: which steps can each survivor go back to?")
        return verdict

    def _take_zero_state(self, world: MPI.Intracomm, steps: int, lost: list[int],
                         joining: bool) -> None:
        """Go back to ``steps``, then lay the ZeRO shards out over the survivors (collective).

        With spares, a survivor's model, position and hyperparameters go to all first: a
        joining spare has none of them, and its pieces (of a one-rank layout) are not given.
        """
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None or snapshot["position"][0] != steps:
            # None: this rank's last step was whole and it stands at ``steps`` already
            snapshot = next((copy for copy in self._copies if copy["position"][0] == steps), None)
        if snapshot is not None and not joining:
            self._restore(snapshot)
        if _spares.launched():
            self._take_state(world, joining)
        mine = [] if joining else self._zero._healing.heal_pieces(lost)
        pieces = agreement.watched_allgather(world, mine, "Healer: the ZeRO shards' states")
        self._zero._healing.regroup([piece for part in pieces for piece in part])
        return None

    def _fsdp_step(self, world: MPI.Intracomm, lost: list[int], size: int,
                   rank: int) -> tuple[str | None, int | None]:
        """With FSDP2: the newest step of which every survivor holds its own shards and the
        next rank of each lost one that rank's partner copy, or why there is none (collective;
        ``lost``: the lost ranks' numbers in the old world of ``size`` ranks, ``rank`` this
        rank's there)."""
        own = [copy["position"][0] for copy in self._copies]
        theirs = [copy["position"][0] for copy in self._copies
                  if copy["fsdp"]["theirs"] is not None]
        _, verdict = agreement.judged(world, (rank, own, theirs),
                                      lambda facts: _fsdp_common_step(facts, lost, size),
                                      "Healer: which FSDP2 shards does each survivor hold?")
        return verdict

    def _take_fsdp_state(self, world: MPI.Intracomm, steps: int, lost: list[int],
                         rank: int) -> None:
        """Make the FSDP2 model and optimizer again with ``rebuild`` and load into them the
        whole state of ``steps``, from the survivors' shards and the lost ranks' partner
        copies (collective); the rest of that step's state from this rank's own copy."""
        c = self.checkpointer
        snapshot = next(copy for copy in self._copies if copy["position"][0] == steps)
        self._snapshot = None
        shards = snapshot["fsdp"]
        size = shards["size"]
        mine = [(rank, shards["mine"].cpu())]
        if (rank - 1) % size in lost:
            mine.append(((rank - 1) % size, shards["theirs"].cpu()))
        pieces = agreement.watched_allgather(world, mine, "Healer: the FSDP2 shards' states")
        model_state, optimizer_state = _fsdp.whole_state(
            shards, dict(piece for part in pieces for piece in part))
        made, error = None, None
        try:
            made = self._rebuild()
            problem = _rebuilt_problem(made, c.scheduler)
            if problem:
                raise ValueError(f"Healer: rebuild() must return (model, optimizer, scheduler) "
                                 f"over the survivors: {problem}")
        except Exception as caught:  # noqa: BLE001 (every survivor raises the first one's)
            error = caught
        agreement.agree(world, error, "Healer: did rebuild() make the FSDP2 model on every rank?")
        model, optimizer, scheduler = made
        _fsdp.load(model, optimizer, model_state, optimizer_state)
        c.model, c.optimizer, c.scheduler = model, optimizer, scheduler
        self._fsdp = _fsdp.Shards(model, optimizer)
        self._restore(snapshot)  # the scheduler, generators, position... into the new ones

    def _resplit(self, world: MPI.Intracomm, global_batch: int, loader: DataLoader) -> None:
        """The same global order from the agreed position, dealt to the survivors (local)."""
        c = self.checkpointer
        epoch = c.sampler.epoch if c._epoch is None else c._epoch
        start = c._base + c._batches * global_batch  # samples of the epoch's global order taken
        c.sampler.resize(world.Get_size(), world.Get_rank())
        c.batch_size = c.sampler.share(global_batch)
        c.sampler.resume_from(epoch, start)
        c._epoch, c._base, c._batches = epoch, start, 0
        loader.batch_sampler.batch_size = c.batch_size
