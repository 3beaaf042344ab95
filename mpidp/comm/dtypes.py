"""Torch dtypes as MPI datatypes and buffers, and the MPI ops that reduce them.

Supported dtypes: float16, bfloat16, float32, float64, int32, int64, int16, int8,
uint8 and bool. Reduction ops: "sum", "avg", "min", "max", "prod" ("avg" needs a floating
dtype; on bool, sum/max are logical or and prod/min logical and), and the bitwise
"band", "bor", "bxor" (integer and bool dtypes; on bool logical and, or, xor). Where the MPI
library lacks a datatype or an op for a dtype (bfloat16 reductions in most
libraries), mpidp reduces with a user-defined MPI op computed by torch. Which
path is used is decided once per (dtype, op) by a local probe
(``MPI_Reduce_local`` checked against torch), so it is the same on every rank.
"""

from __future__ import annotations

import functools
import itertools

import torch
from mpi4py import MPI

__all__ = ["OPS", "reduction_path"]

OPS = ("sum", "avg", "min", "max", "prod", "band", "bor", "bxor")
_BITWISE = ("band", "bor", "bxor")


# torch dtype -> (MPI datatype name in preference order, carrier used when the
# library lacks the type: same size, never reduced natively).
_DATATYPES = {
    torch.float16: (("FLOAT16_T",), "UINT16_T"),
    torch.bfloat16: (("BFLOAT16_T",), "UINT16_T"),
    torch.float32: (("FLOAT",), None),
    torch.float64: (("DOUBLE",), None),
    torch.int32: (("INT32_T",), None),
    torch.int64: (("INT64_T",), None),
    torch.uint8: (("UINT8_T",), None),
    torch.bool: (("C_BOOL",), None),
    torch.int8: (("INT8_T",), None),
    torch.int16: (("INT16_T",), None),
}

_DTYPES = tuple(_DATATYPES)  # a dtype's index here names it in messages between ranks

_NATIVE_OPS = {"sum": "SUM", "avg": "SUM", "min": "MIN", "max": "MAX", "prod": "PROD",
               "band": "BAND", "bor": "BOR", "bxor": "BXOR"}
_NATIVE_BOOL_OPS = {"sum": "LOR", "min": "LAND", "max": "LOR", "prod": "LAND",
                    "band": "LAND", "bor": "LOR", "bxor": "LXOR"}
_TORCH_OPS = {"sum": torch.add, "avg": torch.add, "min": torch.minimum,
              "max": torch.maximum, "prod": torch.mul, "band": torch.bitwise_and,
              "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


@functools.cache
def _datatype(dtype: torch.dtype) -> tuple[MPI.Datatype, bool]:
    """Return (MPI datatype, whether MPI knows it natively) for a torch dtype."""
    names, carrier = _DATATYPES[dtype]
    for name in names:
        datatype = getattr(MPI, name, MPI.DATATYPE_NULL)
        if _usable(datatype, dtype):
            return datatype, True
    return getattr(MPI, carrier), False


def _usable(datatype: MPI.Datatype, dtype: torch.dtype) -> bool:
    """Whether the library has ``datatype``, of ``dtype``'s size.

    mpi4py names every datatype of the standard; a library without one (Open MPI 4.1 has
    no ``MPI_FLOAT16_T``) gives a handle that is neither ``DATATYPE_NULL`` nor valid:
    only asking for its size tells (a reduction of it crashed in ``MPI_Reduce_local``).
    """
    if datatype == MPI.DATATYPE_NULL:
        return False
    try:
        return datatype.Get_size() == dtype.itemsize
    except MPI.Exception:
        return False


def _buffer(tensor: torch.Tensor, count: int | None = None):
    datatype, _ = _datatype(tensor.dtype)
    return [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes),
            tensor.numel() if count is None else count, datatype]


def _vbuffer(tensor: torch.Tensor, counts: list[int]):
    """A buffer spec of consecutive blocks of ``counts`` elements, one per rank."""
    displacements = [0, *itertools.accumulate(counts)][:-1]
    return [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes), (counts, displacements),
            _datatype(tensor.dtype)[0]]


def _probe(op: MPI.Op, dtype: torch.dtype, name: str) -> bool:
    """Check locally that ``op`` reduces ``dtype`` as torch would."""
    if dtype == torch.bool:
        a = torch.tensor([True, False, True, False])
        b = torch.tensor([True, True, False, False])
    else:
        a = torch.tensor([1, 2, 3, 0, 5, 1], dtype=dtype)
        b = torch.tensor([2, 2, 1, 1, 0, 3], dtype=dtype)
    expected = _TORCH_OPS[name](a, b)
    try:
        op.Reduce_local(_buffer(a), _buffer(b))
    except MPI.Exception:
        return False
    return torch.equal(b, expected)


def _torch_op(dtype: torch.dtype, name: str) -> MPI.Op:
    combine = _TORCH_OPS[name]

    def reduce(inbuf, inoutbuf, datatype):
        out = torch.frombuffer(inoutbuf, dtype=dtype)
        combine(torch.frombuffer(inbuf, dtype=dtype), out, out=out)

    return MPI.Op.Create(reduce, commute=True)


@functools.cache
def _reduction(dtype: torch.dtype, name: str) -> tuple[MPI.Op, bool]:
    """Return (the MPI op that reduces ``dtype`` with ``name``, whether it is the library's own)."""
    _, native = _datatype(dtype)
    if native:
        table = _NATIVE_BOOL_OPS if dtype == torch.bool else _NATIVE_OPS
        op = getattr(MPI, table[name])
        if _probe(op, dtype, name):
            return op, True
    return _torch_op(dtype, name), False


def reduction_path(dtype: torch.dtype, op: str = "sum") -> str:
    """Return "native" or "torch": how mpidp reduces ``dtype`` with ``op`` on this MPI library."""
    _check_op(op, dtype)
    return "native" if _reduction(dtype, op)[1] else "torch"


def _check_op(op: str, dtype: torch.dtype) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if op == "avg" and not dtype.is_floating_point:
        raise TypeError(f"op 'avg' needs a floating-point dtype, got {dtype}")
    if op in _BITWISE and dtype.is_floating_point:
        raise TypeError(f"op {op!r} needs an integer or bool dtype, got {dtype}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
