"""How a bucket's gradients get into its flat buffer: one at a time, or all in one call.

A gradient that is a view of its bucket (``gradient_as_bucket_view`` after the
first step) needs no copy. Every other gradient is copied in by one of:

- ``EACH``: at its own hook, divided on the way (``mpidp.comm.chunking.divided``:
  the copy and the division in one pass over the memory). A launch per gradient.
- ``FOREACH``: when the bucket's last gradient arrives, every waiting gradient
  in one ``torch._foreach_copy_`` into the bucket's views (made once, with the
  bucket); the strategy then divides the buffer chunk by chunk just before it
  reduces it (the bucket's ``divisor``, ``mpidp.comm.chunking.pieces``). One call
  per bucket: torch's ``batched_grad_copy``.
- ``KERNEL``: as ``FOREACH``, through the CuPy kernel of ``mpidp.kernels`` (one
  launch) when every gradient of the bucket waits and is contiguous; otherwise
  ``_foreach_copy_``.

``choose`` picks one per bucket when a layout is built, from what every rank
knows alike (device, dtype, the gradients' mean size); a rank's choice changes
no collective and no bit of the result, only how the copies are issued.
"""

from __future__ import annotations

import torch

from ..kernels import fused, pack as kernel_pack
from .buckets import Bucket

__all__ = ["EACH", "FOREACH", "KERNEL", "KERNEL_ON_CUDA", "SMALL_BYTES", "choose", "pack"]

EACH, FOREACH, KERNEL = "each", "foreach", "kernel"
# The CuPy kernel for CUDA buckets whose copies it can take. Off: per call it cost more than a
# _foreach_copy_ into views made once, and a GPU step is host-bound (docs/gpu.md, "Packing the
# buckets"); a GPU run of bench/kernel_bench.py --buckets and of bench/train_bench.py's
# mpidp:pack=2 rows decides again.
KERNEL_ON_CUDA = False
# A CPU bucket whose gradients are this big on average, or smaller, is packed in one call: a
# call per gradient costs more there than the second pass over memory that dividing after a
# batched copy takes, and less above it (docs/gpu.md, "Packing the buckets").
SMALL_BYTES = 32 << 10
# Benchmarks and tests: the packing of every layout built while it is set (None: choose's rule).
FORCE: str | None = None


def choose(device: torch.device, dtype: torch.dtype, mean_bytes: float) -> str:
    """How a bucket of gradients of ``dtype`` on ``device``, ``mean_bytes`` each on average,
    is packed (the same on every rank).

    A CUDA bucket, and a CPU bucket of small gradients (``SMALL_BYTES``), are packed in one
    call when their last gradient arrives; a CPU bucket of bigger ones copies each gradient at
    its hook, in one pass that copies and divides.
    """
    if FORCE is not None:
        return FORCE
    if device.type != "cuda":
        return FOREACH if mean_bytes <= SMALL_BYTES else EACH
    if KERNEL_ON_CUDA and fused([torch.empty(0, dtype=dtype, device=device)],
                                        torch.empty(0, dtype=dtype, device=device)):
        return KERNEL
    return FOREACH


def pack(bucket: Bucket, copies: list[tuple[int, torch.Tensor]]) -> None:
    """Copy each ``(k, gradient)`` of ``copies`` into the bucket's view ``k``, in one call.

    The division is left to the strategy (the caller sets ``bucket.divisor``).
    """
    if not copies:
        return
    with torch.no_grad():
        if (bucket.packing == KERNEL and len(copies) == len(bucket.views)
                and all(grad.is_contiguous() for _, grad in copies)):
            copies.sort(key=lambda pair: pair[0])  # the kernel writes the buffer in order
            flat = bucket.buffer if bucket.shards is None else bucket.buffer[:bucket.shards.numel]
            kernel_pack([grad for _, grad in copies], flat)
            return
        torch._foreach_copy_([bucket.views[k] for k, _ in copies], [grad for _, grad in copies])
