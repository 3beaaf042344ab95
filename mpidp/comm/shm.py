"""Allreduce on shared memory: bucket buffers in memory the node's ranks share, reduced in place.

Ranks on one node can read each other's memory. When DDP's gradient buckets
live in one shared mapping (a file in /dev/shm, unlinked once mapped), an
allreduce needs no message at all, only MPI barriers:

1. every rank has written its bucket (the gradient hooks' copy, which DDP
   makes anyway); a barrier;
2. local rank ``l`` owns the ``l``-th of ``L`` equal slices of the bucket. It
   sums that slice over the ``L`` ranks' buckets in local-rank order, a block
   that fits the cache at a time, and writes the sum into every rank's
   bucket (across nodes, the owned slice is first allreduced over the ranks
   of the same local rank on the other nodes, with MPI);
3. a barrier: every bucket now holds the sum.

Each rank reads its slice of every bucket and writes its slice of every
bucket: 2S bytes per rank for an S-byte bucket, which is the least an
allreduce can move through memory. MPICH's own shared-memory allreduce copies
the data through its cells several times (the figures: docs/performance-comm.md,
"Figures behind the code's choices"). Every rank gets the same bits, since one rank
computes each sum.

``mpidp.DistributedDataParallel`` puts its CPU buckets there when
``shared_memory`` allows it (see ``Node.usable``), at the end of the first
synced step, once the bucket layout is final. The memory goes when the last
tensor on it does.
"""

from __future__ import annotations

import mmap
import os
import secrets

import torch
from mpi4py import MPI

from .. import communicators as _communicators
from .. import settings
from . import chunking as _chunking
from . import agreement as _agreement
from . import handle as _handle

__all__ = ["Node", "Window", "node_of", "window_bytes"]

_ALIGN = 64  # bytes: each bucket starts on a cache line
_LINE = 16  # elements: owned slices start on a multiple of this (no false sharing)
_BLOCK_BYTES = 256 << 10  # a block summed at a time: fits L2 with its sources
_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # summed in float32


def window_bytes(nbytes: int, local_size: int) -> int:
    """The bytes of /dev/shm one window of ``nbytes`` per local rank takes (``Node.allocate``)."""
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN) * local_size


_WORLD_NODES: dict[int, "Node"] = {}  # MPIDP_SHM_NODE_SIZE -> COMM_WORLD's grouping, kept


def node_of(comm: MPI.Intracomm) -> "Node":
    """A Node of ``comm`` that belongs to the caller alone (collective; the caller frees it).

    Rule: a Node's two communicators carry the barriers and cross-node sums of
    one owner (one DDP, reduced by one thread at a time). Two DDPs reducing in
    the same backward from two threads (``overlap="thread"``) must never share
    them, or one DDP's barrier matches the other's on a peer and a rank sums a
    slice its peer has not written yet. COMM_WORLD's grouping (the ``Split``,
    which needs an allgather) is made once per process and kept; each owner
    gets duplicates of it, which is cheaper than grouping again.
    """
    if comm != MPI.COMM_WORLD:
        return Node(comm)
    forced = _forced_node_size()
    if forced not in _WORLD_NODES:
        kept = _WORLD_NODES[forced] = Node(comm)
        for member in (kept.node, kept.cross):
            _communicators.set_rebuild(member, _forget_world_nodes)
    return _WORLD_NODES[forced].duplicate()


def _forget_world_nodes(_world) -> None:
    """After a heal (``mpidp.healing``): COMM_WORLD's grouping is of no use to the survivors."""
    for kept in _WORLD_NODES.values():
        _communicators.release(kept.node)
        _communicators.release(kept.cross)
    _WORLD_NODES.clear()


def _forced_node_size() -> int:
    """``MPIDP_SHM_NODE_SIZE``: ranks per pretended node (tests), 0 for the real nodes."""
    return settings.get("MPIDP_SHM_NODE_SIZE")


def _usable(sizes: list[int]) -> tuple[bool, str]:
    """Whether shared memory serves nodes of these sizes (every node's), and why not."""
    if len(set(sizes)) > 1:
        return False, f"nodes hold different numbers of ranks ({sorted(set(sizes))})"
    return (True, "") if sizes[0] > 1 else (False, "one rank per node")


class Node:
    """A communicator's ranks grouped by node, if every node holds as many of them.

    Collective over ``comm``. ``node`` is this node's ranks (they share memory),
    ``cross`` the ranks of the same local rank on every node; ``usable`` is
    False (on every rank) when the nodes hold different numbers of ranks or
    each holds one. ``MPIDP_SHM_NODE_SIZE=k`` (tests) groups consecutive
    ranks by ``k`` instead of by node; they must still share a machine.
    """

    def __init__(self, comm: MPI.Intracomm):
        forced = _forced_node_size()
        if forced > 0:
            self.node = comm.Split(comm.Get_rank() // forced, comm.Get_rank())
        else:
            self.node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        _communicators.made(self.node, "shared-memory reduction: the node's ranks")
        _, (self.usable, self.reason) = _agreement.judged(
            comm, self.node.Get_size(), _usable, "shared-memory node sizes (allgather)")
        self.local_rank, self.local_size = self.node.Get_rank(), self.node.Get_size()
        self.cross = _communicators.made(comm.Split(self.local_rank, comm.Get_rank()),
                                         "shared-memory reduction: across nodes")

    def duplicate(self) -> "Node":
        """The same grouping on fresh communicators (collective over the grouped ranks)."""
        twin = Node.__new__(Node)
        twin.__dict__.update(self.__dict__)
        twin.node = _communicators.made(self.node.Dup(),
                                        "shared-memory reduction: the node's ranks")
        twin.cross = _communicators.made(self.cross.Dup(), "shared-memory reduction: across nodes")
        return twin

    def allocate(self, nbytes: int) -> "Window | None":
        """A segment of ``nbytes`` per local rank, all in one shared mapping (collective).

        Local rank 0 creates a file in /dev/shm (``_create``: a random name,
        created exclusively, owner-only) and maps it; the other local ranks map
        it after checking it is that very file; once all have, the file is
        unlinked, so the memory goes when the last mapping does (no explicit
        free, nothing left behind by a crash, and a tensor that outlives the
        DDP keeps its memory). None on every rank if any rank could not map it.
        """
        size = window_bytes(nbytes, self.local_size)
        seg = size // self.local_size
        name = identity = mapping = None
        if self.local_rank == 0:
            name, identity, mapping = _create(size)
        # after the creation: the others open only the very file local rank 0 made
        name, identity = _handle.collective(self.node, "bcast", ((name, identity), 0),
                                            "shared-memory window name (broadcast)")
        if self.local_rank != 0 and identity is not None:
            mapping = _open(name, size, identity)
        # the agreement, node by node and then across the nodes: every rank the same verdict
        failed = _agreement.any_failed(self.node, mapping is None,
                                       "shared-memory window check (allreduce)")
        ok = not _agreement.any_failed(self.cross, failed, "shared-memory window check (allreduce)")
        if self.local_rank == 0 and name is not None:
            try:
                os.unlink(name)  # every local rank has mapped it or given up: the name may go
            except OSError:
                pass
        if not ok:
            return None
        return Window(mapping, seg, self)

    def free(self) -> None:
        """Release the two communicators (collective), once no window of this node reduces."""
        _communicators.free(self.node)
        _communicators.free(self.cross)


_OPEN_FLAGS = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _create(size: int) -> tuple[str | None, tuple | None, mmap.mmap | None]:
    """Local rank 0: a new file in /dev/shm, mapped: (name, (device, inode), mapping), or Nones.

    The name is unpredictable (128 random bits) and the file created
    exclusively, readable and writable by this user alone: another user of the
    node can neither guess it nor hand the ranks a file of their own, which
    would let them read and write the gradients.
    """
    name = f"/dev/shm/mpidp-{secrets.token_hex(16)}"
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
    except OSError:
        return None, None, None
    try:
        os.ftruncate(fd, size)
        found = os.fstat(fd)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return name, (found.st_dev, found.st_ino), mapping
    except (OSError, ValueError):
        os.unlink(name)
        return None, None, None
    finally:
        os.close(fd)


def _open(name: str, size: int, identity: tuple) -> mmap.mmap | None:
    """The other local ranks: map ``name`` if it is still local rank 0's file, else None."""
    try:
        fd = os.open(name, _OPEN_FLAGS)
    except OSError:
        return None
    try:
        found = os.fstat(fd)
        if (found.st_dev, found.st_ino) != identity or found.st_uid != os.getuid():
            return None
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


class Window:
    """One shared mapping: each local rank's segment, and in-place allreduce of regions of it."""

    def __init__(self, mapping: mmap.mmap, segment_bytes: int, node: Node):
        self.node = node
        whole = memoryview(mapping)
        self.segments = [whole[rank * segment_bytes:(rank + 1) * segment_bytes]
                         for rank in range(node.local_size)]
        self._base = self.tensor(0, 1, torch.uint8).data_ptr()
        self._length = segment_bytes
        self._regions: dict[tuple, list[torch.Tensor]] = {}  # (offset, numel, dtype) -> peers
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's ``numel`` elements of ``dtype`` at byte ``offset`` of its segment."""
        return self._view(self.node.local_rank, offset, numel, dtype)

    def _view(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(self.segments[rank], dtype=dtype, count=numel, offset=offset)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in this rank's segment (a CPU tensor, contiguous)."""
        return (not tensor.is_cuda and tensor.is_contiguous()
                and self._base <= tensor.data_ptr() < self._base + self._length)

    def _peers(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        offset = tensor.data_ptr() - self._base
        key = (offset, tensor.numel(), tensor.dtype)
        if key not in self._regions:
            self._regions[key] = [self._view(rank, offset, tensor.numel(), tensor.dtype)
                                  for rank in range(self.node.local_size)]
        return self._regions[key]

    def _fence(self, label) -> None:
        # The barrier orders memory as well as time. The MPI standard promises that
        # only for windows from MPI_Win_allocate_shared (with MPI_Win_sync); this
        # mapping is plain mmap memory because its lifetime must follow the tensors
        # on it (gradients that are bucket views outlive a DDP), while a window is
        # freed collectively. It relies on what MPICH, Open MPI and Intel MPI do:
        # their shared-memory barriers publish arrival with release atomics and
        # wait with acquire ones, so writes before the barrier are seen after it.
        _handle.collective(self.node.node, "Barrier", (), label)

    def allreduce(self, tensor: torch.Tensor, divisor: int = 1) -> None:
        """Sum ``tensor`` (a region of this window) over all ranks, in place; divided first if asked.

        Collective over the node's ranks (and the ``cross`` ranks), each passing
        the same region of its own segment.
        """
        _chunking.divide(tensor, divisor)
        peers = self._peers(tensor)
        numel, size, rank = tensor.numel(), self.node.local_size, self.node.local_rank
        label = ("shared-memory allreduce", tensor, "op", "sum")
        self._fence(label)  # every rank's gradients are in
        lo = numel * rank // size // _LINE * _LINE
        hi = numel if rank == size - 1 else numel * (rank + 1) // size // _LINE * _LINE
        wide = _WIDE.get(tensor.dtype, tensor.dtype)
        scratch = self._scratch.get(wide)
        block = max(_LINE, _BLOCK_BYTES // tensor.element_size())
        if scratch is None:
            scratch = self._scratch[wide] = torch.empty(block, dtype=wide)
        across = self.node.cross.Get_size() > 1
        with torch.no_grad():
            for start in range(lo, hi, block):
                stop = min(start + block, hi)
                total = scratch[:stop - start]
                if wide is tensor.dtype:
                    torch.add(peers[0][start:stop], peers[1][start:stop], out=total)
                else:
                    total.copy_(peers[0][start:stop]).add_(peers[1][start:stop])
                for peer in peers[2:]:
                    total.add_(peer[start:stop])
                if across:  # this node's sum into its own slice; the nodes' sum comes below
                    peers[rank][start:stop].copy_(total)
                else:
                    for peer in peers:
                        peer[start:stop].copy_(total)
            if across and hi > lo:
                mine = peers[rank][lo:hi]
                if wide is tensor.dtype:
                    self._across(mine)
                else:  # the nodes' sum in float32 too, rounded once
                    wider = mine.to(wide)
                    self._across(wider)
                    mine.copy_(wider)
                for q, peer in enumerate(peers):
                    if q != rank:
                        peer[lo:hi].copy_(mine)
        self._fence(label)  # every rank's bucket holds the sum

    def _across(self, tensor: torch.Tensor) -> None:
        from .. import comm as _comm
        _comm.allreduce(tensor, "sum", comm=self.node.cross)
