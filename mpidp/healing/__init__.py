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

The package: this module holds the loop (``Healer``: ``guard()``, ``batches()``, the heal's
order) and ``ulfm()``; the Healer holds its parts: ``checks.py`` (what a heal cannot carry on
with: the refusals), ``copies.py`` (the step-start copies of this rank's state), and one
state-taker per kind of training, behind one interface (``step``: the step the survivors go
back to; ``take``: the state of that step): ``replica.py`` (a whole replica on every rank:
DDP, torch's DDP, Horovod), ``zero.py`` (``ZeroRedundancyOptimizer``'s shards and partner
copies), ``fsdp.py`` (torch's FSDP2, made again by ``rebuild``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time

import torch
from mpi4py import MPI
from torch.utils.data import BatchSampler, DataLoader

from .. import communicators as _communicators
from .. import errors as _errors
from .. import exits, runtime
from .. import spares as _spares
from .. import watchdog as _watchdog
from ..checkpoint import Checkpointer
from ..comm import agreement
from ..process_group import fsdp as _fsdp
from ..process_group import healing as _torch_groups
from ..zero import ZeroRedundancyOptimizer
from . import checks
from .copies import Copies
from .fsdp import FsdpShards
from .replica import Replica
from .zero import ZeroShards

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
            checks.check(checkpointer, self.active, rebuild)
        except (TypeError, ValueError) as caught:
            error = caught
        comm = checkpointer._comm if isinstance(checkpointer, Checkpointer) else runtime.world()
        agreement.agree(comm, error, "Healer(): can every rank heal?")
        self.checkpointer = checkpointer
        zero = checkpointer.optimizer if self.active and isinstance(
            checkpointer.optimizer, ZeroRedundancyOptimizer) else None
        fsdp = _fsdp.Shards(checkpointer.model, checkpointer.optimizer) if (
            self.active and _fsdp.is_fsdp(checkpointer.model)) else None
        # this rank's copies of its last step starts, and the part that takes a heal's state
        self._copies = Copies(checkpointer, zero=zero, fsdp=fsdp)
        if zero is not None:  # starts the partner copies (collective)
            self._state = ZeroShards(self._copies, zero)
        elif fsdp is not None:
            self._state = FsdpShards(self._copies, rebuild)
        else:
            self._state = Replica(self._copies)
        if self.active:
            _torch_groups.arm()
        self.heals: list[dict] = []
        self._lost: float | None = None  # when this rank met the lost rank, until the heal

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
        copies = self._copies
        copies.snapshot = copies.capture()
        if copies.fsdp is not None:  # the partner copy of this step's start
            try:
                copies.fsdp.exchange(self.checkpointer._comm, copies.snapshot["fsdp"])
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
            copies.snapshot = None  # the step is whole: the state now is the one to offer

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

    # -- the heal ------------------------------------------------------------------------

    def _heal(self, loader: DataLoader) -> None:
        """Agree, shrink, rebuild, take the state, re-split (collective over the survivors)."""
        detected, self._lost = self._lost, None
        c = self.checkpointer
        joining = _spares.standing_by()
        old = runtime.world()
        stuck = [] if joining else checks.unhealable(c.model, self._copies.zero)
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
        else:
            why, steps = self._state.step(world, turn.numbers, turn.size, old.Get_rank(), joining)
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
        root = self._state.take(world, steps, turn.numbers, old.Get_rank(), joining)
        self._resplit(world, global_batch, loader)
        seconds = time.monotonic() - detected
        self.heals.append(dict(step=c.steps, lost=lost, world=world.Get_size(),
                               seconds=seconds, root=root, joined=joined))
        if world.Get_rank() == 0:
            whose = (f"the state of rank {root}" if root is not None else
                     f"each survivor's own state of that step, the "
                     f"{self._state.label} shards re-split")
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
