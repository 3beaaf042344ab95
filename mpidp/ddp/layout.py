"""Where each gradient goes: the reducer's bucket layout, rebuilt once and moved into shared memory.

``BucketLayout`` is the part of ``mpidp.ddp.reducer.Reducer`` that decides and
builds the buckets: which parameters share one (``mpidp.ddp.buckets.assign_buckets``),
each parameter's slot, the one rebuild in rank 0's observed gradient order
(torch's bucket rebuild), and the move of the CPU buckets into one mapping the
node's ranks share (``mpidp.comm.shm``). It is a mixin because every gradient hook
of the reducer reads the slots it builds; it has no constructor (the
reducer's calls ``_build``).

The class it is mixed into provides: ``params``, ``_dense`` (indices of the
parameters with dense gradients), ``_caps`` (bucket capacity and first bucket
capacity in bytes), ``_solo_bytes``, ``_node`` (an ``mpidp.comm.shm.Node`` or None),
``_arrival`` (the recorded gradient order or None), ``as_view``, ``control``
and ``strategy``.
"""

from __future__ import annotations

import warnings

import torch

from .. import comm as _comm
from .buckets import Bucket, assign_buckets

__all__ = ["BucketLayout"]


class BucketLayout:
    """Builds ``layout``, ``buckets`` and the parameters' slots in them (a mixin of ``Reducer``)."""

    def _assign(self, order: list[int] | None = None) -> list[list[int]]:
        dense = self._dense
        position = {index: k for k, index in enumerate(dense)}
        if order is not None:
            order = [position[i] for i in order if i in position]
        local = assign_buckets([self.params[i].numel() * self.params[i].element_size() for i in dense],
                               [(self.params[i].dtype, self.params[i].device) for i in dense],
                               *self._caps, order=order, solo_bytes=self._solo_bytes)
        return [[dense[k] for k in members] for members in local]

    def _is_solo(self, members: list[int]) -> bool:
        param = self.params[members[0]]
        return (len(members) == 1 and self._solo_bytes is not None
                and param.numel() * param.element_size() >= self._solo_bytes)

    def _bucket(self, members: list[int]) -> Bucket:
        return Bucket([self.params[i] for i in members], solo=self._is_solo(members))

    def _build(self, layout: list[list[int]]) -> None:
        self.layout = layout
        self.buckets = [self._bucket(members) for members in layout]
        self._position = {id(bucket): k for k, bucket in enumerate(self.buckets)}
        # (bucket, position in it) of each parameter; None: sparse, never bucketed
        self._slot: list[tuple[Bucket, int] | None] = [None] * len(self.params)
        for bucket, members in zip(self.buckets, layout):
            for k, index in enumerate(members):
                self._slot[index] = (bucket, k)
        if self._node is not None:
            self._adopt_window()

    def _slots(self):
        return ((slot if slot is not None else (None, None)) for slot in self._slot)

    def _rebuild_in_arrival_order(self) -> None:
        arrived = set(self._arrival)
        order = self._arrival + [i for i in reversed(range(len(self.params))) if i not in arrived]
        self._arrival = None
        shared = torch.tensor(order, dtype=torch.int64)
        _comm.broadcast(shared, 0, comm=self.control)
        layout = self._assign(shared.tolist())
        if layout == self.layout:
            return
        old_views = [bucket.views[k] if bucket is not None else None for bucket, k in self._slots()]
        self._build(layout)
        if self.as_view:
            for param, old, (bucket, k) in zip(self.params, old_views, self._slots()):
                new = bucket.views[k] if bucket is not None else None
                if old is None or new is None:
                    continue
                if param.grad is not None and param.grad.data_ptr() == old.data_ptr():
                    new.copy_(old)
                    param.grad = new

    def _adopt_window(self) -> None:
        """Move the CPU buckets into one shared mapping (collective, with each layout).

        Every rank has the same layout here, so the same buckets and sizes. A
        gradient that is a bucket view follows its bucket. If any rank cannot
        allocate, every rank keeps its buckets and reduces with MPI from now on.
        The previous layout's mapping goes with the last tensor on it.
        """
        node = self._node
        buckets = [b for b in self.buckets if not b.solo and b.buffer is not None
                   and b.buffer.device.type == "cpu"]
        if not buckets:
            return
        offsets, total = [], 0
        for bucket in buckets:
            offsets.append(total)
            total += -(-bucket.buffer.numel() * bucket.buffer.element_size() // 64) * 64
        window = node.allocate(total)
        if window is None:
            self._node = self.window = self.strategy.window = None
            warnings.warn(f"mpidp: no shared-memory window of {total} bytes could be allocated "
                          f"(is /dev/shm full?); gradients are reduced through MPI",
                          RuntimeWarning, stacklevel=2)
            return
        old_views = [bucket.views[k] if bucket is not None else None for bucket, k in self._slots()]
        for bucket, offset in zip(buckets, offsets):
            moved = window.tensor(offset, bucket.buffer.numel(), bucket.buffer.dtype)
            moved.copy_(bucket.buffer)
            bucket.bind(moved)
        if self.as_view:
            for param, old, (bucket, k) in zip(self.params, old_views, self._slots()):
                if old is not None and param.grad is not None and param.grad.data_ptr() == old.data_ptr():
                    param.grad = bucket.views[k]
        self.window = self.strategy.window = window
