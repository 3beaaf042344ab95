"""Grouping of parameters into gradient buckets, the bucket itself, and the order buckets start in."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence

import torch

__all__ = ["assign_buckets", "Bucket", "LaunchOrder", "Shards"]


def assign_buckets(sizes: Sequence[int], keys: Sequence[Hashable], cap_bytes: int,
                   first_cap_bytes: int, order: Sequence[int] | None = None,
                   solo_bytes: int | None = None) -> list[list[int]]:
    """Group parameter indices into buckets, in the order their gradients are expected.

    Without ``order``, gradients are assumed to arrive in reverse registration
    order, which the backward pass roughly follows, so the first bucket becomes
    ready earliest. A bucket holds one key (dtype and device) and closes once it
    reaches its cap, so it may exceed the cap by one tensor; the first bucket of
    each key uses the smaller ``first_cap_bytes`` so that communication starts
    early, as torch DDP does.

    Args:
        sizes: bytes of each parameter, in registration order.
        keys: the (dtype, device) of each parameter.
        cap_bytes: bucket capacity in bytes (> 0).
        first_cap_bytes: capacity of each key's first bucket (> 0).
        order: every index once, in expected gradient arrival order
            (default: reverse registration order).
        solo_bytes: parameters at least this big get a bucket of their own
            (fusing them saves no latency, and copying them costs bandwidth).

    Returns:
        Buckets as lists of parameter indices in arrival order, the buckets
        ordered by the arrival of their first member.
    """
    if len(sizes) != len(keys):
        raise ValueError(f"sizes and keys must have the same length, got {len(sizes)} and {len(keys)}")
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be > 0, got {cap_bytes} and {first_cap_bytes}")
    order = list(reversed(range(len(sizes)))) if order is None else list(order)
    if sorted(order) != list(range(len(sizes))):
        raise ValueError(f"order must hold every index from 0 to {len(sizes) - 1} once, got {order}")
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    closed_count: dict[Hashable, int] = {}
    buckets: list[list[int]] = []
    for index in order:
        key = keys[index]
        if solo_bytes is not None and sizes[index] >= solo_bytes:
            # Close the open bucket of this key first: a bucket must hold
            # neighbours in arrival order, or it is ready only when its last
            # member arrives and every bucket after it waits that long.
            if key in open_buckets:
                buckets.append(open_buckets.pop(key)[0])
                closed_count[key] = closed_count.get(key, 0) + 1
            buckets.append([index])
            continue
        members, filled = open_buckets.get(key, ([], 0))
        members.append(index)
        filled += sizes[index]
        cap = first_cap_bytes if closed_count.get(key, 0) == 0 else cap_bytes
        if filled >= cap:
            buckets.append(members)
            closed_count[key] = closed_count.get(key, 0) + 1
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (members, filled)
    buckets.extend(members for members, _ in open_buckets.values())
    position = {index: k for k, index in enumerate(order)}
    buckets.sort(key=lambda members: position[members[0]])
    return buckets


class LaunchOrder:
    """Which buckets of one reduction may start: each once full, strictly in bucket order.

    A bucket full early waits for the ones before it, so every rank starts the same
    collectives in the same order whatever order its gradient hooks fire in
    (mpidp DDP's reducer and ``hvd.DistributedOptimizer`` both start theirs so).

    Args:
        members: the parameters (or any items) of each bucket, in bucket order.
    """

    __slots__ = ("pending", "next")

    def __init__(self, members: Sequence[Sequence]):
        self.pending = [len(items) for items in members]  # per bucket, the items still to come
        self.next = 0  # the next bucket to start

    def arrived(self, position: int) -> bool:
        """Count one item of bucket ``position`` in; whether that bucket is full now."""
        self.pending[position] -= 1
        return self.pending[position] == 0

    def startable(self, *, all_left: bool = False) -> Iterator[int]:
        """The positions of the buckets to start now, in order, each given once.

        Args:
            all_left: every bucket not started yet, full or not (the end of a reduction).
        """
        while self.next < len(self.pending) and (all_left or self.pending[self.next] == 0):
            self.next += 1
            yield self.next - 1


class Bucket:
    """A flat gradient buffer shared by several parameters.

    A ``solo`` bucket holds one parameter and no buffer of its own: its
    gradient is reduced in place, and ``buffer`` is set each step to the
    tensor being reduced.

    Args:
        params: the bucket's parameters, all of one dtype and device.
        solo: reduce the single parameter's gradient in place.
    """

    def __init__(self, params: Sequence[torch.Tensor], solo: bool = False,
                 shards: "Shards | None" = None):
        if solo and len(params) != 1:
            raise ValueError(f"a solo bucket holds one parameter, got {len(params)}")
        self.solo = solo
        self.divisor = 1  # what the strategy still divides the buffer by
        self.packing = "each"  # how its gradients are copied in (mpidp.ddp.packing.choose)
        self.spare: torch.Tensor | None = None
        self.shards = shards
        self.shapes = [p.shape for p in params]
        if solo or shards is not None:
            self.buffer = None
            self.views = [None] * len(params)
            return
        self.bind(torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                              device=params[0].device))

    def bind(self, buffer: torch.Tensor) -> None:
        """Make ``buffer`` (at least as long as the bucket) the bucket's flat buffer."""
        if self.shards is not None:
            buffer = buffer[:self.shards.padded]
            buffer[self.shards.numel:].zero_()  # the padding is reduced too
        self.buffer = buffer
        self.views = []
        offset = 0
        for shape in self.shapes:
            numel = shape.numel()
            self.views.append(buffer[offset:offset + numel].view(shape))
            offset += numel

    def unbind(self) -> torch.Tensor:
        """Detach and return the flat buffer of a sharded bucket (for reuse by another)."""
        buffer, self.buffer = self.buffer, None
        self.views = [None] * len(self.shapes)
        return buffer


class Shards:
    """How a flat buffer of ``numel`` elements is divided among ``world`` ranks, chunk by chunk.

    The buffer is padded with zeros to a multiple of ``world`` and cut into
    chunks of ``world * block`` elements (the last one shorter, still a
    multiple of ``world``), ``block`` being ``chunk_elems // world``. Rank ``r``
    owns the ``r``-th block of every chunk: a reduce-scatter of each chunk
    leaves every rank its blocks, and an in-place allgather of each chunk
    brings everyone's back. Both move data one chunk at a time, which keeps a
    message in the cache (see ``mpidp.ddp.overlap`` on chunking), and every rank
    owns ``padded / world`` elements, whatever the tensor sizes.

    Args:
        numel: elements in the buffer (the sum of its tensors' sizes).
        world: number of ranks.
        chunk_elems: elements per chunk before rounding down to a multiple of
            ``world`` (at least ``world``).
    """

    def __init__(self, numel: int, world: int, chunk_elems: int):
        self.numel = numel
        self.world = world
        self.padded = -(-numel // world) * world
        self.shard_numel = self.padded // world
        step = world * max(1, chunk_elems // world)
        self.chunks = [(start, min(start + step, self.padded))
                       for start in range(0, self.padded, step)]

    def blocks(self, rank: int) -> list[tuple[int, int, int]]:
        """``(start, stop, position in the shard)`` of each of ``rank``'s blocks."""
        found, position = [], 0
        for start, stop in self.chunks:
            size = (stop - start) // self.world
            found.append((start + rank * size, start + (rank + 1) * size, position))
            position += size
        return found

    def pieces(self, rank: int, numels: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """The parts of the tensors (sizes ``numels``, laid end to end) that ``rank`` owns.

        Returns:
            ``(tensor, start, stop, position)``: elements ``start:stop`` of the
            flattened tensor number ``tensor`` lie at ``position`` in the shard.
        """
        found, offset = [], 0
        for k, numel in enumerate(numels):
            for start, stop, position in self.blocks(rank):
                low, high = max(start, offset), min(stop, offset + numel)
                if low < high:
                    found.append((k, low - offset, high - offset, position + low - start))
            offset += numel
        return found
