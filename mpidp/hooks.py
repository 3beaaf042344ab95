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
import zlib

import numpy as np
import torch
from mpi4py import MPI

from . import _args
from . import agreement as _agreement
from . import comm as _comm
from . import watchdog as _watchdog
from .comm import chunking as _chunking
from .comm import pool as _pool

__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "compressed_allreduce", "PowerSGDState", "powerSGD_hook"]


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


def _size(comm) -> int:
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
    size = _size(comm)
    for piece in _chunking.pieces(buffer, _chunking.chunk_bytes(), size):
        _comm.allreduce(piece, "sum", comm=comm)
    return _done(buffer)


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
    size = _size(comm)
    problem = _buffer_problem(buffer, dtype)
    numel = step = 0
    if problem is None:
        numel = buffer.numel()
        step = max(1, _chunking.chunk_bytes() // buffer.element_size() // size) * size
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
        flat.div_(size)
        compressed.copy_(flat)
        flat.copy_(compressed)
        return buffer
    rank = _comm._base(comm).Get_rank()
    spans = [(at, min(at + step, numel)) for at in range(0, numel, step)]
    sent: list = [None] * len(spans)  # chunk k's alltoall, then its allgather
    gathered: list = [None] * len(spans)

    def poll() -> None:  # drive the transfers in flight while this rank computes
        for handle in sent + gathered:
            if handle is not None:
                handle.is_completed()

    def padded(k: int) -> slice:  # chunk k and the zeros that make it N equal blocks
        at, stop = spans[k]
        return slice(at, at + -(-(stop - at) // size) * size)

    def pack(k: int) -> None:  # divide chunk k (in place: it is overwritten anyway), round it
        at, stop = spans[k]
        piece = flat[at:stop]
        piece.div_(size)
        poll()
        compressed[at:stop].copy_(piece)  # the one rounding of this rank's part
        sent[k] = _comm.ialltoall(received[padded(k)], compressed[padded(k)], comm=comm)

    def reduce(k: int) -> None:  # sum chunk k's parts of this rank, in rank order; gather
        sent[k].wait()
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
        gathered[k].wait()
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


_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4}


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


def _agree(comm, facts: list[int], problem: bool, describe, what: str, label: str) -> None:
    """Raise ``ValueError(what + each rank's describe())`` on every rank unless all ranks'
    ``facts`` are equal and no rank has a ``problem``.

    One allreduce of the maxima of the facts and of their negatives, on the
    communicator a pool would hand the next collective (all ranks take the
    same one); the descriptions travel only when something differs.
    """
    facts = [*facts, int(problem)]
    both = np.array(facts + [-fact for fact in facts], dtype=np.int64)
    base = _pool._collective_comm(comm)
    slot = _watchdog.begin(label)
    try:
        base.Allreduce(MPI.IN_PLACE, both, MPI.MAX)
    finally:
        slot.current = None
    n = len(facts)
    if (both[:n] == -both[n:]).all() and not both[n - 1]:
        return
    raise ValueError(f"{what} "
                     f"{_agreement.by_rank(_agreement.watched_allgather(base, describe(), label))}")


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

    _agree(comm, [numel, step, *codes], problem is not None, describe,
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


class PowerSGDState:
    """torch's ``PowerSGDState``, over an MPI communicator (``comm``: as a hook's state above).

    The same arguments and semantics: the first ``start_powerSGD_iter`` steps
    allreduce exactly (counted by the last bucket of each step). After them,
    each matrix-shaped gradient of an ``n x m`` view is sent as rank-``r``
    factors P (n x r) and Q (m x r) where that saves at least
    ``min_compression_rate``; vectors go exactly. ``use_error_feedback`` adds
    the last step's local compression error to the next gradient,
    ``warm_start`` reuses Q, and ``random_seed`` seeds the first Qs as torch
    does. On the same buckets the results equal torch's hook's up to the
    order of the sums in one product (Q = M^T P is formed as (P^T M)^T, which
    a CPU computes 10x faster): about 1e-6 relative.
    """

    def __init__(self, comm=None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0):
        _args.check_int("matrix_approximation_rank", matrix_approximation_rank, minimum=1)
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(f"start_powerSGD_iter must be > 1 when use_error_feedback or "
                             f"warm_start is on (as in torch: PowerSGD starts after the first "
                             f"two steps), got {start_powerSGD_iter!r}")
        self.comm = _comm_of(comm)
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, elements before, elements after), as torch's."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after else 0
        return rate, self.total_numel_before_compression, after


def _orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """Orthonormalise the columns of each matrix in the batch, in place (torch's rule)."""
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            column = matrices[:, :, i:i + 1]
            column /= torch.norm(column, dim=1, keepdim=True) + epsilon
            if i + 1 < rank:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(column * rest, dim=1, keepdim=True) * column
    else:
        torch.linalg.qr(matrices, out=(matrices, torch.empty(
            matrices.shape[0], rank, rank, device=matrices.device, dtype=matrices.dtype)))


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future:  # noqa: N802 (torch's name)
    """torch's PowerSGD (Vogels et al. 2019) over MPI; see ``PowerSGDState``."""
    comm = state.comm
    size = _size(comm)
    buffer = bucket.buffer()
    compressing = state.iter >= state.start_powerSGD_iter
    if size > 1:
        _check_powersgd_bucket(state, bucket, compressing)
    if not compressing:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(comm, bucket)
    try:
        return _powersgd(state, bucket, comm, size, buffer)
    except BaseException:
        # a failed step must not feed its half-made difference (or the whole
        # gradient, copied into the error first) into the next one
        state.error_dict.pop(bucket.index(), None)
        raise


def _check_powersgd_bucket(state: PowerSGDState, bucket: GradBucket, compressing: bool) -> None:
    """Raise the same ValueError on every rank unless all are at the same phase with the same
    bucket and settings: the factors' allreduces would otherwise pair unlike matrices (wrong
    numbers) or unlike sizes (MPI's "Message truncated")."""
    shapes = [tuple(gradient.shape) for gradient in bucket.gradients()]
    buffer = bucket.buffer()
    settings = (state.matrix_approximation_rank, state.min_compression_rate,
                state.use_error_feedback, state.warm_start)
    facts = [buffer.numel(), _DTYPE_CODES.get(buffer.dtype, 0), int(compressing),
             zlib.crc32(repr((shapes, settings)).encode())]

    def describe() -> str:
        phase = ("compressing" if compressing else
                 f"exact (step {state.iter} of the first {state.start_powerSGD_iter})")
        shown = ", ".join(map(str, shapes[:6])) + (", ..." if len(shapes) > 6 else "")
        return (f"bucket {bucket.index()} of {buffer.numel()} {buffer.dtype} elements, "
                f"gradients {shown}, {phase}, matrix_approximation_rank={settings[0]}, "
                f"min_compression_rate={settings[1]}, use_error_feedback={settings[2]}, "
                f"warm_start={settings[3]}")

    _agree(state.comm, facts, False, describe,
           "powerSGD_hook: every rank must reduce the same bucket at the same step with the "
           "same PowerSGDState settings; got", "powerSGD_hook's check of the bucket")


def _powersgd(state: PowerSGDState, bucket: GradBucket, comm, size: int,
              buffer: torch.Tensor) -> torch.futures.Future:
    index = bucket.index()
    dtype, device = buffer.dtype, buffer.device
    error = None
    if state.use_error_feedback:
        # torch adds the last error, clones the bucket and forms a fresh
        # original - result; here the error tensor holds the clone and takes
        # the difference in place: the same sums, and no new bucket-sized
        # tensor per step (each costs a page fault per 4 KiB: about a quarter
        # of the hook's local work on a 98 MiB bucket, measured).
        error = state.error_dict.get(index)
        if error is None:
            error = state.error_dict[index] = torch.empty(buffer.numel(), device=device,
                                                          dtype=dtype)
        else:
            buffer.add_(error)
        error.copy_(buffer)
    to_compress, exact = [], []
    p_size = q_size = 0
    for tensor in bucket.gradients():
        matrix = tensor.view(tensor.shape[0], -1) if tensor.dim() else tensor.view(1, 1)
        n, m = matrix.shape
        rank = min(n, m, state.matrix_approximation_rank)
        compressed = (n + m) * rank
        state.total_numel_before_compression += n * m
        if compressed * state.min_compression_rate < n * m:
            to_compress.append(matrix)
            p_size += n * rank
            q_size += m * rank
            state.total_numel_after_compression += compressed
        else:
            exact.append(tensor)
            state.total_numel_after_compression += n * m
    randomize = not state.warm_start or index not in state.p_memory_dict
    if randomize:
        state.p_memory_dict[index] = torch.empty(p_size, device=device, dtype=dtype)
        state.q_memory_dict[index] = torch.empty(q_size, device=device, dtype=dtype)
    # torch groups the matrices by shape (in first-seen order) before laying out P and Q
    by_shape: dict[torch.Size, list[torch.Tensor]] = {}
    for matrix in to_compress:
        by_shape.setdefault(matrix.shape, []).append(matrix)
    matrices, ps, qs = [], [], []
    p_at = q_at = 0
    for group in by_shape.values():
        for matrix in group:
            n, m = matrix.shape
            rank = min(n, m, state.matrix_approximation_rank)
            matrices.append(matrix.unsqueeze(0))
            ps.append(state.p_memory_dict[index][p_at:p_at + n * rank].view(1, n, rank))
            qs.append(state.q_memory_dict[index][q_at:q_at + m * rank].view(1, m, rank))
            p_at += n * rank
            q_at += m * rank
    if not randomize:
        for q in qs:
            _orthogonalize(q, state.orthogonalization_epsilon)
    else:
        # torch seeds the process's generator under fork_rng; a generator of
        # its own gives the same numbers and leaves the caller's, and another
        # thread's, random state alone
        generator = torch.Generator().manual_seed(state.rng.randint(1_000_000_000))
        for q in qs:
            q.copy_(torch.randn(*q.shape, generator=generator, dtype=dtype))
            _orthogonalize(q, state.orthogonalization_epsilon)
    for matrix, q, p in zip(matrices, qs, ps):
        torch.bmm(matrix, q, out=p)
    if exact:
        flat = torch.cat([tensor.reshape(-1) for tensor in exact])
        _comm.allreduce(flat, "sum", comm=comm)
        flat.div_(size)
        at = 0
        for tensor in exact:
            tensor.copy_(flat[at:at + tensor.numel()].view_as(tensor))
            at += tensor.numel()
    _comm.allreduce(state.p_memory_dict[index], "sum", comm=comm)
    for p in ps:
        _orthogonalize(p, state.orthogonalization_epsilon)
    for matrix, p, q in zip(matrices, ps, qs):
        # Q = M^T P as (P^T M)^T: reads M row by row, 10x faster on a CPU than
        # torch's bmm(M^T, P); the same products, summed in another order.
        q.copy_(torch.bmm(p.transpose(1, 2), matrix).transpose(1, 2))
    _comm.allreduce(state.q_memory_dict[index], "sum", comm=comm)
    state.q_memory_dict[index].div_(size)
    for p, q, matrix in zip(ps, qs, matrices):
        torch.bmm(p, q.transpose(1, 2), out=matrix)
    if error is not None:
        error.sub_(buffer)  # original - result, as torch's
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    return _done(buffer)
