"""Where each gradient goes: the reducer's bucket layout, rebuilt once and moved into shared memory.

``BucketLayout`` decides and builds the buckets of a ``mpidp.ddp.reducer.Reducer``:
which parameters share one (``mpidp.ddp.buckets.assign_buckets``), each
parameter's slot, how each bucket is packed (``mpidp.ddp.packing``), the one
rebuild in rank 0's observed gradient order (torch's bucket rebuild), and the
move of the CPU buckets into one mapping the node's ranks share
(``mpidp.comm.shm``). The reducer holds one and reads the slots from every
gradient hook; ``hvd.DistributedOptimizer`` holds one too (its own groups, no
rebuild, shared once its check across ranks passed).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from mpi4py import MPI

from .. import comm as _comm
from ..comm import shm as _shm
from . import overlap as _overlap
from . import packing as _packing
from .buckets import Bucket, assign_buckets

__all__ = ["BucketLayout"]


class BucketLayout:
    """The buckets of a reducer's parameters and each parameter's slot in them.

    Args:
        params: the reducer's parameters, in its order.
        dense: indices of the parameters with dense gradients (the others are never bucketed).
        cap_bytes: bucket capacity.
        first_cap_bytes: capacity of the first bucket of each dtype.
        solo_bytes: gradients at least this big get a bucket of their own (None: never).
        make_bucket: ``make_bucket(members, solo)`` builds the bucket of ``members``
            (indices into ``params``); the reducer's, which a subclass may change.
        as_view: ``.grad`` is a view into its bucket (``gradient_as_bucket_view``).
        control: the communicator over which a rebuild's order is broadcast (None: never
            rebuilt).
        strategy: the overlap strategy, told the shared-memory window (None: never shared).
        node: the node's shared memory (``mpidp.comm.shm.Node``) each layout's CPU buckets
            move into as it is built, or None: no window (``share`` may still give one).
    """

    def __init__(self, params: Sequence[torch.Tensor], dense: Sequence[int], *, cap_bytes: int,
                 first_cap_bytes: int, solo_bytes: int | None,
                 make_bucket: Callable[[list[int], bool], Bucket], as_view: bool,
                 control: MPI.Intracomm | None, strategy: _overlap._Strategy | None,
                 node: _shm.Node | None):
        self.params = params
        self.dense = list(dense)
        self.caps = (cap_bytes, first_cap_bytes)
        self.solo_bytes = solo_bytes
        self.make_bucket = make_bucket
        self.as_view = as_view
        self.control = control
        self.strategy = strategy
        self.node = node
        self.window: _shm.Window | None = None  # the mapping the CPU buckets live in
        self.members: list[list[int]] = []  # per bucket, its parameters' indices
        self.buckets: list[Bucket] = []
        self.position: dict[int, int] = {}  # id(bucket) -> its index in buckets
        # (bucket, position in it) of each parameter; None: sparse, never bucketed
        self.slot: list[tuple[Bucket, int] | None] = []

    def assign(self, order: list[int] | None = None) -> list[list[int]]:
        """The members of each bucket, filled in ``order`` (None: reverse registration order)."""
        dense, params = self.dense, self.params
        position = {index: k for k, index in enumerate(dense)}
        if order is not None:
            order = [position[i] for i in order if i in position]
        local = assign_buckets([params[i].numel() * params[i].element_size() for i in dense],
                               [(params[i].dtype, params[i].device) for i in dense],
                               *self.caps, order=order, solo_bytes=self.solo_bytes)
        return [[dense[k] for k in members] for members in local]

    def _is_solo(self, members: list[int]) -> bool:
        param = self.params[members[0]]
        return (len(members) == 1 and self.solo_bytes is not None
                and param.numel() * param.element_size() >= self.solo_bytes)

    def build(self, members: list[list[int]]) -> None:
        """Make the buckets of ``members`` and the slots (collective with shared memory)."""
        self.members = members
        self.buckets = [self.make_bucket(indices, self._is_solo(indices)) for indices in members]
        for bucket, indices in zip(self.buckets, members):
            first = self.params[indices[0]]
            mean = sum(self.params[i].numel() for i in indices) * first.element_size() / len(indices)
            bucket.packing = _packing.choose(first.device, first.dtype, mean)
        self.position = {id(bucket): k for k, bucket in enumerate(self.buckets)}
        self.slot = [None] * len(self.params)
        for bucket, indices in zip(self.buckets, members):
            for k, index in enumerate(indices):
                self.slot[index] = (bucket, k)
        if self.node is not None:
            self.share(self.node)

    def _slots(self):
        return ((slot if slot is not None else (None, None)) for slot in self.slot)

    def rebuild(self, arrival: list[int]) -> None:
        """Lay the buckets out again in rank 0's ``arrival`` order (collective).

        A gradient that was a view into its old bucket becomes one into its new bucket.
        """
        arrived = set(arrival)
        order = arrival + [i for i in reversed(range(len(self.params))) if i not in arrived]
        shared = torch.tensor(order, dtype=torch.int64)
        _comm.broadcast(shared, 0, comm=self.control)
        members = self.assign(shared.tolist())
        if members == self.members:
            return
        old_views = [bucket.views[k] if bucket is not None else None for bucket, k in self._slots()]
        self.build(members)
        if self.as_view:
            for param, old, (bucket, k) in zip(self.params, old_views, self._slots()):
                new = bucket.views[k] if bucket is not None else None
                if old is None or new is None:
                    continue
                if param.grad is not None and param.grad.data_ptr() == old.data_ptr():
                    new.copy_(old)
                    param.grad = new

    def share(self, node: _shm.Node) -> None:
        """Move the CPU buckets into one mapping of ``node`` (collective over its ranks),
        and each later layout's as it is built.

        Every rank has the same layout here, so the same buckets and sizes (a caller
        that cannot know it checks first: ``hvd.DistributedOptimizer``). A gradient that
        is a bucket view follows its bucket. If any rank cannot allocate, every rank
        keeps its buckets and reduces with MPI from now on. The previous layout's
        mapping goes with the last tensor on it.
        """
        self.node = node
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
            self.node = self.window = self.strategy.window = None
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
