"""Checks that keep ranks in step: arguments, and (``MPIDP_DEBUG``) that all make the same call.

Arguments are checked before anything collective happens (taking a pool
member included), so a rank that catches an argument error stays in step with
the others. What one rank cannot check alone (``alltoall``'s splits against
the senders', ``allgatherv``'s row shapes) is exchanged first (see
``mpidp.comm.uneven``), and a disagreement raises the same ``ValueError`` on
every rank.

Set ``MPIDP_DEBUG=1`` (or true/yes/on) to have every collective first check, on
the communicator it is about to use, that all ranks made the same call: the
same collective (blocking or not), op, root, dtype and element count. A
mismatch raises the same ``ValueError`` on every rank, naming each rank's call,
instead of hanging or corrupting memory.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch
from mpi4py import MPI

from .. import _args, settings
from .. import watchdog as _watchdog
from . import agreement as _agreement
from .dtypes import _DATATYPES, _DTYPES, OPS as _OPS


def _debug_from_env() -> bool:
    return settings.get("MPIDP_DEBUG")


# Read once at import; callers read it here at call time, so tests switch it by
# setting mpidp.comm.checks._DEBUG.
_DEBUG = _debug_from_env()


def _check_tensor(name: str, tensor, written: bool = False) -> None:
    """Check a tensor argument; ``written``: MPI puts a result into it."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _DATATYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in _DATATYPES)
        raise TypeError(f"{name} has dtype {tensor.dtype}, supported dtypes are {supported}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be a CPU or CUDA tensor, got device {tensor.device}")
    if tensor.requires_grad:
        raise ValueError(f"{name} requires grad; communicate {name}.detach() instead")
    if written and not tensor.is_contiguous() and any(
            size > 1 and stride == 0 for size, stride in zip(tensor.shape, tensor.stride())):
        # torch's copy_ refuses to write such a tensor: fail now, not after the collective
        raise ValueError(f"{name} has elements that share memory (strides {tuple(tensor.stride())} "
                         f"for shape {tuple(tensor.shape)}) and cannot receive a result; pass a "
                         f"tensor of its own, such as {name}.clone()")


def _check_root(root, comm: MPI.Intracomm) -> None:
    _args.check_rank("root", root, comm.Get_size())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` intersect (MPI forbids aliased buffers)."""
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + _span(a) * a.element_size()
    b_end = b_start + _span(b) * b.element_size()
    return a_start < b_end and b_start < a_end


def _span(tensor: torch.Tensor) -> int:
    """Elements from the first to one past the last that ``tensor`` addresses."""
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))


_ranks = _watchdog._ranks  # 'rank 3', 'ranks 0-2, 5': one way of naming ranks in messages


_CALL_BYTES = 240  # a call's text in the MPIDP_DEBUG check, then an 8-byte hash of the whole


def _check_same_call(comm: MPI.Intracomm, name: str, nonblocking: bool, **fields) -> None:
    """Debug mode: check that every rank is making this call on ``comm``, else all raise.

    Runs on the communicator the collective is about to use, before anything
    else, so ranks that called different collectives still meet in this
    allgather (of fixed size, so it matches whatever the texts) and reach the
    same decision. On the progress thread it is driven, never waited on
    (``mpidp.comm.handle.collective``).
    """
    args = ", ".join(f"{key}={value}" for key, value in fields.items())
    call = f"{'i' if nonblocking else ''}{name}({args})"
    text = call.encode()
    mine = np.zeros(_CALL_BYTES + 8, dtype=np.uint8)
    mine[:min(len(text), _CALL_BYTES)] = np.frombuffer(text[:_CALL_BYTES], dtype=np.uint8)
    mine[_CALL_BYTES:] = np.frombuffer(hashlib.blake2b(text, digest_size=8).digest(), np.uint8)
    _agreement.decide_rows(comm, mine, _calls_differ, f"the MPIDP_DEBUG check of {call}")


def _calls_differ(every: np.ndarray) -> ValueError | None:
    """The MPIDP_DEBUG check's judge: rows of each rank's call text and hash."""
    if (every == every[0]).all():
        return None
    calls = [bytes(row[:_CALL_BYTES]).rstrip(b"\0").decode(errors="replace") for row in every]
    ranks_of: dict[str, list[int]] = {}
    for rank, call in enumerate(calls):
        ranks_of.setdefault(call, []).append(rank)
    made = "; ".join(f"{_ranks(ranks)} called {call}" for call, ranks in ranks_of.items())
    return ValueError(f"collective calls differ across ranks: {made}; every rank must make the "
                      f"same collective calls, with the same op, root, dtype and element count, "
                      f"in the same order")


# -- the backend's always-on check of a call's shape ---------------------------------------
# A collective whose element count or dtype differs across ranks is undefined in MPI:
# MPICH's blocking form ends the process (mpidp.runtime reports it), but its nonblocking
# form was seen to complete on every rank with a silently truncated result (2 ranks,
# all_reduce of 1000 against 1500 floats through torch.distributed). So every
# collective the torch.distributed backend starts carries a fingerprint of the call,
# reduced with MAX beside it (values and their negatives: one reduction gives every
# rank the largest and the smallest of each field). Every rank then sees the same
# result and decides alike. It costs one small nonblocking allreduce per operation,
# overlapped with the operation itself: a raw mpi4py Iallreduce of 80 bytes of numpy.

_CALLS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "reduce", "gather",
          "scatter", "alltoall")
_FIELDS = ("collective", "element count", "dtype", "op", "root")
_CALL_CODES = {name: code for code, name in enumerate(_CALLS)}
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_OP_CODES = {name: code for code, name in enumerate(_OPS)}


def fingerprint(call: str, numel: int, dtype: torch.dtype, op: str | None = None,
                root: int = 0) -> np.ndarray:
    """The int64 fingerprint of one call, to be allreduced with MAX (see above); a new array."""
    return np.frombuffer(bytearray(_fingerprint_bytes(call, numel, dtype, op, root)), np.int64)


@functools.lru_cache(maxsize=1024)
def _fingerprint_bytes(call: str, numel: int, dtype: torch.dtype, op: str | None,
                       root: int) -> bytes:
    # a program repeats a few shapes: cached, a fingerprint costs a dict lookup and a copy
    return _agreement.extremes([_CALL_CODES[call], numel, _DTYPE_CODES.get(dtype, -1),
                                -1 if op is None else _OP_CODES.get(op, -2), root]).tobytes()


def fingerprint_problem(reduced: np.ndarray, own: bytes | None = None) -> str | None:
    """None if every rank made the same call, else what differs (the same text on every rank).

    ``own``, this rank's fingerprint as bytes, makes the common case one comparison: the
    reduction equals it exactly when every rank's is the same (MAX of the values and of
    their negatives gives the largest and the smallest of each field).
    """
    if own is not None and reduced.tobytes() == own or _agreement.all_equal(reduced):
        return None
    count = len(_FIELDS)
    high, low = reduced[:count], -reduced[count:]
    differ = [f"{name} from {_describe(name, int(lo))} to {_describe(name, int(hi))}"
              for name, lo, hi in zip(_FIELDS, low, high) if lo != hi]
    return (f"collective calls differ across ranks ({', '.join(differ)}); every rank must "
            f"make the same collective calls, with the same op, root, dtype and element count, "
            f"in the same order; run again with MPIDP_DEBUG=1 to have each rank's call named")


def _describe(field: str, value: int):
    if field == "collective":
        return _CALLS[value] if 0 <= value < len(_CALLS) else value
    if field == "dtype":
        return str(_DTYPES[value]).replace("torch.", "") if 0 <= value < len(_DTYPES) else value
    if field == "op":
        return _OPS[value] if 0 <= value < len(_OPS) else "none"
    return value
