"""``Checkpointer``: whole-or-absent checkpoints, a stop every rank takes at one step, resume at any size.

A checkpoint is a directory ``step-000000120`` holding:

- ``model.pt``: the model's state dict (unwrapped from DDP), from rank 0; of an FSDP2
  model (DTensor parameters), the whole one, gathered by torch's ``get_model_state_dict``;
- ``train.pt``: the optimizer (unless ZeRO or FSDP2), LR scheduler, gradient scaler,
  ``extra`` objects, the step and the sampler's position, from rank 0;
- ``optimizer.pt``: with an FSDP2 model, the optimizer's whole state (torch's full state
  dict, keyed by parameter name), from rank 0;
- ``zero-rank*-of-*.pt``: a ``ZeroRedundancyOptimizer``'s shards (``save_sharded``);
- ``rng-rank*.pt``: each rank's Python, NumPy, torch CPU and CUDA generators;
- ``manifest.json``: the step, the world size and every file's size, written last.

**Whole or absent.** The ranks write into ``.partial-step-...``, each file
flushed and fsynced; once every rank's files are written (agreed), rank 0
writes the manifest, fsyncs, renames the directory to ``step-...`` and fsyncs
the parent. A kill at any moment leaves either the new checkpoint, whole, or
the previous ones untouched; ``latest_checkpoint`` takes only a ``step-*``
directory whose manifest lists files that all exist at their sizes.

**Resume at another size.** The model, optimizer, scheduler and scaler are
replicated and load at any size; ZeRO shards are re-cut (``load_sharded``);
an FSDP2 model and its optimizer are read whole by every rank, each keeping its
new shards (torch's ``set_model_state_dict`` and ``set_optimizer_state_dict``);
the sampler goes on from the same position of the epoch's global order
(``mpidp.DistributedSampler.resume_from``), which keeps the global batches
the same as long as the global batch (``batch_size`` x ranks, or the
sampler's micro-batches at any count of ranks up to theirs) is, whether
the loop starts again at epoch 0 or at ``sampler.epoch`` (docs/preemption.md,
"Which loops go on exactly"). Rank ``r``
takes rank ``r``'s generators if the saving run had one, else generators
seeded from ``mpidp.generators.derived_seed(step, r)``.

Every method that talks to the other ranks says so. Rule: they all issue on
one duplicate of the world (``MPI.COMM_WORLD``, or its survivors after a heal),
made by the constructor (registered in ``mpidp.communicators``) and freed by
``close()``, from the one thread that calls them; nothing else issues on it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Mapping

import torch
from mpi4py import MPI

from .comm.handle import collective
from . import _args, generators, preemption, runtime
from .checkpoint_format import (
    FORMAT, MANIFEST, NAME as _NAME, directory_of as _directory_of, fsync_file as _fsync_file,
    latest_checkpoint, load as _load, write as _write,
)
from .comm import agreement
from . import communicators as _communicators
from . import watchdog as _watchdog
from .ddp.data_parallel import DistributedDataParallel
from .process_group import fsdp as _fsdp
from .sampler import DistributedSampler
from .zero import ZeroRedundancyOptimizer

__all__ = ["Checkpointer", "latest_checkpoint"]

_DEADLINE = 20.0  # seconds: well inside SLURM's default KillWait of 30 s


def _one_kind(sharded: list) -> TypeError | None:
    if len(set(sharded)) > 1:
        return TypeError(f"model must be torch's FSDP2 (DTensor parameters) on every rank or "
                         f"on none, got FSDP2 on ranks {[r for r, s in enumerate(sharded) if s]}")
    return None


def _restore_generators(rng) -> None:
    """A rank's saved generator states, or the seed of a rank the saving run had not."""
    if isinstance(rng, dict):
        generators.restore(rng)
    else:
        generators.seed_all(rng)


class Checkpointer:
    """Save and resume a training run; stop every rank at one step when a signal comes.

    Construct it on every rank (collective), call ``resume()`` once before the
    loop and ``step()`` once per optimizer step, at the same point on every rank::

        checkpointer = mpidp.Checkpointer("ckpt", model=ddp, optimizer=opt, sampler=sampler,
                                          batch_size=32)
        checkpointer.resume()
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                ...; opt.step()
                checkpointer.step()  # a signal on any rank: save, then exit 75 on every rank

    Args:
        directory: where the checkpoints go; the same path, shared, on every rank.
        model: the module (mpidp or torch DDP, a plain module whose parameters
            are the same on every rank, or torch's FSDP2, saved whole), the same kind
            on every rank.
        optimizer: a torch optimizer or ``mpidp.ZeroRedundancyOptimizer``.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        scaler: a ``torch.amp.GradScaler``.
        sampler: the ``mpidp.DistributedSampler`` whose position is kept.
        batch_size: the samples each rank takes from ``sampler`` per ``step()``
            (required with ``sampler``; with its micro-batches, its ``batch_size``:
            the global batch is then theirs, at any number of ranks).
        extra: more objects with ``state_dict``/``load_state_dict``, by name (rank 0's).
        signals: the signals that ask for a stop (see ``mpidp.preemption.arm``);
            None or () arms none.
        deadline: seconds a save may take; a slower one is discarded (the
            previous checkpoint stays) and raises ``TimeoutError`` on every rank.
        keep: how many whole checkpoints to keep, newest first.
        every: also save every this many steps (None: only when stopping).
        exit_on_stop: after the save of a stop, end every rank with
            ``mpidp.preemption.EXIT_STATUS`` (False: ``step()`` returns True).

    Raises:
        ValueError, TypeError, OSError: on every rank, naming the argument and the
            rank(s), if any rank's arguments are bad or ``directory`` cannot be
            written or is not the same directory on every rank.
    """

    def __init__(self, directory: str, *, model: torch.nn.Module, optimizer=None, scheduler=None,
                 scaler=None, sampler: DistributedSampler | None = None,
                 batch_size: int | None = None, extra: Mapping | None = None,
                 signals=preemption.DEFAULT_SIGNALS, deadline: float = _DEADLINE, keep: int = 2,
                 every: int | None = None, exit_on_stop: bool = True):
        self._comm = _communicators.made(runtime.world().Dup(), f"Checkpointer {id(self):#x}",
                                         rebuild=self._rebuild)
        self.rank, self.world = self._comm.Get_rank(), self._comm.Get_size()
        error = None
        try:
            self._check(directory, model, optimizer, sampler, batch_size, extra, signals, deadline,
                        keep, every, exit_on_stop)
        except (ValueError, TypeError) as caught:
            error = caught
        try:
            agreement.agree(self._comm, error, "Checkpointer(): are the arguments good on every rank?")
            agreement.decide(self._comm, _fsdp.is_sharded(self._unwrap(model)), _one_kind,
                             "Checkpointer(): an FSDP2 model on every rank or on none?")
            self.directory = os.path.abspath(directory)
            self._check_directory()
        except BaseException:  # raised on every rank alike
            _communicators.free(self._comm)
            raise
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.sampler, self.batch_size, self.extra = sampler, batch_size, dict(extra or {})
        self.deadline, self.keep, self.every, self.exit_on_stop = float(deadline), keep, every, exit_on_stop
        self.steps = 0  # optimizer steps taken, counted by step(); the step a save records
        self.last_save_seconds: float | None = None
        # the sampler's position: its (epoch, passes) at the last step, where that pass
        # began, and the batches taken since
        self._epoch, self._pass, self._base, self._batches = None, 0, 0, 0
        self._replay = None  # what resume() loaded that the loop may change before the position
        self._token = None  # the DDP bookkeeping last read (mpidp.preemption.agreed_by)
        if signals:
            preemption.arm(signals)

    @staticmethod
    def _check(directory, model, optimizer, sampler, batch_size, extra, signals, deadline, keep,
               every, exit_on_stop) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise TypeError(f"directory must be a path, got {directory!r}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for name, value in (("optimizer", optimizer), *(extra or {}).items()):
            if value is not None and not (hasattr(value, "state_dict") and hasattr(value, "load_state_dict")):
                raise TypeError(f"{name} must have state_dict() and load_state_dict(), got "
                                f"{type(value).__name__}")
        if sampler is not None:
            if not isinstance(sampler, DistributedSampler):
                raise TypeError(f"sampler must be an mpidp.DistributedSampler, got "
                                f"{type(sampler).__name__}")
            if not _args.is_int(batch_size) or batch_size < 1:
                raise ValueError(f"batch_size must be the samples per rank per step (an "
                                 f"integer >= 1) when a sampler is given, got {batch_size!r}")
            if sampler.micro_batches is not None and batch_size != sampler.batch_size:
                raise ValueError(f"batch_size must be the sampler's batch_size "
                                 f"({sampler.batch_size}: this rank's whole micro-batches of one "
                                 f"global batch) with a sampler of micro-batches, got {batch_size}")
        if signals:
            preemption.signal_numbers(signals)
            if threading.current_thread() is not threading.main_thread():
                raise ValueError("signals: a Checkpointer that arms signals must be made in the "
                                 "main thread (pass signals=() elsewhere)")
        _args.check_number("deadline", deadline)
        _args.check_int("keep", keep, minimum=1)
        if every is not None:
            _args.check_int("every", every, minimum=1)
        _args.check_bool("exit_on_stop", exit_on_stop)

    def _check_directory(self) -> None:
        """The directory exists, takes files, and is the same one on every rank (collective)."""
        name = collective(self._comm, "bcast", (f".probe-{os.getpid()}-{time.time_ns()}", 0),
                          "Checkpointer(): the directory's probe")
        probe = os.path.join(self.directory, name)  # each rank's own path to it
        problem = None
        if self.rank == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                _write(probe, "probe")
            except OSError as caught:
                problem = f"cannot write in {self.directory!r}: {caught}"
        agreement.raise_together(self._comm, problem, OSError, "Checkpointer: the directory:")
        if self.rank != 0 and not os.path.exists(probe):
            problem = (f"{self.directory!r} is not the directory rank 0 wrote in (the "
                       f"checkpoint directory must be shared by every rank)")
        agreement.raise_together(self._comm, problem, OSError, "Checkpointer: the directory:")
        if self.rank == 0:
            os.remove(probe)

    def _rebuild(self, world: MPI.Intracomm) -> None:
        """Over ``world``, the survivors of a lost rank (collective; ``mpidp.healing``)."""
        _communicators.release(self._comm)
        self._comm = _communicators.made(world.Dup(), f"Checkpointer {id(self):#x}",
                                         rebuild=self._rebuild)
        self.rank, self.world = self._comm.Get_rank(), self._comm.Get_size()
        self._token = None

    def close(self) -> None:
        """Give the signals their handlers back and free the communicator (collective)."""
        preemption.disarm()
        if self._comm != MPI.COMM_NULL:
            _communicators.free(self._comm)

    # -- the loop ------------------------------------------------------------------------

    def step(self, batches: int = 1) -> bool:
        """Count one optimizer step; save if due; stop if any rank was signalled (collective).

        Under mpidp's DDP the stop was agreed by the step's own bookkeeping, and
        this calls nothing collective unless a save is due; otherwise it is one
        4-byte allreduce.

        Args:
            batches: how many batches each rank took from the sampler in this step.

        Returns:
            True if the ranks agreed to stop and the checkpoint was saved (only
            when ``exit_on_stop`` is False; otherwise every rank exits with
            ``mpidp.preemption.EXIT_STATUS``). The stop request stays set, so
            the next step stops again: ``mpidp.preemption.clear()`` to go on.
        """
        self.steps += 1
        if self.sampler is not None:
            where = (self.sampler.epoch, self.sampler.passes)
            if where != (self._epoch, self._pass):  # a new pass: it began at sampler.start
                (self._epoch, self._pass), self._base, self._batches = where, self.sampler.start, 0
            self._batches += batches
        stop = self._stop_agreed()
        if stop or (self.every and self.steps % self.every == 0):
            self.save()
        if not stop:
            return False
        received = agreement.watched_allgather(self._comm, preemption.received(),
                                               "Checkpointer.step(): which ranks were signalled?")
        if self.rank == 0:
            names = [None if n is None else signal.Signals(n).name for n in received]
            print(f"mpidp: stopped at step {self.steps} ({agreement.by_rank(names)}); checkpoint "
                  f"saved in {self.last_save_seconds:.2f} s", flush=True)
        if self.exit_on_stop:
            preemption.exit_for_requeue()
        return True

    def _stop_agreed(self) -> bool:
        model = self.model
        if isinstance(model, DistributedDataParallel) and model.reducer is not None:
            count, stop = preemption.agreed_by(model)
            token = (id(model.reducer), count)
            if count and token != self._token:  # a synced step since: it carried every rank's flag
                self._token = token
                return stop
        return preemption.agree_stop(self._comm)

    def _module(self) -> torch.nn.Module:
        return self._unwrap(self.model)

    @staticmethod
    def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
        if isinstance(model, (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)):
            return model.module
        return model

    def _whole_optimizer(self):
        """The optimizer saved whole (None: none, or ZeRO's, saved in shards)."""
        return None if isinstance(self.optimizer, ZeroRedundancyOptimizer) else self.optimizer

    def _position(self) -> dict | None:
        if self.sampler is None:
            return None
        epoch = self.sampler.epoch if self._epoch is None else self._epoch
        return {"epoch": epoch, "pass": max(self._pass - 1, 0),
                "start": self._base + self._batches * self._global_batch(),
                "global_batch": self._global_batch(), "seed": self.sampler.seed,
                "samples": len(self.sampler.dataset), "shuffle": self.sampler.shuffle,
                "rewound": self.sampler.rewound}

    def _global_batch(self) -> int:
        """Samples per batch over all ranks: the sampler's micro-batches', or ``batch_size`` x ranks."""
        if self.sampler.micro_batches is not None:
            return self.sampler.global_batch
        return self.batch_size * self.world

    # -- save ----------------------------------------------------------------------------

    def save(self) -> str:
        """Write a checkpoint of the current step, whole or not at all (collective).

        Returns:
            The checkpoint's directory.

        Raises:
            OSError, RuntimeError: on every rank, if any rank could not write.
            TimeoutError: on every rank, if the save took longer than ``deadline``.
            In both cases nothing of this save is left and older checkpoints stay.
        """
        began = time.monotonic()
        name = _directory_of(self.steps)
        final = os.path.join(self.directory, name)
        partial = os.path.join(self.directory, ".partial-" + name)
        label = f"Checkpointer.save() of step {self.steps}"
        with _watchdog.Scope("Checkpointer.save() of step {}", self.steps):
            problem = None
            if self.rank == 0:
                try:
                    shutil.rmtree(partial, ignore_errors=True)
                    os.makedirs(partial)
                except OSError as caught:
                    problem = f"cannot make {partial!r}: {caught}"
            agreement.raise_together(self._comm, problem, OSError, f"{label}:")
            try:
                self._write_all(partial, began)
                self._commit(partial, final, began)
            except BaseException:
                if self.rank == 0:
                    shutil.rmtree(partial, ignore_errors=True)
                raise
        self.last_save_seconds = time.monotonic() - began
        return final

    def _write_all(self, partial: str, began: float) -> None:
        label = f"Checkpointer.save() of step {self.steps}: did every rank write its files?"
        zero = isinstance(self.optimizer, ZeroRedundancyOptimizer)
        if zero:  # collective, agreeing on its own errors
            self.optimizer.save_sharded(partial)
        sharded = _fsdp.is_sharded(self._module())  # the same on every rank (agreed when made)
        error = None
        try:
            if sharded:  # collective (torch's gathers): the whole states, on rank 0
                model, optimizer = _fsdp.full_state(self._module(), self._whole_optimizer())
            else:
                model, optimizer = self._module().state_dict() if self.rank == 0 else None, None
            if zero:
                _fsync_file(os.path.join(partial, f"zero-rank{self.rank:05d}-of-{self.world:05d}.pt"))
            if self.rank == 0:
                _write(os.path.join(partial, "model.pt"), model)
                if optimizer is not None:
                    _write(os.path.join(partial, "optimizer.pt"), optimizer)
                _write(os.path.join(partial, "train.pt"), self._train_state(zero or sharded))
            _write(os.path.join(partial, f"rng-rank{self.rank:05d}.pt"), generators.states())
            elapsed = time.monotonic() - began
            if elapsed > self.deadline:
                raise TimeoutError(f"writing the checkpoint of step {self.steps} took "
                                   f"{elapsed:.3f} s, over the deadline of {self.deadline} s; "
                                   f"it was discarded and the previous checkpoints kept")
        except (OSError, RuntimeError, TimeoutError) as caught:
            error = caught
        agreement.agree(self._comm, error, label)

    def _train_state(self, apart: bool) -> dict:
        """What rank 0 writes in ``train.pt``; the optimizer's too unless it is saved ``apart``."""
        state = {"step": self.steps, "world": self.world, "sampler": self._position(),
                 "extra": {name: obj.state_dict() for name, obj in self.extra.items()}}
        if self.optimizer is not None and not apart:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def _commit(self, partial: str, final: str, began: float) -> None:
        """Rank 0: the manifest, then the rename; older checkpoints pruned (collective)."""
        problem = None
        if self.rank == 0:
            try:
                files = {name: os.path.getsize(os.path.join(partial, name))
                         for name in sorted(os.listdir(partial))}
                manifest = {"format": FORMAT, "step": self.steps, "world": self.world,
                            "sampler": self._position(), "files": files,
                            "write_seconds": round(time.monotonic() - began, 6)}
                with open(os.path.join(partial, MANIFEST), "w") as file:
                    json.dump(manifest, file, indent=1)
                    file.flush()
                    os.fsync(file.fileno())
                _fsync_file(partial)
                if os.path.exists(final):  # this step saved before: the new one replaces it
                    stale = os.path.join(self.directory, ".stale-" + os.path.basename(final))
                    shutil.rmtree(stale, ignore_errors=True)
                    os.rename(final, stale)
                    shutil.rmtree(stale, ignore_errors=True)
                os.rename(partial, final)
                _fsync_file(self.directory)
                self._prune(final)
            except OSError as caught:
                problem = f"cannot commit {final!r}: {caught}"
        agreement.raise_together(self._comm, problem, OSError,
                                 f"Checkpointer.save() of step {self.steps}:")

    def _prune(self, final: str) -> None:
        names = sorted(n for n in os.listdir(self.directory) if _NAME.match(n))
        for name in names[:-self.keep]:
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        for name in os.listdir(self.directory):
            if name.startswith(".partial-") and name != os.path.basename(final):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    # -- resume --------------------------------------------------------------------------

    def resume(self) -> int:
        """Load the newest whole checkpoint, if any, on every rank (collective).

        With a sampler, the loop may start over from its top: its epochs before
        the checkpoint's yield nothing (``DistributedSampler.resume_from``), and
        when it reaches the checkpoint's position, the scheduler, scaler,
        ``extra``, the optimizer's hyperparameters (``lr``, ...) and every
        rank's generators are loaded again, so that what the loop did to them
        on its way (a scheduler stepped per epoch, ``iter(loader)``'s draw)
        leaves no trace. The model and the optimizer's state change only in
        steps, and are loaded once.

        Returns:
            The step it was saved at (0, and nothing loaded, if there is none);
            ``self.steps`` goes on from there.

        Raises:
            ValueError, RuntimeError, OSError: on every rank, if any rank could not
            load it (a model or optimizer of another shape, a global batch that
            ``batch_size`` x ranks no longer gives, a run whose epochs went back).
        """
        found = None
        if self.rank == 0:
            found = latest_checkpoint(self.directory)
        found = collective(self._comm, "bcast", (found, 0),
                           "Checkpointer.resume(): which checkpoint?")
        if found is None:
            return 0
        path, manifest = found
        sharded = _fsdp.is_sharded(self._module())  # the same on every rank (agreed when made)
        error, whole = None, None
        try:
            if sharded:
                whole = self._read_whole(path)
            self._load_replicated(path, manifest, sharded)
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as caught:
            error = caught
        agreement.agree(self._comm, error, f"Checkpointer.resume() from {path}: did every rank load it?")
        if sharded:
            self._load_whole(path, whole)
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            self.optimizer.load_sharded(path)  # collective, at any number of ranks
        if self._replay is not None:  # the hyperparameters loaded (by load_sharded too)
            self._replay["groups"] = copy.deepcopy(
                [{key: value for key, value in group.items() if key != "params"}
                 for group in getattr(self.optimizer, "param_groups", ())])
        self.steps = manifest["step"]
        self._token = None
        return self.steps

    def _read_whole(self, path: str) -> tuple[dict, dict | None]:
        """An FSDP2 model's whole states, checked against the model and optimizer (local)."""
        optimizer = self._whole_optimizer()
        model_state = _load(os.path.join(path, "model.pt"))
        optimizer_state = None if optimizer is None else _load(os.path.join(path, "optimizer.pt"))
        problem = _fsdp.mismatch(self._module(), optimizer, model_state, optimizer_state)
        if problem is not None:
            raise ValueError(f"{path} does not fit the FSDP2 model and its optimizer: {problem}")
        return model_state, optimizer_state

    def _load_whole(self, path: str, whole: tuple) -> None:
        """The whole states (``_read_whole``) into every rank's FSDP2 shards (collective:
        torch's calls over the model's group)."""
        error = None
        try:
            _fsdp.load(self._module(), self._whole_optimizer(), *whole)
        except (RuntimeError, ValueError, KeyError, TypeError) as caught:
            error = caught
        agreement.agree(self._comm, error, f"Checkpointer.resume() from {path}: did every rank "
                                           f"load its FSDP2 shards?")

    def _load_replicated(self, path: str, manifest: dict, sharded: bool) -> None:
        train = _load(os.path.join(path, "train.pt"))
        position = train["sampler"]
        if self.sampler is not None:
            if position is None:
                raise ValueError(f"{path} holds no sampler position (saved without a sampler)")
            for key, now in (("samples", len(self.sampler.dataset)), ("seed", self.sampler.seed),
                             ("shuffle", self.sampler.shuffle)):
                if position[key] != now:
                    raise ValueError(f"the sampler's {key} is {now!r}, the checkpoint's "
                                     f"{position[key]!r}: not the same data order")
            if position.get("rewound"):
                raise ValueError(
                    "the checkpoint's run called set_epoch with an epoch below one it had "
                    f"trained (epochs that repeat, as set_epoch(epoch % k)), then stopped in "
                    f"epoch {position['epoch']}: a resume cannot tell which of its passes over "
                    f"that epoch it was. Give every epoch a number of its own that only grows "
                    f"(set_epoch(epoch), counted on)")
            if position["global_batch"] != self._global_batch() and self.sampler.micro_batches:
                raise ValueError(
                    f"the checkpoint's global batch is {position['global_batch']} samples, the "
                    f"sampler's {self.sampler.micro_batches} micro-batches of "
                    f"{self.sampler.micro_batch_size} are {self._global_batch()}: keep the "
                    f"global batch to go on with the same batches")
            if position["global_batch"] != self._global_batch():
                raise ValueError(
                    f"the checkpoint's global batch is {position['global_batch']} samples "
                    f"({position['global_batch'] // manifest['world']} per rank at "
                    f"{manifest['world']} ranks); at {self.world} ranks batch_size must be "
                    f"{position['global_batch'] / self.world:g} to keep it, got {self.batch_size}")
        if not sharded:  # FSDP2's: _load_whole
            self._module().load_state_dict(_load(os.path.join(path, "model.pt")))
            if self._whole_optimizer() is not None:
                self.optimizer.load_state_dict(train["optimizer"])
        self._load_small(train)
        if self.rank < manifest["world"]:
            rng = _load(os.path.join(path, f"rng-rank{self.rank:05d}.pt"))
        else:
            rng = generators.derived_seed(manifest["step"], self.rank)
        _restore_generators(rng)
        if self.sampler is not None:
            self._replay = {"rng": rng, **copy.deepcopy(
                {key: train.get(key) for key in ("scheduler", "scaler", "extra")})}
            epoch, passes = position["epoch"], position.get("pass", 0)
            self.sampler.resume_from(epoch, position["start"], passes=passes,
                                     reached=self._load_again)
            self._epoch, self._pass = epoch, passes + 1  # that pass, once the loop is back at it
            self._base, self._batches = position["start"], 0

    def _load_again(self) -> None:
        """Load again what the loop may have changed on its way to the position (local;
        the sampler calls it as the pass at the position begins)."""
        replay, self._replay = self._replay, None
        for group, saved in zip(getattr(self.optimizer, "param_groups", ()), replay["groups"]):
            group.update(saved)
        self._load_small(replay)
        _restore_generators(replay["rng"])

    def _load_small(self, states: Mapping) -> None:
        """The scheduler's, the scaler's and ``extra``'s states (local)."""
        if self.scheduler is not None:
            self.scheduler.load_state_dict(states["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(states["scaler"])
        for name, obj in self.extra.items():
            obj.load_state_dict(states["extra"][name])
