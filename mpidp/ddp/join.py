"""DistributedDataParallel.join(): training on uneven inputs, as torch's.

Every synced step is a set of collectives that every rank must issue: the
buffer broadcast, the bucket allreduces, the bookkeeping allreduce, and the
collectives of SyncBatchNorm layers. A rank whose data ran out first would
leave the others waiting in them; inside ``join()`` it instead shadows them,
issuing the same collectives with zeros, until every rank has run out, and
then the model of the last rank to leave is broadcast to all.

``Joiner`` is the part of a ``DistributedDataParallel`` that does this: it
holds the active ``JoinConfig``, and the DDP calls its ``notify`` from each
grad-enabled forward inside the context.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol

import torch
from mpi4py import MPI

from .. import _args
from .. import comm as _comm
from .. import runtime
from . import syncbn
from .comm_hook import CommHooks
from .reducer import Reducer
from .replica import broadcast_coalesced

__all__ = ["JoinConfig", "Joinable", "Joiner"]


class Joinable(Protocol):
    """What ``Joiner`` reads of its DistributedDataParallel."""

    module: torch.nn.Module
    pool: _comm.Pool | None
    control: MPI.Intracomm | None
    reducer: Reducer | None
    forward_sync_buffers: bool
    require_backward_grad_sync: bool
    _sink: object | None  # the stage-2 ZeroRedundancyOptimizer, or None
    _options: dict

    def _buffers_to_sync(self) -> list[torch.Tensor]: ...

    def _connect(self, base: MPI.Intracomm, device: torch.device) -> None: ...


class Joiner:
    """A DDP's ``join()``: the active context's settings and the shadowing of the active ranks.

    Args:
        owner: the DistributedDataParallel (``Joinable``).
        hooks: its comm hooks (a registered hook rules ``join()`` out).
    """

    def __init__(self, owner: Joinable, hooks: CommHooks):
        self._owner = owner
        self._hooks = hooks
        self.config: JoinConfig | None = None  # the active join()'s, else None

    @contextlib.contextmanager
    def context(self, divide_by_initial_world_size: bool, enable: bool,
                throw_on_early_termination: bool):
        """``DistributedDataParallel.join``'s context."""
        ddp = self._owner
        for name, value in (("divide_by_initial_world_size", divide_by_initial_world_size),
                            ("enable", enable),
                            ("throw_on_early_termination", throw_on_early_termination)):
            _args.check_bool(name, value)
        if not enable:
            yield
            return
        if self.config is not None:
            raise RuntimeError("DistributedDataParallel.join() is already active; do not nest it")
        if self._hooks.hook is not None:
            raise RuntimeError("DistributedDataParallel.join() does not support a comm hook: "
                               "a joined rank cannot run the hook's collectives in step; give "
                               "every rank the same number of batches")
        if ddp._options["reproducible"]:
            raise RuntimeError("DistributedDataParallel.join() is not supported with "
                               "reproducible=True: every rank runs its whole micro-batches of "
                               "every global batch (DistributedSampler(micro_batches=...))")
        if ddp._sink is not None:
            raise RuntimeError("DistributedDataParallel.join() cannot shadow a stage-2 "
                               "ZeroRedundancyOptimizer's step (its parameter allgather); give "
                               "every rank the same number of batches (DistributedSampler with "
                               "drop_last=True)")
        if ddp.reducer is None:
            ddp._connect(runtime.world(), next(ddp.module.parameters()).device)
        layers = [m for m in ddp.module.modules() if isinstance(m, syncbn.SyncBatchNorm)]
        if layers and runtime.thread_level() < MPI.THREAD_MULTIPLE:
            raise ValueError("join() with mpidp.SyncBatchNorm layers needs MPI_THREAD_MULTIPLE "
                             "(a joined rank stands in for their backward collectives from a "
                             "second thread), but MPI granted a lower thread level")
        config = self.config = JoinConfig(divide_by_initial_world_size, throw_on_early_termination)
        # The last step's order of SyncBatchNorm collectives on this rank: what
        # it replays with zeros once joined (module order if it never ran a step).
        config.trace = ([(layer, "stats") for layer in layers] +
                        [(layer, "grads") for layer in reversed(layers)])
        if layers:
            syncbn.record([])
        try:
            yield
        except BaseException:
            self.config = None  # as torch: the exception goes on, no shadowing
            ddp.reducer.set_divisor(ddp.pool.size)
            syncbn.record(None)
            raise
        if layers:
            config.trace = syncbn.record(None) or config.trace
        try:
            self._shadow_until_all_joined(config)
        finally:
            self.config = None
            ddp.reducer.set_divisor(ddp.pool.size)

    def _verdict(self, active: torch.Tensor, config: "JoinConfig") -> tuple[int, int]:
        """From the summed activity vector: (active ranks, the highest of them); maybe raise."""
        world = self._owner.pool.size
        ranks = active[:world].nonzero().flatten().tolist()
        if config.throw and len(ranks) < world:
            joined = sorted(set(range(world)) - set(ranks))
            raise RuntimeError(f"DistributedDataParallel.join: rank(s) {joined} ran out of inputs "
                               f"and throw_on_early_termination=True, so every rank raises")
        return len(ranks), ranks[-1] if ranks else -1

    def notify(self) -> int:
        """An active rank's forward inside join(): say so; return the buffers' source rank."""
        ddp, config = self._owner, self.config
        world, rank = ddp.pool.size, ddp.pool.rank
        active = torch.zeros(world + 1, dtype=torch.int64)
        active[rank] = 1
        active[world] = int(ddp.require_backward_grad_sync)
        _comm.allreduce(active, "sum", comm=ddp.control)
        count, authority = self._verdict(active, config)
        if syncbn._trace is not None:  # a new step: the last one's order is complete
            config.trace = syncbn.record([]) or config.trace
        ddp.reducer.set_divisor(world if config.divide_by_initial else count)
        # torch's rule under join: buffers come from the highest active rank,
        # since rank 0 may have joined and hold stale ones.
        return authority

    def _shadow_until_all_joined(self, config: "JoinConfig") -> None:
        ddp = self._owner
        world, rank = ddp.pool.size, ddp.pool.rank
        last_joiner = True
        while True:
            active = torch.zeros(world + 1, dtype=torch.int64)
            _comm.allreduce(active, "sum", comm=ddp.control)
            if not active[:world].any():
                break
            last_joiner = False
            _, authority = self._verdict(active, config)
            if active[world]:  # the active ranks' forward will sync (not inside no_sync)
                buffers = ddp._buffers_to_sync() if ddp.forward_sync_buffers else []
                if buffers and world > 1:
                    broadcast_coalesced(buffers, authority, comm=ddp.control)
            for layer, kind in config.trace:
                if kind == "stats":
                    layer._shadow_forward()
            self._shadow_backward([layer for layer, kind in config.trace if kind == "grads"],
                                  buckets=bool(active[world]))
        # Every rank has joined: the last one to join holds the final model.
        source = torch.tensor([rank if last_joiner else -1], dtype=torch.int64)
        _comm.allreduce(source, "max", comm=ddp.control)
        if world > 1:
            broadcast_coalesced(list(ddp.module.parameters()) +
                                (ddp._buffers_to_sync() if ddp.forward_sync_buffers else []),
                                int(source), comm=ddp.control)

    def _shadow_backward(self, layers: list, buckets: bool) -> None:
        # The active ranks' backward interleaves the SyncBatchNorm collectives
        # (on their communicator) with the bucket allreduces (on the pool) in an
        # order only their autograd engine knows; a second thread takes the
        # layers' part so that neither sequence can block the other. (MPI never
        # matches a nonblocking collective with a blocking one, so posting them
        # nonblocking would not do.)
        failure: list[BaseException] = []

        def layers_part():
            try:
                for layer in layers:
                    layer._shadow_backward()
            except BaseException as error:  # re-raised below, on this thread
                failure.append(error)

        helper = threading.Thread(target=layers_part, name="mpidp-join-syncbn", daemon=True)
        if layers:
            helper.start()
        try:
            if buckets:
                self._owner.reducer.shadow()
        finally:
            if layers:
                helper.join()
        if failure:
            raise failure[0]


class JoinConfig:
    """The settings of one ``join()`` context."""

    __slots__ = ("divide_by_initial", "throw", "trace")

    def __init__(self, divide_by_initial: bool, throw: bool):
        self.divide_by_initial = divide_by_initial
        self.throw = throw
        self.trace: list = []  # (SyncBatchNorm layer, "stats" or "grads") in call order
