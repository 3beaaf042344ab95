"""Reproducible mode: the same gradients, bit for bit, at any number of ranks.

A float sum depends on its order, and the order of an allreduce depends on the
rank count and on the MPI library's algorithm; so does each rank's local sum
over its share of the batch. In reproducible mode
(``DistributedDataParallel(model, reproducible=True)``) nothing is summed in an
order that depends on the rank count:

- the global batch is cut into ``M`` fixed micro-batches, dealt to the ranks
  as evenly as they divide (``mpidp.sampler.micro_batch_counts``: rank ``r``
  runs ``k_r`` of them, a contiguous run in rank order; the sampler deals
  them: ``mpidp.DistributedSampler(micro_batches=, micro_batch_size=)``), one
  forward and backward each, the first ``k_r - 1`` under ``no_sync()``;
- each micro-batch's gradient is kept apart, in its own row of a ``[k_r, n]``
  store per bucket (``.grad`` is released after each micro-batch, so nothing
  is accumulated in float);
- the synced forward gathers every rank's ``k_r`` and checks them against the
  dealing of ``M`` (given as ``micro_batches``, else fixed by the first synced
  step's total), so that every rank knows the splits of the exchange;
- at the synced backward each bucket's rows are exchanged by an alltoall (with
  splits where the ``k_r`` differ), chunk by chunk, so that each rank
  receives, for its block of every chunk (the ``mpidp.ddp.buckets.Shards``
  layout), all ``M`` micro-batches' values in micro-batch order; it adds them
  left to right, starting from micro-batch 0, and divides by ``M``: the
  operations one process would do, element by element, whatever the rank
  count;
- an allgather of the blocks leaves the average in every rank's bucket (or,
  with a stage-2 ``ZeroRedundancyOptimizer``, each block goes to its owner's
  gradient shard and there is no allgather).

Everything else (the hooks, the in-order launch, the bookkeeping and its
errors) is ``mpidp.ddp.reducer.Reducer``'s. The kernels of one micro-batch must
themselves be deterministic (torch's ``use_deterministic_algorithms`` on GPUs).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import comm as _comm
from . import outcome as _outcome
from ..comm import agreement as _agreement
from ..comm import chunking as _chunking
from ..sampler import micro_batch_counts
from .buckets import Bucket, Shards
from .reducer import Reducer
from .sharded import ShardedReducer
from .step import DONE, Step, find_tensors

__all__ = ["ReproducibleReducer"]


class ReproducibleReducer(Reducer):
    """Sums each bucket's per-micro-batch gradients in micro-batch order (see the module).

    Args:
        training: returns whether the module is in training mode: a forward in
            evaluation mode is no micro-batch (no check, no capture; as ``Reducer``).
        sink: a stage-2 ``ZeroRedundancyOptimizer`` that takes each rank's
            block of the averages (``grad_target``/``reduced``, as
            ``mpidp.ddp.sharded.ShardedReducer``'s sink), or None: every rank
            gets the whole average in ``.grad``.
        micro_batches: ``M``, the micro-batches of every step, or None: the
            first synced step's total fixes it (``self.micro_batches``).
        given: whether ``M`` is the user's ``micro_batches`` (for the message).
        Otherwise those of ``Reducer``; ``gradient_as_bucket_view``,
        ``predict_order`` and ``solo_bytes`` are forced off (the buckets keep
        one layout, and every gradient goes through one), and no shared memory.
    """

    def __init__(self, named_params, pool, control, *, training, sink=None,
                 micro_batches: int | None = None, given: bool = False, **options):
        self.sink = sink
        self.micro_batches, self._given = micro_batches, given
        self._training = training
        self._rows = 1  # micro-batches per rank the stores hold (they grow)
        self._row = 0  # the micro-batch this rank runs next in the step
        self._counts: list[int] = []  # every rank's micro-batches in the step, agreed
        self._local: Step | None = None  # the step of a micro-batch inside no_sync
        self._local_failed = False
        self._stash: dict[int, torch.Tensor] = {}  # .grad found before a micro-batch
        self._stash_at: Step | None = None  # the step whose backward takes .grad aside first
        self._scratches: dict[tuple, torch.Tensor] = {}
        options.update(gradient_as_bucket_view=False, predict_order=False, solo_bytes=None,
                       shared=None)
        super().__init__(named_params, pool, control, **options)
        self._divisor = 1  # the sum is divided by M once, after it is complete

    # -- layout -----------------------------------------------------------------------

    def _bucket(self, members: list[int], solo: bool) -> Bucket:
        params = [self.params[i] for i in members]
        chunk = _chunking.chunk_numel(self.strategy.chunk_bytes, params[0].element_size())
        bucket = Bucket(params, shards=Shards(sum(p.numel() for p in params), self.world, chunk))
        bucket.store = torch.zeros(self._rows, bucket.shards.padded, dtype=params[0].dtype,
                                   device=params[0].device)
        return bucket

    def set_divisor(self, divisor: int) -> None:
        raise RuntimeError("DistributedDataParallel(reproducible=True) divides by the number "
                           "of micro-batches; join() is not supported")

    # -- a micro-batch's forward ------------------------------------------------------

    def prepare(self, outputs, sync: bool) -> None:
        """Arm the capture of one micro-batch's gradients; the synced one ends the step.

        The synced forward first gathers every rank's count of micro-batches,
        whether one failed and the ``M`` it knows (one small allgather): the
        counts must be the dealing of ``M`` (``micro_batch_counts``; of their
        sum while no rank knows ``M``, which that sum then fixes) and none may
        have failed, or every rank raises the same ``ValueError``.
        """
        self.settle()
        if not self._training():  # evaluation with grad enabled (may run on one rank alone)
            super().prepare(outputs, sync)
            self._local = self._stash_at = None
            return
        if sync:
            self._check_step()
        super().prepare(outputs, True)
        step = self._step
        self._local = None if sync else step
        if not sync:
            step.counted = True  # a step number only for the synced backward
        # .grad is taken aside when the backward begins (the outputs' hooks run first), so
        # that a zero_grad() between this forward and its backward counts
        self._stash_at = step
        if not any(t.requires_grad and t.grad_fn is not None for t in find_tensors(outputs)):
            self._take_aside(step)
        if self._row >= self._rows:
            self._grow(self._row + 1)
        for bucket in self.layout.buckets:
            bucket.bind(bucket.store[self._row])

    def _check_step(self) -> None:
        failed, self._local_failed = self._local_failed, False
        row = np.array([self._row + 1, int(failed), self.micro_batches or 0, int(self._given)],
                       dtype=np.int64)
        try:
            table = _agreement.decide_rows(self.control, row, _judge_step,
                                           "DDP(reproducible=True): the micro-batches of the step")
        except ValueError:
            self._row = 0
            self._stash.clear()
            raise
        self._counts = table[:, 0].tolist()
        self.micro_batches = sum(self._counts)  # M, from now on (checked against it if known)

    def _on_output_grad(self, step: Step, grad) -> None:
        self._take_aside(step)
        super()._on_output_grad(step, grad)

    def _take_aside(self, step: Step) -> None:
        if step is self._stash_at:
            self._stash_at = None
            self._stash_grads()

    def _stash_grads(self) -> None:
        # A gradient left from before (no zero_grad) is added back after the reduction,
        # as torch accumulates; the micro-batch's own gradient starts from None.
        stores = {bucket.store.untyped_storage().data_ptr() for bucket in self.layout.buckets}
        for index, param in enumerate(self.params):
            if param.grad is not None:
                if param.grad.untyped_storage().data_ptr() in stores:  # the last average
                    param.grad = param.grad.clone()
                if index in self._stash:
                    self._stash[index] = self._stash[index] + param.grad
                else:
                    self._stash[index] = param.grad
                param.grad = None

    def _grow(self, rows: int) -> None:
        self._rows = rows
        for bucket in self.layout.buckets:
            store = bucket.store.new_zeros(rows, bucket.store.shape[1])
            store[:bucket.store.shape[0]].copy_(bucket.store)
            bucket.store = store

    # -- hooks and the end of a micro-batch -------------------------------------------

    def _mark_ready(self, step: Step, index: int, arrived: bool = False,
                    zero: bool = False) -> None:
        super()._mark_ready(step, index, arrived, zero)
        if arrived and step is self._local:
            self.params[index].grad = None  # kept in its row: the next micro-batch starts at None

    def _launch_ready(self, step: Step) -> None:
        if step is not self._local:
            super()._launch_ready(step)

    def _finish(self, step: Step, failed: bool, joined: bool = False) -> None:
        if step is not self._local:
            try:
                super()._finish(step, failed, joined)
            finally:
                self._row = 0
            return
        step.state = DONE
        self._local = None
        for index in range(len(self.params)):
            if not step.ready[index]:
                self._mark_ready(step, index, zero=failed)
        self._local_failed |= failed
        self._row += 1

    # -- the synced step's reduction --------------------------------------------------

    def _launch(self, bucket: Bucket) -> None:
        with self.launcher.fatal_on_error(self._steps):
            self._reduce_bucket(bucket)

    def _reduce_bucket(self, bucket: Bucket) -> None:
        """Sum the bucket's micro-batches in order, each rank for its block of every chunk."""
        rows, world, rank = self._row + 1, self.world, self.control.Get_rank()
        counts = self._counts  # every rank's rows, from the step's agreed table
        count, even = sum(counts), counts.count(rows) == world
        store = bucket.store[:rows]
        target = self.sink.grad_target(self.layout.position[id(bucket)]) if self.sink else None
        pool = self.strategy.pool
        for (start, stop), (low, high, position) in zip(bucket.shards.chunks,
                                                        bucket.shards.blocks(rank)):
            block = (stop - start) // world
            # [rows, world * block] -> [world, rows, block]: block s of each row goes to rank s
            outgoing = store[:, start:stop].reshape(rows, world, block).transpose(0, 1)
            if rows > 1:
                outgoing = self._scratch(1, outgoing.shape, store).copy_(outgoing)
            incoming = self._scratch(0, (count, block), store)
            if even:
                _comm.alltoall(incoming, outgoing, comm=pool)
            else:  # rank p's counts[p] rows of each block, in rank order: micro-batch order
                _comm.alltoall(incoming, outgoing.reshape(world * rows, block), counts,
                               [rows] * world, comm=pool, check_splits=False)
            result = bucket.buffer[low:high] if target is None else target[position:position + block]
            if count == 1:
                result.copy_(incoming[0])
            else:  # left to right, from micro-batch 0, as one process adds them
                torch.add(incoming[0], incoming[1], out=result)
                for row in incoming[2:]:
                    result.add_(row)
            _chunking.mean_of_sum(result, count)  # after the sum: a listed exception
            if target is None:
                _comm.allgather(bucket.buffer[start:stop], result, comm=pool)

    def _scratch(self, which: int, shape, like: torch.Tensor) -> torch.Tensor:
        """Scratch buffer ``which`` (0: received, 1: sent) of ``shape``; it only grows."""
        key = (which, like.dtype, like.device)
        numel = shape[0] * shape[1] * (shape[2] if len(shape) > 2 else 1)
        buffer = self._scratches.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratches[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel].view(shape)

    def _copy_back(self, counts: list[int]) -> None:
        if self.sink is not None:
            ShardedReducer._copy_back(self, counts)
        else:
            # .grad becomes a view of the averages (no copy); the next micro-batch's
            # forward takes it out of the way first (_stash_grads)
            for bucket in self.layout.buckets:
                bucket.buffer = bucket.buffer[:bucket.shards.numel]  # without the padding
            _outcome.copy_back(self.params, self.layout.buckets, self.layout.members, counts,
                               known_unused=self.find_unused, as_view=True)
        stash, self._stash = self._stash, {}
        for index, earlier in stash.items():
            param = self.params[index]
            if param.grad is None:
                param.grad = earlier
            else:
                param.grad.add_(earlier)  # onto the average, as torch accumulates


def _judge_step(table: np.ndarray) -> ValueError | None:
    """The step's check, on every rank alike: rows of each rank's micro-batches, its failure,
    the ``M`` it knows (0: none yet; those known are equal) and whether the user gave it."""
    counts, failed = table[:, 0].tolist(), table[:, 1].tolist()
    known, given = int(table[:, 2].max()), bool(table[:, 3].max())
    total, world = known or sum(counts), len(counts)
    dealt = micro_batch_counts(total, world)  # known >= world (checked), and every count >= 1
    if counts == dealt and not any(failed):
        return None
    ran = [f"ran {n} micro-batch(es)" + (", one of whose backward raised" if bad else "")
           for n, bad in zip(counts, failed)]
    if not known:
        of = f"{total} (their sum; pass micro_batches= to check the total too)"
    elif given:
        of = f"micro_batches={total}"
    else:
        of = (f"{total}, the total the first synced step fixed for this DDP's life; "
              f"DistributedDataParallel(micro_batches=) states it from the first step")
    return ValueError(
        f"DistributedDataParallel(reproducible=True): every rank must run its micro-batches of "
        f"the step as the sampler deals them, as evenly as they divide, the first ranks one "
        f"more (micro_batch_counts(M, {world} ranks) = {dealt}, M = {of}; the first ones under "
        f"no_sync(), the last one outside it), and none may fail; this step: "
        f"{_agreement.by_rank(ran)}")
