"""The communication-hook contract: ``GradBucket``, a hook's ``state``, and the plain allreduce hook.

torch's contract, shared by ``mpidp.hooks`` and ``mpidp.hooks.powersgd``: ``hook(state,
bucket) -> torch.futures.Future`` of the bucket's reduced flat tensor.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from .. import comm as _comm
from ..comm import chunking as _chunking

__all__ = ["GradBucket", "allreduce_hook", "world_size"]

_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4}


class GradBucket:
    """One bucket as a hook sees it: torch's ``GradBucket`` methods.

    Args:
        index: the bucket's position in the order buckets are reduced.
        buffer: the flat gradients (summed locally, not divided).
        gradients: views of ``buffer``, one per parameter, shaped like it.
        parameters: the parameters, in the same order.
        is_last: whether this is the last bucket of the step.
    """

    __slots__ = ("_index", "_buffer", "_gradients", "_parameters", "_last")

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[torch.Tensor], is_last: bool):
        self._index, self._buffer, self._gradients = index, buffer, gradients
        self._parameters, self._last = parameters, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer


def _done(value: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(value)
    return future


def _comm_of(state):
    """The communicator a hook's ``state`` names (None: COMM_WORLD's default pool)."""
    if state is None or isinstance(state, (MPI.Intracomm, _comm.Pool)):
        return state
    raise TypeError(f"an mpidp hook's state must be None, an mpi4py Intracomm or a "
                    f"mpidp.comm.Pool, got {type(state).__name__}; torch's hooks take a "
                    f"torch.distributed process group of the 'mpidp' backend instead")


def world_size(comm) -> int:
    """The number of ranks of a hook's communicator (None, an Intracomm or a Pool)."""
    return _comm._base(comm).Get_size()


def allreduce_hook(state, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket with MPI's allreduce, chunk by chunk.

    The bits of the DDP without a hook when it reduces through MPI alone
    (``shared_memory=False``, or one rank per node); with shared memory the DDP
    adds in rank order, which an MPI library may not (Open MPI at 3 ranks: one
    float32 rounding apart).
    """
    comm = _comm_of(state)
    buffer = bucket.buffer()
    size = world_size(comm)
    for piece in _chunking.pieces(buffer, _chunking.chunk_bytes(), size):
        _comm.allreduce(piece, "sum", comm=comm)
    return _done(buffer)
