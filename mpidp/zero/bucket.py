"""A ``ZeroRedundancyOptimizer`` bucket: parameters laid end to end in one flat buffer.

The parameters become views into the buffer (torch's
``parameters_as_bucket_view``), so the allgather after a step writes the
updated values where the model reads them, with no copy. Each rank steps only
its pieces of the buffer (``mpidp.ddp.buckets.Shards`` says which).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mpi4py import MPI

from .. import comm as _comm
from ..ddp.buckets import Shards

__all__ = ["Bucket"]


class Bucket:
    """Parameters laid end to end in one flat buffer, and this rank's pieces of it.

    Args:
        members: the parameters' indices in the optimizer's parameter list.
        params: those parameters; each becomes a view into ``flat``.
        shards: which elements of ``flat`` each rank owns.
        rank: this rank.
        sharded: the gradients come reduce-scattered from the DDP (stage 2).
    """

    def __init__(self, members: list[int], params: Sequence[torch.Tensor], shards: Shards,
                 rank: int, sharded: bool):
        self.members = members  # indices into the optimizer's parameter list
        self.shards = shards
        self.sharded = sharded  # gradients come reduce-scattered from the DDP (stage 2)
        self.grad: torch.Tensor | None = None  # stage 2: this rank's gradient shard
        self.clean = True  # grad holds nothing to accumulate onto
        self.scratch: torch.Tensor | None = None
        first = params[0]
        self.flat = torch.zeros(shards.padded, dtype=first.dtype, device=first.device)
        self.views, offset = [], 0
        with torch.no_grad():
            for param in params:
                view = self.flat[offset:offset + param.numel()].view(param.shape)
                view.copy_(param)
                param.data = view
                self.views.append(view)
                offset += param.numel()
        offsets = [sum(p.numel() for p in params[:k]) for k in range(len(params))]
        # (member, start, stop, position in the shard, the piece: a view of flat)
        self.pieces = [(members[k], start, stop, position,
                        self.flat[offsets[k] + start:offsets[k] + stop])
                       for k, start, stop, position in shards.pieces(rank, [p.numel() for p in params])]

    def gather(self, comm: MPI.Intracomm, rank: int) -> None:
        """Bring every rank's updated blocks into ``flat`` (in place, chunk by chunk; collective)."""
        for (start, stop), (low, high, _) in zip(self.shards.chunks, self.shards.blocks(rank)):
            _comm.allgather(self.flat[start:stop], self.flat[low:high], comm=comm)

