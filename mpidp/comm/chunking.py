"""The sizes every layer shares (buckets and chunks), and one way of cutting a buffer into chunks.

DDP, ZeRO, Horovod's optimizer and the torch.distributed backend take their
sizes from here: ``Sizes.of`` builds, once, from a caller's arguments and the
settings, the frozen ``Sizes`` they use (the bucket cap, the first bucket, the
chunk and the in-place threshold, in bytes); ``chunk_bytes()`` is the chunk
alone (``MPIDP_CHUNK_MB``).

MPI's shared-memory allreduce slows down past a few MiB (its bounce buffers
overflow the caches), so every large reduction mpidp makes goes chunk by
chunk: DDP's buckets under every overlap strategy (``chunk_mb``), the comm
hooks, and the torch.distributed backend's all_reduce (docs/performance-comm.md, "Figures behind the code's choices").

Division by the number of ranks lives here too (``divide``, ``divided``), with
its one rule: mpidp divides before the sum, as torch's DDP and its comm hooks
do (an average of N summands stays in the range of a low-precision dtype where
their sum may not), and a chunk is divided just before it is reduced, while it
is still in cache, never the whole buffer in a separate pass. DDP's buckets
under every strategy (and compiled autograd's gradients), the shared-memory
window, the comm hooks, sparse gradients and the backend's ``premul_sum``
follow it. The listed exceptions divide after the sum because their peers
define them so, and go through ``mean_of_sum`` but where named:

- the ``"avg"`` op of ``mpidp.comm`` (torch's ``ReduceOp.AVG``);
- PowerSGD (``mpidp.hooks.powersgd``): torch's ``powerSGD_hook`` divides the
  uncompressed tensors and Q after their allreduce (P is orthogonalised after
  its sum, so its scale does not matter), and mpidp keeps torch's arithmetic;
- reproducible mode (``mpidp.ddp.reproducible``): the micro-batches' gradients
  are added in one fixed order and the sum divided by their number once, as one
  process computing the mean would;
- Horovod's ``Average`` with its ``postscale_factor`` and its rounding rules
  (``mpidp.horovod.reductions.scale_``, which divides itself), and the sparse
  allreduce's gathered values (``mpidp.horovod.collectives``: Horovod's
  ``values / size``, a new tensor, as an integer tensor needs).

tests/test_rules.py fails on any other division of a tensor by a rank count.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import settings

__all__ = ["BUCKET_CAP_MB", "CHUNK_MB", "DEFAULTS", "FIRST_BUCKET_MB", "INPLACE_MB", "MB", "Sizes",
           "chunk_bytes", "chunk_numel", "divide", "divided", "mean_of_sum", "pieces"]

MB = 1 << 20  # bytes in a MiB, the unit of every size argument
CHUNK_MB: float = settings.get("MPIDP_CHUNK_MB")
BUCKET_CAP_MB = 25.0  # torch DDP's bucket_cap_mb
# torch DDP's first bucket: "Experiments showed 1MB is a reasonable value", and
# a small first bucket lets the first allreduce start early in the backward.
FIRST_BUCKET_MB = 1.0
# A tensor at least this big goes to MPI where it lies; smaller ones are packed
# into one buffer first (DDP's gradients where buckets are copied both ways, the
# broadcasts of a module's or an optimizer's state).
INPLACE_MB = 1.0


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes a DDP, a ZeRO optimizer, Horovod's optimizer or the backend works with, in bytes.

    Attributes:
        bucket_cap: a gradient bucket's capacity.
        first_bucket: the capacity of the first bucket of each dtype (small, so that the
            first reduction starts early in the backward).
        chunk: the most bytes one collective carries; larger buffers go in chunks.
        inplace: tensors at least this big go where they lie, not packed (None: never).
    """

    bucket_cap: int
    first_bucket: int
    chunk: int
    inplace: int | None

    @classmethod
    def of(cls, *, bucket_cap_mb: float | None = None, first_bucket_mb: float | None = None,
           chunk_mb: float | None = None, inplace_mb: float | None = INPLACE_MB) -> Sizes:
        """The sizes from arguments in MiB (checked by the caller); None takes the default.

        The defaults: ``BUCKET_CAP_MB``; ``FIRST_BUCKET_MB`` or the cap if smaller;
        ``MPIDP_CHUNK_MB``; ``inplace_mb`` None is no in-place threshold.
        """
        cap_mb = BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        first_mb = min(FIRST_BUCKET_MB, cap_mb) if first_bucket_mb is None else first_bucket_mb
        return cls(bucket_cap=int(cap_mb * MB), first_bucket=int(first_mb * MB),
                   chunk=chunk_bytes(chunk_mb),
                   inplace=None if inplace_mb is None else int(inplace_mb * MB))


def chunk_bytes(chunk_mb: float | None = None) -> int:
    """The chunk size in bytes: ``chunk_mb``, or ``MPIDP_CHUNK_MB`` (default 4) where None."""
    return max(1, int((CHUNK_MB if chunk_mb is None else chunk_mb) * MB))


DEFAULTS = Sizes.of()  # every size at its default (MPIDP_CHUNK_MB as read at import)


def chunk_numel(nbytes: int, element_size: int) -> int:
    """Elements of ``element_size`` bytes in a chunk of ``nbytes`` (at least one)."""
    return max(1, nbytes // max(1, element_size))


def pieces(buffer: torch.Tensor, nbytes: int, divisor: int = 1):
    """Yield ``buffer`` (flat) in chunks of at most ``nbytes``, each divided by ``divisor`` first.

    The chunks are views: reducing them in place reduces ``buffer``. A buffer
    no larger than one chunk is yielded whole.
    """
    flat = buffer.view(-1)
    count = chunk_numel(nbytes, buffer.element_size())
    for piece in flat.split(count) if flat.numel() > count else (flat,):
        yield divide(piece, divisor)


def divide(tensor: torch.Tensor, divisor: int) -> torch.Tensor:
    """``tensor`` divided by ``divisor`` in place (before its sum: see the module's rule)."""
    return tensor.div_(divisor) if divisor != 1 else tensor


def divided(tensor: torch.Tensor, divisor: int, *, out: torch.Tensor) -> torch.Tensor:
    """``tensor / divisor`` written into ``out``: a gradient's copy into its bucket and its
    division (before the sum) in one pass; returns ``out``."""
    return torch.div(tensor, divisor, out=out)


def mean_of_sum(total: torch.Tensor, count: int) -> torch.Tensor:
    """``total``, a complete sum, divided by ``count`` in place: the listed exceptions' division
    after the sum (see the module's rule); returns it."""
    return total.div_(count) if count != 1 else total
