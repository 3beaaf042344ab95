"""torch's PowerSGD communication hook over mpidp: low-rank factors allreduced through MPI.

The same algorithm and state as ``torch.distributed.algorithms.ddp_comm_hooks.
powerSGD_hook`` (Vogels et al., 2019): each bucket's matrices are approximated
by P Q^T of rank ``matrix_approximation_rank``, P and Q allreduced, with error
feedback and warm start; tensors that would not shrink go uncompressed. Used
through ``mpidp.hooks``, which re-exports ``PowerSGDState`` and ``powerSGD_hook``.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from .. import _args
from ..comm import agreement as _agreement
from .. import comm as _comm
from ..comm import chunking as _chunking
from .basics import _DTYPE_CODES, GradBucket, _comm_of, _done, allreduce_hook, world_size

__all__ = ["PowerSGDState", "powerSGD_hook"]


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
    size = world_size(comm)
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

    _agreement.agree_facts(state.comm, facts, False, describe,
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
        _chunking.mean_of_sum(flat, size)  # after the sum, as torch's hook (mpidp.comm.chunking)
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
    _chunking.mean_of_sum(state.q_memory_dict[index], size)
    for p, q, matrix in zip(ps, qs, matrices):
        torch.bmm(p, q.transpose(1, 2), out=matrix)
    if error is not None:
        error.sub_(buffer)  # original - result, as torch's
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    return _done(buffer)
