"""ZeRO stage 2's reducer: each bucket is reduce-scattered into its owners' gradient shards.

``ShardedReducer`` is ``mpidp.ddp.reducer.Reducer`` with buckets that borrow their
buffers only while they are filled and reduced, and a reduce-scatter into the
``ZeroRedundancyOptimizer``'s shards (``mpidp.zero``) in place of the
allreduce and the copy back into ``.grad``. Everything else (the hooks, the
launch order, the bookkeeping across ranks) is the Reducer's.
"""

from __future__ import annotations

import torch

from . import overlap as _overlap
from ..comm import chunking as _chunking
from .buckets import Bucket, Shards
from .reducer import Reducer
from .step import Step

__all__ = ["ShardedReducer"]


class ShardedReducer(Reducer):
    """ZeRO stage 2: each bucket is reduce-scattered into its owners' gradient shards.

    The buckets have no buffer of their own. A bucket takes a flat buffer from
    a free list when its first gradient arrives; each gradient is copied in
    (divided by the world size, as always) and its ``.grad`` is released at
    once; the buffer goes back to the list as soon as the bucket's
    reduce-scatter has returned (the "inline" strategy) or at the end of the
    backward pass (the others). So the full-size gradients alive at any time are
    those of the buckets being filled, not the model's. The bucket layout is
    fixed (reverse registration order, no rebuild) because the optimizer's
    shards follow it: rank ``r`` owns the ``r``-th block of every chunk of every
    bucket (``mpidp.ddp.buckets.Shards``).

    After a synced backward every ``param.grad`` is None; ``sink`` (the
    ``ZeroRedundancyOptimizer``) holds this rank's averaged shard:
    ``sink.grad_target(k)`` gives the flat tensor that bucket ``k``'s shard is
    written to, and ``sink.reduced(used)`` is told, per parameter,
    which parameters have a gradient (False: unused on every rank), once the
    ranks agree that the step is good.

    Args:
        sink: the receiver of the shards (see above).
        Otherwise those of ``Reducer``; ``gradient_as_bucket_view`` and
        ``predict_order`` are forced off, and sparse gradients are refused by
        the caller. ``solo_bytes`` gives big gradients a bucket of their own,
        reduce-scattered where they lie when their size divides by the world.
    """

    def __init__(self, named_params, pool, control, *, sink, **options):
        self.sink = sink
        self._spares: list[torch.Tensor] = []
        self._bound: dict[int, tuple[Bucket, torch.Tensor]] = {}
        options.update(gradient_as_bucket_view=False, predict_order=False)
        super().__init__(named_params, pool, control, **options)

    def _bucket(self, members: list[int], solo: bool) -> Bucket:
        params = [self.params[i] for i in members]
        # the chunks mpidp.comm.chunking.pieces would cut: rank r owns a block of each
        chunk = _chunking.chunk_numel(self.strategy.chunk_bytes, params[0].element_size())
        numel = sum(p.numel() for p in params)
        bucket = Bucket(params, shards=Shards(numel, self.world, chunk))
        bucket.key = (params[0].dtype, params[0].device)
        # A gradient alone in its bucket (solo_bytes puts big ones there) needs no
        # padding when its size divides by the world: it is reduce-scattered
        # where it lies, with no copy and no second buffer.
        bucket.direct = len(params) == 1 and numel % self.world == 0
        return bucket

    def _bind(self, bucket: Bucket) -> None:
        dtype, device = bucket.key
        need = bucket.shards.padded
        for k, spare in enumerate(self._spares):
            if spare.dtype == dtype and spare.device == device and spare.numel() >= need:
                base = self._spares.pop(k)
                break
        else:
            base = torch.empty(need, dtype=dtype, device=device)
        bucket.bind(base)
        self._bound[id(bucket)] = (bucket, base)

    def _release(self, bucket: Bucket) -> None:
        bucket, base = self._bound.pop(id(bucket))
        bucket.unbind()
        if base is not None:  # None: the gradient itself, freed with it
            self._spares.append(base)

    def _mark_ready(self, step: Step, index: int, arrived: bool = False,
                    zero: bool = False) -> None:
        slot = self.layout.slot[index]
        if slot is not None and slot[0].buffer is None and not step.ready[index]:
            grad = self.params[index].grad
            if (slot[0].direct and arrived and not zero and grad is not None
                    and grad.is_contiguous()):
                slot[0].bind(grad.view(-1))  # divided in place (_mark_ready, or _launch)
                self._bound[id(slot[0])] = (slot[0], None)
            else:
                self._bind(slot[0])
        super()._mark_ready(step, index, arrived, zero)
        if arrived:
            self.params[index].grad = None  # its share is in the bucket (or its batched copy) now

    def _launch(self, bucket: Bucket) -> None:
        target = self.sink.grad_target(self.layout.position[id(bucket)])
        shards = bucket.shards
        # a batched copy left the division to here (mpidp.ddp.packing): each chunk before its turn
        pairs = [(_chunking.divide(bucket.buffer[start:stop], bucket.divisor),
                  target[position:position + (stop - start) // self.world])
                 for (start, stop), (_, _, position) in zip(shards.chunks, shards.blocks(0))]
        with self.launcher.fatal_on_error(self._steps):
            self.strategy.start(bucket.buffer, 1, pairs)
        if isinstance(self.strategy, _overlap.InlineStrategy):
            self._release(bucket)  # reduced already: the buffer can serve the next bucket

    def _finish(self, step: Step, failed: bool, joined: bool = False) -> None:
        try:
            super()._finish(step, failed, joined)
        finally:
            for bucket, _ in list(self._bound.values()):
                self._release(bucket)

    def _copy_back(self, counts: list[int]) -> None:
        # As in mpidp.ddp.outcome.copy_back: only a parameter unused on every rank (known
        # with find_unused_parameters or static_graph) is left without a gradient.
        known = self.find_unused or self.static_graph
        self.sink.reduced([count > 0 or not known for count in counts[:len(self.params)]])
