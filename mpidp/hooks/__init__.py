"""Communication hooks for ``mpidp.DistributedDataParallel.register_comm_hook``.

torch's contract: ``hook(state, bucket) -> torch.futures.Future`` whose value
is the bucket's reduced flat tensor; the DDP calls it once per bucket, in
bucket order, on every rank, with the bucket's gradients summed locally but
not yet divided by the world size (the hook averages). ``bucket`` is a
``GradBucket`` with torch's methods.

The hooks here need nothing but mpidp. Their ``state`` is the communicator to
reduce over: None (``MPI.COMM_WORLD``'s default pool of duplicates), an mpi4py
``Intracomm``, or a ``mpidp.comm.Pool`` (``ddp.pool``, the DDP's own); the
PowerSGD hook takes a ``PowerSGDState`` holding one. torch's own hooks
(``torch.distributed.algorithms.ddp_comm_hooks``) run unchanged too, with a
process group of the ``"mpidp"`` backend as their state.

| hook                   | bytes sent       | how the sum is formed                                  |
|------------------------|------------------|--------------------------------------------------------|
| ``allreduce_hook``     | the bucket's     | MPI's allreduce, in chunks (what DDP does without one) |
| ``fp16_compress_hook`` | half             | see ``compressed_allreduce``: float32 accumulation     |
| ``bf16_compress_hook`` | half             | the same, in bfloat16                                  |
| ``powerSGD_hook``      | (n + m) r per    | torch's PowerSGD: low-rank P and Q allreduced,         |
|                        | n x m matrix     | error feedback, warm start                             |
"""

from __future__ import annotations

import threading

import torch

from ..comm import agreement as _agreement
from .. import comm as _comm
from ..comm import chunking as _chunking
from ..comm import progress as _engine
from .basics import _DTYPE_CODES, GradBucket, _comm_of, _done, allreduce_hook, world_size
from .powersgd import PowerSGDState, powerSGD_hook

__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "compressed_allreduce", "PowerSGDState", "powerSGD_hook"]



def compressed_allreduce(buffer: torch.Tensor, dtype: torch.dtype, comm=None) -> torch.Tensor:
    """Average ``buffer`` across the ranks sending it as ``dtype``; the result lands in ``buffer``.

    Each rank divides by the world size N and rounds to ``dtype``. An alltoall
    gives every rank the N compressed copies of its 1/N of the elements. The
    rank sums them in float32, in rank order, and rounds the sum once to
    ``dtype``. An allgather of the rounded sums follows, and the result is
    decompressed into ``buffer``. The bytes on the wire are those of a
    reduce-scatter plus an allgather in ``dtype``, half of an exact float32
    allreduce. The only roundings are the compression of each rank's
    contribution and of the sum, never of a partial sum. (MPI has no
    float16/bfloat16 sum of its own, and a pairwise reduction in ``dtype``
    would round every partial sum.) Every rank receives the same bits.

    The buffer goes in chunks of ``MPIDP_CHUNK_MB`` (``mpidp.comm.chunking``),
    pipelined: chunk k is divided and rounded while it is still in cache, and
    while chunk k-1's alltoall and chunk k-2's allgather are in flight (each
    local step tests them, which drives MPI's progress). Every rank cuts the
    same chunks from the buffer's size, the world size and the chunk size
    (facts all ranks share), and issues, chunk by chunk, alltoall k then
    allgather k-1, so the nonblocking collectives match in one order. The
    results do not depend on the chunking: each element goes through the same
    roundings and sums. The work buffers (two 16-bit copies of the bucket,
    and beyond 2 ranks two float32 blocks) are kept per thread for the next
    call, grown to the largest bucket seen.

    Before any data moves, one small allreduce checks that every rank's
    buffer is usable (a contiguous floating tensor that needs no grad) and
    that all ranks cut the same chunks for the same wire format; otherwise
    every rank raises the same ``ValueError``, naming what each rank passed.
    """
    size = world_size(comm)
    problem = _buffer_problem(buffer, dtype)
    numel = step = 0
    if problem is None:
        numel = buffer.numel()
        step = max(1, _chunking.chunk_numel(_chunking.chunk_bytes(), buffer.element_size()) // size) * size
        step = min(step, max(size, -(-numel // size) * size))  # one chunk: one cut, any size
    if size > 1 or problem is not None:
        _check_same_chunks(comm, numel, step, buffer, dtype, problem)
    if numel == 0:
        return buffer
    with torch.no_grad():
        return _compressed_pipeline(buffer, dtype, comm, size, numel, step)


def _compressed_pipeline(buffer: torch.Tensor, dtype: torch.dtype, comm, size: int, numel: int,
                         step: int) -> torch.Tensor:
    flat = buffer.view(-1)
    compressed, received, *floats = _workspace(numel, size, step, dtype, buffer.device)
    if size == 1:
        _chunking.divide(flat, size)
        compressed.copy_(flat)
        flat.copy_(compressed)
        return buffer
    rank = _comm._base(comm).Get_rank()
    spans = [(at, min(at + step, numel)) for at in range(0, numel, step)]
    sent: list = [None] * len(spans)  # chunk k's alltoall, then its allgather
    gathered: list = [None] * len(spans)

    def poll() -> None:  # the engine drives the transfers in flight while this rank computes
        _engine.test_all([handle for handle in sent + gathered if handle is not None])

    def padded(k: int) -> slice:  # chunk k and the zeros that make it N equal blocks
        at, stop = spans[k]
        return slice(at, at + -(-(stop - at) // size) * size)

    def pack(k: int) -> None:  # divide chunk k (in place: it is overwritten anyway), round it
        at, stop = spans[k]
        piece = flat[at:stop]
        _chunking.divide(piece, size)
        poll()
        compressed[at:stop].copy_(piece)  # the one rounding of this rank's part
        sent[k] = _comm.ialltoall(received[padded(k)], compressed[padded(k)], comm=comm)

    def reduce(k: int) -> None:  # sum chunk k's parts of this rank, in rank order; gather
        _engine.wait(sent[k])
        sent[k] = None
        span = padded(k)
        block = (span.stop - span.start) // size
        parts = received[span].view(size, block)
        mine = compressed[span.start + rank * block:span.start + (rank + 1) * block]
        if size == 2:
            torch.add(parts[0], parts[1], out=mine)  # computed in float32, rounded once
        else:
            total, scratch = floats[0][:block], floats[1][:block]
            total.copy_(parts[0])
            for part in parts[1:]:
                scratch.copy_(part)
                total.add_(scratch)
                poll()
            mine.copy_(total)  # the one rounding of the sum
        gathered[k] = _comm.iallgather(compressed[span], mine, comm=comm)

    def unpack(k: int) -> None:
        at, stop = spans[k]
        _engine.wait(gathered[k])
        gathered[k] = None
        flat[at:stop].copy_(compressed[at:stop])

    for k in range(len(spans) + 2):
        if k < len(spans):
            pack(k)
        if 1 <= k <= len(spans):
            reduce(k - 1)
        if k >= 2:
            unpack(k - 2)
    return buffer


def _buffer_problem(buffer, wire) -> str | None:
    """What makes ``buffer`` unusable on this rank (None: nothing), before any rank communicates."""
    if not isinstance(buffer, torch.Tensor):
        return f"buffer must be a torch.Tensor, got {type(buffer).__name__}"
    if _DTYPE_CODES.get(buffer.dtype) is None:
        return f"buffer must be float16, bfloat16, float32 or float64, got {buffer.dtype}"
    if _DTYPE_CODES.get(wire) is None:
        return f"dtype (the wire format) must be float16, bfloat16, float32 or float64, got {wire}"
    if buffer.device.type not in ("cpu", "cuda"):
        return f"buffer must be on the CPU or a CUDA device, got {buffer.device}"
    if not buffer.is_contiguous():
        return (f"buffer must be contiguous (its result is written in place), got shape "
                f"{tuple(buffer.shape)} with strides {buffer.stride()}")
    if buffer.requires_grad:
        return "buffer requires grad; pass buffer.detach()"
    if buffer.is_inference() and not torch.is_inference_mode_enabled():
        return "buffer is an inference tensor, which can be written only inside inference_mode()"
    return None


def _check_same_chunks(comm, numel: int, step: int, buffer, wire, problem: str | None) -> None:
    """Raise the same ValueError on every rank unless all can go and cut the same chunks.

    The pipeline issues one alltoall and one allgather per chunk: a buffer
    size, dtype or ``MPIDP_CHUNK_MB`` that differs across ranks would match
    one rank's collectives with another's (a hang or wrong bits), fp16
    against bf16 would read one format as the other, and a rank whose buffer
    cannot be used (``_buffer_problem``) would leave the others waiting.
    """
    codes = [_DTYPE_CODES.get(getattr(buffer, "dtype", None), 0), _DTYPE_CODES.get(wire, 0)]

    def describe() -> str:
        if problem is not None:
            return problem
        names = {code: str(name).removeprefix("torch.") for name, code in _DTYPE_CODES.items()}
        return f"{numel} elements of {names[codes[0]]} sent as {names[codes[1]]} in chunks of {step}"

    _agreement.agree_facts(comm, [numel, step, *codes], problem is not None, describe,
           "compressed_allreduce: every rank must pass a usable buffer of the same size and "
           "dtype, compress to the same dtype and use the same MPIDP_CHUNK_MB; got",
           "compressed_allreduce's check of sizes")


# Reused between calls: fresh big buffers every step would cost a page fault
# per 4 KiB (the allocator returns them to the system). One set per thread,
# world size, wire dtype and device, grown to the largest bucket seen and
# sliced for smaller ones, so a DDP's buckets share it (a call finishes all
# its transfers before it returns). Rule: one set per thread. Two threads may
# compress at once (two DDPs stepping in two threads, each on its own
# communicator); shared buffers mixed their results (tests/mpi/check_hooks.py,
# two threads). Made outside inference mode, so that a first call inside it
# does not leave later calls with tensors they may not write.
_THREAD = threading.local()


def _workspace(numel: int, size: int, step: int, dtype: torch.dtype, device: torch.device):
    """16-bit send and receive buffers of ``numel`` rounded up to N blocks; float32 blocks."""
    workspaces = getattr(_THREAD, "workspaces", None)
    if workspaces is None:
        workspaces = _THREAD.workspaces = {}
    key = (size, dtype, device)
    padded = -(-numel // size) * size  # only the last chunk is short of N equal blocks
    block = step // size if size > 2 else 0
    have = workspaces.get(key)
    if have is None or have[0].numel() < padded or have[2].numel() < block:
        with torch.inference_mode(False):
            capacity = max(padded, have[0].numel() if have else 0)
            blocks = max(block, have[2].numel() if have else 0)
            have = workspaces[key] = (
                torch.empty(capacity, dtype=dtype, device=device),
                torch.empty(capacity, dtype=dtype, device=device),
                torch.empty(blocks, dtype=torch.float32, device=device),
                torch.empty(blocks, dtype=torch.float32, device=device))
    compressed, received, total, scratch = have
    compressed[numel:padded].zero_()  # the last block's padding: zeros sum to zeros
    return compressed[:padded], received[:padded], total[:block], scratch[:block]


def fp16_compress_hook(state, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket sent as float16 (``compressed_allreduce``); float32 accumulation."""
    return _done(compressed_allreduce(bucket.buffer(), torch.float16, _comm_of(state)))


def bf16_compress_hook(state, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket sent as bfloat16 (``compressed_allreduce``); float32 accumulation."""
    return _done(compressed_allreduce(bucket.buffer(), torch.bfloat16, _comm_of(state)))
