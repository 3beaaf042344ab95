"""Collective and point-to-point communication of torch tensors over mpi4py.

Every function takes tensors that do not require grad, works in place where
MPI allows it, and comes in a blocking form and a nonblocking ``i``-form that
returns a ``Handle``. ``comm`` may be an ``mpi4py`` communicator (used as it
is), a ``Pool`` (its next member, round-robin), or None (the default pool over
``MPI.COMM_WORLD``). Round-robin over duplicated communicators lets several
collectives progress at once, as the DDP paper's round-robin process groups
do; collectives must still be issued in the same order on every rank.

Tensors may live on the CPU or a CUDA device. Before MPI touches device memory,
the stream that produced it is synchronised (mpi4py cannot do that); a
CUDA-aware library then reads device memory directly, any other gets a copy
staged through pinned host memory (see ``mpidp.cuda``). A non-contiguous tensor
is staged the same way: MPI gets a contiguous copy, and a tensor that receives
a result gets it copied back when the operation completes (at ``wait()`` for
the ``i``-forms); only a result tensor whose elements share memory (a stride-0
``expand()``) is refused. Contiguous tensors go to MPI as they are.

Supported dtypes: float16, bfloat16, float32, float64, int32, int64, uint8 and
bool. Reduction ops: "sum", "avg", "min", "max", "prod" ("avg" needs a floating
dtype; on bool, sum/max are logical or and prod/min logical and), and the bitwise
"band", "bor", "bxor" (integer and bool dtypes; on bool logical and, or, xor). Where the MPI
library lacks a datatype or an op for a dtype (bfloat16 reductions in most
libraries), mpidp reduces with a user-defined MPI op computed by torch. Which
path is used is decided once per (dtype, op) by a local probe
(``MPI_Reduce_local`` checked against torch), so it is the same on every rank.

Arguments are checked before anything collective happens (taking a pool
member included), so a rank that catches an argument error stays in step with
the others. Point-to-point messages to oneself are refused, as in
torch.distributed: MPI_Send to one's own rank blocks once the message outgrows
the library's eager buffer. What one rank cannot check alone (``alltoall``'s
splits against the senders', ``allgatherv``'s row shapes) is exchanged first,
and a disagreement raises the same ``ValueError`` on every rank.

Set ``MPIDP_DEBUG=1`` (or true/yes/on) to have every collective first check, on
the communicator it is about to use, that all ranks made the same call: the
same collective (blocking or not), op, root, dtype and element count. A
mismatch raises the same ``ValueError`` on every rank, naming each rank's call,
instead of hanging or corrupting memory.

Every blocking MPI call here (and ``Handle.wait``) records what it is for the
stall watchdog, which reports a call that waits past ``MPIDP_TIMEOUT``; see
``mpidp.watchdog``.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading

import numpy as np
import torch
from mpi4py import MPI

from .. import _env
from .. import cuda as _cuda
from .. import errors as _errors
from .. import runtime as _runtime
from .. import watchdog as _watchdog

__all__ = [
    "OPS", "Handle", "Pool", "default_pool",
    "allreduce", "iallreduce", "broadcast", "ibroadcast", "allgather", "iallgather",
    "reduce_scatter", "ireduce_scatter", "reduce", "ireduce", "gather", "igather",
    "scatter", "iscatter", "alltoall", "ialltoall", "allgatherv", "iallgatherv",
    "barrier", "ibarrier", "send", "recv", "isend", "irecv", "reduction_path",
]

OPS = ("sum", "avg", "min", "max", "prod", "band", "bor", "bxor")
_BITWISE = ("band", "bor", "bxor")


def _debug_from_env() -> bool:
    return _env.flag("MPIDP_DEBUG", False)


# Read once at import; tests switch it by setting the attribute.
_DEBUG = _debug_from_env()
_STAGE_CPU = _cuda.stage_cpu()  # testing aid: CPU tensors take the staging path too

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
}

_DTYPES = tuple(_DATATYPES)  # a dtype's index here names it in messages between ranks

_NATIVE_OPS = {"sum": "SUM", "avg": "SUM", "min": "MIN", "max": "MAX", "prod": "PROD",
               "band": "BAND", "bor": "BOR", "bxor": "BXOR"}
_NATIVE_BOOL_OPS = {"sum": "LOR", "min": "LAND", "max": "LOR", "prod": "LAND",
                    "band": "LAND", "bor": "LOR", "bxor": "LXOR"}
_TORCH_OPS = {"sum": torch.add, "avg": torch.add, "min": torch.minimum,
              "max": torch.maximum, "prod": torch.mul, "band": torch.bitwise_and,
              "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}

# Handles whose MPI request is in flight; holding them here keeps their tensors
# alive even if the caller drops the handle without waiting.
_in_flight: set = set()


class Handle:
    """A pending nonblocking operation that owns its tensors until it completes.

    ``wait()`` blocks and returns the result (the output tensor; see each
    ``i``-function); ``is_completed()`` tests without blocking (and drives MPI
    progress).
    """

    __slots__ = ("_request", "_tensors", "_finish", "_result", "_label", "_scope", "__weakref__")

    def __init__(self, request, tensors, result, finish=None, label=None):
        self._request = request
        self._tensors = tensors
        self._result = result
        self._finish = finish
        self._label = label  # what wait() waits in, for stall reports (mpidp.watchdog)
        self._scope = _watchdog.context()
        _in_flight.add(self)

    def wait(self):
        """Block until the operation completes; return its result."""
        if self._request is not None:
            slot = _watchdog.begin(self._label, self._scope, True)
            try:
                self._settle(self._request.Wait)
            finally:
                slot.current = None
        return self._result

    def is_completed(self) -> bool:
        """Return True once the operation has completed, without blocking."""
        return self._request is None or self._settle(self._request.Test)

    def _settle(self, call) -> bool:
        try:
            done = call()
        except MPI.Exception as error:
            label = self._label
            self._release()
            raise _errors.mpi_failure(_watchdog._label_text(label), error) from error
        except BaseException:
            self._release()
            raise
        if done is False:
            return False
        finish = self._finish
        self._release()
        if finish is not None:
            finish()
        return True

    def _release(self):
        self._request = self._finish = self._tensors = None
        _in_flight.discard(self)


class Pool:
    """Duplicates of one communicator, handed out round-robin.

    Args:
        comm: the communicator to duplicate (default ``MPI.COMM_WORLD``).
        size: how many duplicates (>= 1). Creating a pool is collective over ``comm``.
    """

    def __init__(self, comm: MPI.Intracomm | None = None, size: int = 2):
        _runtime.require_mpi()
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"pool size must be an int >= 1, got {size!r}")
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py Intracomm, got {type(base).__name__}")
        slot = _watchdog.begin("MPI_Comm_dup for a Pool (collective)")
        try:
            self.comms = [base.Dup() for _ in range(size)]
        finally:
            slot.current = None
        # itertools.cycle's next() is one C call: atomic under the GIL, so two threads
        # never take the same turn. Which member a collective gets still follows the
        # order the threads issue in; the rule (docs/concurrency.md) is that one thread
        # issues a given pool's collectives, or the program orders them itself.
        self._cycle = itertools.cycle(self.comms)

    @property
    def rank(self) -> int:
        return self.comms[0].Get_rank()

    @property
    def size(self) -> int:
        return self.comms[0].Get_size()

    def next(self) -> MPI.Intracomm:
        """Return the next communicator of the pool (round-robin)."""
        return next(self._cycle)

    def free(self) -> None:
        """Free the duplicated communicators (collective)."""
        for comm in self.comms:
            comm.Free()
        self.comms = []


_default: list = []  # the default pool, once made
_default_lock = threading.Lock()


def default_pool() -> Pool:
    """Return the pool over ``MPI.COMM_WORLD`` used when ``comm`` is None.

    Its size comes from ``MPIDP_POOL_SIZE`` (default 2). Created on first use,
    which is collective; two threads that use it first at once make it once
    (the lock), not twice in an order that may differ between ranks.
    """
    if _default:
        return _default[0]
    with _default_lock:
        if not _default:
            _runtime.require_mpi()
            pool = Pool(MPI.COMM_WORLD, int(_env.number("MPIDP_POOL_SIZE", 2, minimum=1,
                                                        integer=True)))
            _watchdog.start()  # collective over COMM_WORLD, as the pool's creation
            _default.append(pool)
    return _default[0]


# A forked child must not reuse the parent's cached pool: forgetting it makes
# the child's first collective go through require_mpi(), which refuses there.
os.register_at_fork(after_in_child=_default.clear)


def _base(comm) -> MPI.Intracomm:
    """The communicator ``comm`` stands for, to check ranks and sizes against.

    Takes no pool member and creates no default pool: an argument error found
    with it leaves this rank in step with the others.
    """
    _runtime.require_mpi()  # one flag; a clear error in a multiprocessing child
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, Pool):
        if not comm.comms:
            raise ValueError("comm is a Pool that has been freed")
        return comm.comms[0]
    if isinstance(comm, MPI.Intracomm):
        return comm
    raise TypeError(f"comm must be None, an mpidp.comm.Pool or an mpi4py Intracomm, "
                    f"got {type(comm).__name__}")


def _collective_comm(comm) -> MPI.Intracomm:
    """Take the communicator a collective runs on; call it only once every argument is checked."""
    if comm is None:
        return default_pool().next()
    if isinstance(comm, Pool):
        return comm.next()
    if isinstance(comm, MPI.Intracomm):
        return comm
    raise TypeError(f"comm must be None, an mpidp.comm.Pool or an mpi4py Intracomm, "
                    f"got {type(comm).__name__}")


def _p2p_comm(comm) -> MPI.Intracomm:
    # Point-to-point messages between two ranks are ordered only within one
    # communicator, so a pool always uses its first member.
    if comm is None:
        return default_pool().comms[0]
    if isinstance(comm, Pool):
        return comm.comms[0]
    return comm


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


@functools.cache
def _datatype(dtype: torch.dtype) -> tuple[MPI.Datatype, bool]:
    """Return (MPI datatype, whether MPI knows it natively) for a torch dtype."""
    names, carrier = _DATATYPES[dtype]
    for name in names:
        datatype = getattr(MPI, name, MPI.DATATYPE_NULL)
        if datatype != MPI.DATATYPE_NULL:
            return datatype, True
    return getattr(MPI, carrier), False


def _buffer(tensor: torch.Tensor, count: int | None = None):
    datatype, _ = _datatype(tensor.dtype)
    return [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes),
            tensor.numel() if count is None else count, datatype]


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


def _stage(inputs: tuple, outputs: tuple, host_only: bool = False):
    """Make tensors safe to hand to MPI; return (mpi inputs, mpi outputs, copy back or None).

    A contiguous tensor MPI can read goes as it is. Device memory the library
    cannot read (it is not CUDA-aware, or ``host_only``, as for reductions that
    torch computes on the host) gets a pinned host stand-in; a non-contiguous
    tensor a contiguous stand-in on its own device. Inputs' stand-ins are filled
    now, outputs' copied back by the returned step once MPI has finished; a
    tensor that is both (in place) gets one stand-in. Device streams are
    synchronised after the copies are queued, so MPI reads finished data.
    """
    tensors = inputs + outputs
    if not _STAGE_CPU:
        for tensor in tensors:
            if tensor.is_cuda or not tensor.is_contiguous():
                break
        else:
            return inputs, outputs, None
    devices = {t.device for t in tensors if t.is_cuda}
    device_to_host = bool(devices) and (host_only or not _cuda.cuda_aware())
    pinned = torch.cuda.is_available()
    stand_ins: dict[int, torch.Tensor] = {}

    def stand_in(tensor, fill):
        if id(tensor) not in stand_ins:
            if device_to_host and tensor.is_cuda or _STAGE_CPU and not tensor.is_cuda:
                copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            elif not tensor.is_contiguous():
                copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            else:
                copy = tensor
            if fill and copy is not tensor:
                copy.copy_(tensor)
            stand_ins[id(tensor)] = copy
        return stand_ins[id(tensor)]

    mpi_inputs = tuple(stand_in(t, True) for t in inputs)
    mpi_outputs = tuple(stand_in(t, False) for t in outputs)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    pairs = [(t, copy) for t, copy in zip(outputs, mpi_outputs) if copy is not t]
    if not pairs:
        return mpi_inputs, mpi_outputs, None

    def copy_back():
        for tensor, copy in pairs:
            tensor.copy_(copy, non_blocking=True)  # from pinned memory: ordered on the stream

    return mpi_inputs, mpi_outputs, copy_back


def _chain(*steps):
    steps = [step for step in steps if step is not None]
    if not steps:
        return None

    def run():
        for step in steps:
            step()

    return run


def _check_op(op: str, dtype: torch.dtype) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if op == "avg" and not dtype.is_floating_point:
        raise TypeError(f"op 'avg' needs a floating-point dtype, got {dtype}")
    if op in _BITWISE and dtype.is_floating_point:
        raise TypeError(f"op {op!r} needs an integer or bool dtype, got {dtype}")


def _check_same_call(comm: MPI.Intracomm, name: str, nonblocking: bool, **fields) -> None:
    """Debug mode: check that every rank is making this call on ``comm``, else all raise.

    Runs on the communicator the collective is about to use, before anything
    else, so ranks that called different collectives still meet in this
    allgather and reach the same decision.
    """
    args = ", ".join(f"{key}={value}" for key, value in fields.items())
    call = f"{'i' if nonblocking else ''}{name}({args})"
    slot = _watchdog.begin(f"the MPIDP_DEBUG check of {call}")
    try:
        calls = comm.allgather(call)
    finally:
        slot.current = None
    if calls.count(calls[0]) == len(calls):
        return
    ranks_of: dict[str, list[int]] = {}
    for rank, call in enumerate(calls):
        ranks_of.setdefault(call, []).append(rank)
    made = "; ".join(f"{_ranks(ranks)} called {call}" for call, ranks in ranks_of.items())
    raise ValueError(f"collective calls differ across ranks: {made}; every rank must make the "
                     f"same collective calls, with the same op, root, dtype and element count, "
                     f"in the same order")


_ranks = _watchdog._ranks  # 'rank 3', 'ranks 0-2, 5': one way of naming ranks in messages


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _start(comm: MPI.Intracomm, name: str, args, keep, result, finish, nonblocking: bool,
           label=None):
    """Run MPI collective ``name`` (blocking) or its ``I``-form, returning tensor or Handle.

    ``label`` names the call in stall reports (``mpidp.watchdog``), built only then.
    """
    if nonblocking:
        try:
            request = getattr(comm, "I" + name.lower())(*args)
        except MPI.Exception as error:
            raise _errors.mpi_failure(_watchdog._label_text(label), error) from error
        return Handle(request, keep, result, finish, label)
    slot = _watchdog.begin(label)
    try:
        getattr(comm, name)(*args)
    except MPI.Exception as error:
        raise _errors.mpi_failure(_watchdog._label_text(label), error) from error
    finally:
        slot.current = None
    if finish is not None:
        finish()
    return result


def _avg(tensor: torch.Tensor, op: str, size: int):
    return (lambda: tensor.div_(size)) if op == "avg" and size > 1 else None


def _allreduce(tensor, op, comm, nonblocking):
    _check_tensor("tensor", tensor, written=True)
    _check_op(op, tensor.dtype)
    comm = _collective_comm(comm)
    if _DEBUG:
        _check_same_call(comm, "allreduce", nonblocking, op=repr(op),
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    reduction, native = _reduction(tensor.dtype, op)
    (staged,), _, copy_back = _stage((tensor,), (tensor,), host_only=not native)
    args = (MPI.IN_PLACE, _buffer(staged), reduction)
    return _start(comm, "Allreduce", args, (tensor, staged), tensor,
                  _chain(_avg(staged, op, comm.Get_size()), copy_back), nonblocking,
                  ("allreduce", tensor, "op", op))


def allreduce(tensor: torch.Tensor, op: str = "sum", *, comm=None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place.

    Args:
        tensor: overwritten with the result on every rank.
        op: one of ``OPS``: "sum", "avg", "min", "max", "prod", "band", "bor", "bxor".
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``tensor``.
    """
    return _allreduce(tensor, op, comm, False)


def iallreduce(tensor: torch.Tensor, op: str = "sum", *, comm=None) -> Handle:
    """Start ``allreduce`` without blocking; returns a ``Handle`` whose ``wait()`` gives ``tensor``."""
    return _allreduce(tensor, op, comm, True)


def _broadcast(tensor, root, comm, nonblocking):
    _check_tensor("tensor", tensor, written=True)
    _check_root(root, _base(comm))
    comm = _collective_comm(comm)
    if _DEBUG:
        _check_same_call(comm, "broadcast", nonblocking, root=root,
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    (staged,), _, copy_back = _stage((tensor,), (tensor,))
    return _start(comm, "Bcast", (_buffer(staged), root), (tensor, staged), tensor, copy_back,
                  nonblocking, ("broadcast", tensor, "root", root))


def _check_root(root, comm: MPI.Intracomm) -> None:
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < comm.Get_size():
        raise ValueError(f"invalid root {root!r}, root should be in the interval "
                         f"[0, {comm.Get_size() - 1}]")


def broadcast(tensor: torch.Tensor, root: int = 0, *, comm=None) -> torch.Tensor:
    """Copy ``tensor`` from rank ``root`` into ``tensor`` on every other rank; returns it."""
    return _broadcast(tensor, root, comm, False)


def ibroadcast(tensor: torch.Tensor, root: int = 0, *, comm=None) -> Handle:
    """Start ``broadcast`` without blocking."""
    return _broadcast(tensor, root, comm, True)


def _check_scaled(big_name, big, small_name, small, size: int) -> None:
    if big.dtype != small.dtype:
        raise TypeError(f"{big_name} and {small_name} must have the same dtype, "
                        f"got {big.dtype} and {small.dtype}")
    if big.numel() != size * small.numel():
        raise ValueError(f"{big_name} must have world size ({size}) x {small_name}.numel() "
                         f"= {size * small.numel()} elements, got {big.numel()}")


def _allgather(output, tensor, comm, nonblocking):
    _check_tensor("output", output, written=True)
    _check_tensor("tensor", tensor)
    _check_scaled("output", output, "tensor", tensor, _base(comm).Get_size())
    comm = _collective_comm(comm)
    if _DEBUG:
        _check_same_call(comm, "allgather", nonblocking,
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    if _is_rank_block(tensor, output, comm.Get_rank()):
        # In place (FSDP's all-gather does it): MPI forbids aliased buffers but for MPI_IN_PLACE.
        (received,), _, copy_back = _stage((output,), (output,))
        args = (MPI.IN_PLACE, _buffer(received, tensor.numel()))
        return _start(comm, "Allgather", args, (output, tensor, received), output, copy_back,
                      nonblocking, ("allgather", tensor))
    if _overlap(tensor, output):
        tensor = tensor.clone()
    (sent,), (received,), copy_back = _stage((tensor,), (output,))
    # mpi4py counts the receive buffer per rank, like the send buffer.
    args = (_buffer(sent), _buffer(received, tensor.numel()))
    return _start(comm, "Allgather", args, (output, tensor, sent, received),
                  output, copy_back, nonblocking, ("allgather", tensor))


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


def _is_rank_block(tensor: torch.Tensor, output: torch.Tensor, rank: int) -> bool:
    return (tensor.device == output.device and tensor.is_contiguous() and output.is_contiguous()
            and tensor.numel() > 0
            and tensor.data_ptr() == output.data_ptr() + rank * tensor.nbytes)


def allgather(output: torch.Tensor, tensor: torch.Tensor, *, comm=None) -> torch.Tensor:
    """Gather ``tensor`` from every rank into ``output``, rank by rank along the flat order.

    ``tensor`` may be this rank's block of ``output`` (an in-place all-gather).

    Args:
        output: tensor of ``world size * tensor.numel()`` elements.
        tensor: this rank's contribution.
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``output``.
    """
    return _allgather(output, tensor, comm, False)


def iallgather(output: torch.Tensor, tensor: torch.Tensor, *, comm=None) -> Handle:
    """Start ``allgather`` without blocking."""
    return _allgather(output, tensor, comm, True)


def _reduce_scatter(output, tensor, op, comm, nonblocking):
    _check_tensor("output", output, written=True)
    _check_tensor("tensor", tensor)
    _check_op(op, tensor.dtype)
    _check_scaled("tensor", tensor, "output", output, _base(comm).Get_size())
    comm = _collective_comm(comm)
    if _DEBUG:
        _check_same_call(comm, "reduce_scatter", nonblocking, op=repr(op),
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    reduction, native = _reduction(tensor.dtype, op)
    (sent,), (received,), copy_back = _stage((tensor,), (output,), host_only=not native)
    # mpi4py counts the send buffer per block, like the receive buffer.
    args = (_buffer(sent, output.numel()), _buffer(received), reduction)
    return _start(comm, "Reduce_scatter_block", args, (output, tensor, sent, received), output,
                  _chain(_avg(received, op, comm.Get_size()), copy_back), nonblocking,
                  ("reduce_scatter", tensor, "op", op))


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", *,
                   comm=None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks and leave block ``rank`` of the result in ``output``.

    Args:
        output: tensor of ``tensor.numel() / world size`` elements.
        tensor: this rank's input, ``world size`` equal blocks in flat order.
        op: one of ``OPS``: "sum", "avg", "min", "max", "prod", "band", "bor", "bxor".
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``output``.
    """
    return _reduce_scatter(output, tensor, op, comm, False)


def ireduce_scatter(output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", *,
                    comm=None) -> Handle:
    """Start ``reduce_scatter`` without blocking."""
    return _reduce_scatter(output, tensor, op, comm, True)


def _reduce(tensor, root, op, comm, nonblocking):
    _check_tensor("tensor", tensor, written=True)
    _check_op(op, tensor.dtype)
    _check_root(root, _base(comm))
    comm = _collective_comm(comm)
    if _DEBUG:
        _check_same_call(comm, "reduce", nonblocking, op=repr(op), root=root,
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    reduction, native = _reduction(tensor.dtype, op)
    if comm.Get_rank() != root:  # sends only: its tensor is left as it was
        (staged,), _, _ = _stage((tensor,), (), host_only=not native)
        return _start(comm, "Reduce", (_buffer(staged), None, reduction, root), (tensor, staged),
                      tensor, None, nonblocking, ("reduce", tensor, "op", op, "root", root))
    (staged,), _, copy_back = _stage((tensor,), (tensor,), host_only=not native)
    args = (MPI.IN_PLACE, _buffer(staged), reduction, root)
    return _start(comm, "Reduce", args, (tensor, staged), tensor,
                  _chain(_avg(staged, op, comm.Get_size()), copy_back), nonblocking,
                  ("reduce", tensor, "op", op, "root", root))


def reduce(tensor: torch.Tensor, root: int = 0, op: str = "sum", *, comm=None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks into ``tensor`` on rank ``root``.

    Args:
        tensor: this rank's input; on ``root`` overwritten with the result, elsewhere
            left as it was.
        root: the rank that receives the result.
        op: one of ``OPS``: "sum", "avg", "min", "max", "prod", "band", "bor", "bxor".
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``tensor``.
    """
    return _reduce(tensor, root, op, comm, False)


def ireduce(tensor: torch.Tensor, root: int = 0, op: str = "sum", *, comm=None) -> Handle:
    """Start ``reduce`` without blocking."""
    return _reduce(tensor, root, op, comm, True)


def _root_only(name: str, value, root: int, base: MPI.Intracomm) -> None:
    if value is not None:
        raise ValueError(f"{name} must be None on ranks other than the root ({root}), got a "
                         f"{type(value).__name__} on rank {base.Get_rank()}")


def _gather(tensor, output, root, comm, nonblocking):
    _check_tensor("tensor", tensor)
    base = _base(comm)
    _check_root(root, base)
    is_root = base.Get_rank() == root
    if not is_root:
        _root_only("output", output, root, base)
    elif output is not None:
        _check_tensor("output", output, written=True)
        _check_scaled("output", output, "tensor", tensor, base.Get_size())
    comm = _collective_comm(comm)
    if _DEBUG:
        _check_same_call(comm, "gather", nonblocking, root=root,
                         dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
    if not is_root:
        (sent,), _, _ = _stage((tensor,), ())
        return _start(comm, "Gather", (_buffer(sent), None, root), (tensor, sent), None, None,
                      nonblocking, ("gather", tensor, "root", root))
    if output is None:
        output = tensor.new_empty((comm.Get_size(), *tensor.shape))
    (sent,), (received,), copy_back = _stage((tensor,), (output,))
    args = (_buffer(sent), _buffer(received, tensor.numel()), root)
    return _start(comm, "Gather", args, (output, tensor, sent, received), output, copy_back,
                  nonblocking, ("gather", tensor, "root", root))


def gather(tensor: torch.Tensor, output: torch.Tensor | None = None, root: int = 0, *,
           comm=None) -> torch.Tensor | None:
    """Gather ``tensor`` from every rank into ``output`` on rank ``root``, rank by rank.

    Args:
        tensor: this rank's contribution (the same number of elements on every rank).
        output: on ``root``, a tensor of ``world size * tensor.numel()`` elements, or None
            for a new one of shape ``(world size, *tensor.shape)``; None on every other rank.
        root: the rank that receives.
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``output`` on ``root``, None elsewhere.
    """
    return _gather(tensor, output, root, comm, False)


def igather(tensor: torch.Tensor, output: torch.Tensor | None = None, root: int = 0, *,
            comm=None) -> Handle:
    """Start ``gather`` without blocking; ``wait()`` returns ``output`` on ``root``, else None."""
    return _gather(tensor, output, root, comm, True)


def _scatter(output, tensor, root, comm, nonblocking):
    _check_tensor("output", output, written=True)
    base = _base(comm)
    _check_root(root, base)
    is_root = base.Get_rank() == root
    if not is_root:
        _root_only("tensor", tensor, root, base)
    elif tensor is None:
        raise ValueError(f"tensor is required on the root (rank {root}): world size "
                         f"({base.Get_size()}) x output.numel() elements to scatter")
    else:
        _check_tensor("tensor", tensor)
        _check_scaled("tensor", tensor, "output", output, base.Get_size())
    comm = _collective_comm(comm)
    if _DEBUG:
        _check_same_call(comm, "scatter", nonblocking, root=root,
                         dtype=_dtype_name(output.dtype), numel=output.numel())
    if not is_root:
        _, (received,), copy_back = _stage((), (output,))
        return _start(comm, "Scatter", (None, _buffer(received), root), (output, received),
                      output, copy_back, nonblocking, ("scatter", output, "root", root))
    (sent,), (received,), copy_back = _stage((tensor,), (output,))
    args = (_buffer(sent, output.numel()), _buffer(received), root)
    return _start(comm, "Scatter", args, (output, tensor, sent, received), output, copy_back,
                  nonblocking, ("scatter", output, "root", root))


def scatter(output: torch.Tensor, tensor: torch.Tensor | None = None, root: int = 0, *,
            comm=None) -> torch.Tensor:
    """Give block ``rank`` of ``tensor`` on rank ``root`` to every rank's ``output``.

    Args:
        output: receives this rank's block (the same number of elements on every rank).
        tensor: on ``root``, ``world size`` blocks of ``output.numel()`` elements in flat
            order; None on every other rank.
        root: the rank that sends.
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``output``.
    """
    return _scatter(output, tensor, root, comm, False)


def iscatter(output: torch.Tensor, tensor: torch.Tensor | None = None, root: int = 0, *,
             comm=None) -> Handle:
    """Start ``scatter`` without blocking."""
    return _scatter(output, tensor, root, comm, True)


def _vbuffer(tensor: torch.Tensor, counts: list[int]):
    """A buffer spec of consecutive blocks of ``counts`` elements, one per rank."""
    displacements = [0, *itertools.accumulate(counts)][:-1]
    return [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes), (counts, displacements),
            _datatype(tensor.dtype)[0]]


def _row_numel(name: str, tensor: torch.Tensor) -> int:
    if tensor.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension to split into rows, "
                         f"got a 0-d tensor")
    return math.prod(tensor.shape[1:])


def _rows_per_rank(name: str, splits, rows: int, size: int) -> list[int]:
    """Check ``splits`` (None: equal) against a tensor of ``rows`` rows; return rows per rank."""
    if splits is None:
        if rows % size:
            raise ValueError(f"{name} is None, so the first dimension must divide by the world "
                             f"size ({size}), got {rows}")
        return [rows // size] * size
    if not isinstance(splits, (list, tuple)) or len(splits) != size:
        raise ValueError(f"{name} must be a list of world size ({size}) row counts, got {splits!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in splits):
        raise ValueError(f"{name} must hold ints >= 0, got {list(splits)}")
    if sum(splits) != rows:
        raise ValueError(f"{name} must add up to the first dimension ({rows}), "
                         f"got {list(splits)} (sum {sum(splits)})")
    return list(splits)


def _check_splits_agree(comm: MPI.Intracomm, receives: list[int], sends: list[int],
                        row_numel: int, dtype: torch.dtype) -> None:
    """Check, on every rank alike, that each rank receives from each what the sender sends.

    MPI requires every receive count to equal the matching send count; a smaller
    one fails on the receiver alone, a larger one leaves garbage unnoticed.
    """
    code = _DTYPES.index(dtype)
    outgoing = np.array([[rows, row_numel, code] for rows in sends], dtype=np.int64)
    incoming = np.empty_like(outgoing)
    comm.Alltoall([outgoing, 3, MPI.INT64_T], [incoming, 3, MPI.INT64_T])
    rank = comm.Get_rank()
    faults = []
    for peer, (rows, peer_row_numel, peer_code) in enumerate(incoming.tolist()):
        if peer_row_numel != row_numel or peer_code != code:
            faults.append(f"rank {peer} sends rows of {peer_row_numel} elements of "
                          f"{_dtype_name(_DTYPES[peer_code])}, rank {rank} receives "
                          f"rows of {row_numel} elements of {_dtype_name(dtype)}")
        elif rows != receives[peer]:
            faults.append(f"rank {peer}'s input_splits[{rank}] is {rows}, rank {rank}'s "
                          f"output_splits[{peer}] is {receives[peer]}")
    count = np.array([len(faults)], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, [count, MPI.INT64_T], MPI.MAX)
    if count[0]:
        faults = [fault for faults_of_rank in comm.allgather(faults) for fault in faults_of_rank]
        more = f" (and {len(faults) - 4} more)" if len(faults) > 4 else ""
        raise ValueError(f"alltoall splits disagree across ranks: {'; '.join(faults[:4])}{more}; "
                         f"each rank's output_splits[j] must equal rank j's input_splits[rank], "
                         f"of rows with the same number of elements and dtype")


def _alltoall(output, tensor, output_splits, input_splits, comm, nonblocking):
    _check_tensor("output", output, written=True)
    _check_tensor("tensor", tensor)
    if output.dtype != tensor.dtype:
        raise TypeError(f"output and tensor must have the same dtype, "
                        f"got {output.dtype} and {tensor.dtype}")
    size = _base(comm).Get_size()
    uneven = output_splits is not None or input_splits is not None
    if uneven:
        row_numel = _row_numel("tensor", tensor)
        if _row_numel("output", output) != row_numel:
            raise ValueError(f"output and tensor must have rows (all dimensions but the first) "
                             f"of the same number of elements, got {_row_numel('output', output)} "
                             f"and {row_numel}")
        receives = _rows_per_rank("output_splits", output_splits, output.shape[0], size)
        sends = _rows_per_rank("input_splits", input_splits, tensor.shape[0], size)
    elif output.numel() != tensor.numel() or tensor.numel() % size:
        raise ValueError(f"without splits, output and tensor must have the same number of "
                         f"elements, divisible by the world size ({size}), got "
                         f"{output.numel()} and {tensor.numel()}")
    comm = _collective_comm(comm)
    if _DEBUG:
        shape = dict(splits="uneven", row_numel=row_numel) if uneven else dict(numel=tensor.numel())
        _check_same_call(comm, "alltoall", nonblocking, dtype=_dtype_name(tensor.dtype), **shape)
    if uneven:
        slot = _watchdog.begin(("alltoall's splits check", tensor))
        try:
            _check_splits_agree(comm, receives, sends, row_numel, tensor.dtype)
        finally:
            slot.current = None
    (sent,), (received,), copy_back = _stage((tensor,), (output,))
    if uneven:
        args = (_vbuffer(sent, [n * row_numel for n in sends]),
                _vbuffer(received, [n * row_numel for n in receives]))
    else:  # mpi4py counts both buffers per rank
        args = (_buffer(sent, tensor.numel() // size), _buffer(received, tensor.numel() // size))
    return _start(comm, "Alltoallv" if uneven else "Alltoall", args,
                  (output, tensor, sent, received), output, copy_back, nonblocking,
                  ("alltoall", tensor))


def alltoall(output: torch.Tensor, tensor: torch.Tensor, output_splits=None, input_splits=None, *,
             comm=None) -> torch.Tensor:
    """Send block ``j`` of ``tensor`` to rank ``j``, receiving block ``j`` of ``output`` from it.

    Like torch's ``all_to_all_single``. Without splits, both tensors are world
    size equal blocks in flat order. With splits, blocks are rows (slices along
    the first dimension), and a None side is world size equal row blocks. The
    splits are checked across ranks before the exchange (a small alltoall and
    an allreduce, blocking even in ``ialltoall``): each rank's
    ``output_splits[j]`` must equal rank ``j``'s ``input_splits[rank]``, or
    every rank raises the same ``ValueError``.

    Args:
        output: receives the blocks, rank by rank.
        tensor: the blocks to send, rank by rank (same dtype as ``output``).
        output_splits: rows to receive from each rank, or None.
        input_splits: rows to send to each rank, or None.
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        ``output``.
    """
    return _alltoall(output, tensor, output_splits, input_splits, comm, False)


def ialltoall(output: torch.Tensor, tensor: torch.Tensor, output_splits=None, input_splits=None,
              *, comm=None) -> Handle:
    """Start ``alltoall`` without blocking (the splits check before it does block)."""
    return _alltoall(output, tensor, output_splits, input_splits, comm, True)


def _allgatherv(tensor, comm, nonblocking):
    _check_tensor("tensor", tensor)
    row_shape = tuple(tensor.shape[1:])
    _row_numel("tensor", tensor)
    comm = _collective_comm(comm)
    dtype = _dtype_name(tensor.dtype)
    if _DEBUG:
        _check_same_call(comm, "allgatherv", nonblocking, dtype=dtype, row_shape=row_shape)
    slot = _watchdog.begin(("allgatherv's shape exchange", tensor))
    try:
        headers = comm.allgather((tensor.shape[0], row_shape, dtype))
    finally:
        slot.current = None
    kinds = [(shape, name) for _, shape, name in headers]
    if kinds.count(kinds[0]) != len(kinds):
        ranks_of: dict[tuple, list[int]] = {}
        for rank, kind in enumerate(kinds):
            ranks_of.setdefault(kind, []).append(rank)
        held = "; ".join(f"{_ranks(ranks)}: rows of shape {shape}, {name}"
                         for (shape, name), ranks in ranks_of.items())
        raise ValueError(f"allgatherv: tensors must have the same dtype and the same shape after "
                         f"the first dimension on every rank, got {held}")
    sizes = [rows for rows, _, _ in headers]
    output = tensor.new_empty((sum(sizes), *row_shape))
    row_numel = math.prod(row_shape)
    (sent,), (received,), copy_back = _stage((tensor,), (output,))
    args = (_buffer(sent), _vbuffer(received, [rows * row_numel for rows in sizes]))
    return _start(comm, "Allgatherv", args, (output, tensor, sent, received), (output, sizes),
                  copy_back, nonblocking, ("allgatherv", tensor))


def allgatherv(tensor: torch.Tensor, *, comm=None) -> tuple[torch.Tensor, list[int]]:
    """Concatenate every rank's ``tensor`` along the first dimension, which may differ by rank.

    Like Horovod's ``allgather``: the other dimensions and the dtype must be the
    same on every rank (checked in the first step, a small allgather of the
    shapes, which blocks even in ``iallgatherv``; a mismatch raises the same
    ``ValueError`` on every rank).

    Args:
        tensor: this rank's rows, at least one dimension.
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        (a new tensor of every rank's rows in rank order, on ``tensor``'s device;
        the number of rows from each rank). ``output.split(sizes)`` gives each rank's.
    """
    return _allgatherv(tensor, comm, False)


def iallgatherv(tensor: torch.Tensor, *, comm=None) -> Handle:
    """Start ``allgatherv`` without blocking; ``wait()`` returns ``(output, sizes)``."""
    return _allgatherv(tensor, comm, True)


def _barrier_comm(comm, nonblocking: bool) -> MPI.Intracomm:
    comm = _collective_comm(comm)
    if _DEBUG:
        _check_same_call(comm, "barrier", nonblocking)
    return comm


def barrier(*, comm=None) -> None:
    """Block until every rank of ``comm`` has entered the barrier."""
    comm = _barrier_comm(comm, False)
    slot = _watchdog.begin("barrier")
    try:
        comm.Barrier()
    finally:
        slot.current = None


def ibarrier(*, comm=None) -> Handle:
    """Start a barrier without blocking."""
    return Handle(_barrier_comm(comm, True).Ibarrier(), (), None, label="barrier")


def _check_peer(name: str, peer, comm: MPI.Intracomm) -> None:
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < comm.Get_size():
        raise ValueError(f"invalid {name} {peer!r}, {name} should be in the interval "
                         f"[0, {comm.Get_size() - 1}]")
    if peer == comm.Get_rank():
        raise ValueError(f"invalid {name} {peer}, {name} should be another rank than this "
                         f"process's own: mpidp refuses messages to oneself (MPI's send to self "
                         f"blocks once the message outgrows the library's eager buffer)")


def _check_tag(tag) -> None:
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise ValueError(f"tag must be an int >= 0, got {tag!r}")


def send(tensor: torch.Tensor, dest: int, tag: int = 0, *, comm=None) -> None:
    """Send ``tensor`` to rank ``dest`` (not this rank), blocking until the buffer may be reused."""
    isend(tensor, dest, tag, comm=comm).wait()


def isend(tensor: torch.Tensor, dest: int, tag: int = 0, *, comm=None) -> Handle:
    """Start sending ``tensor`` to rank ``dest``; the handle keeps ``tensor`` alive."""
    _check_tensor("tensor", tensor)
    _check_peer("dest", dest, _base(comm))
    _check_tag(tag)
    comm = _p2p_comm(comm)
    (staged,), _, _ = _stage((tensor,), ())
    return Handle(comm.Isend(_buffer(staged), dest, tag), (tensor, staged), tensor,
                  label=("send", tensor, "dest", dest, "tag", tag))


class _Receive:
    """A receive request that fills a status, so the message size can be checked."""

    __slots__ = ("request", "status", "tensor")

    def __init__(self, request, tensor):
        self.request = request
        self.status = MPI.Status()
        self.tensor = tensor

    def Wait(self):
        return self._run(self.request.Wait)

    def Test(self):
        return self._run(self.request.Test)

    def _run(self, call):
        try:
            return call(self.status)
        except MPI.Exception as err:
            raise ValueError(self._mismatch("more")) from err

    def check_count(self):
        count = self.status.Get_count(_buffer(self.tensor)[2])
        if count != self.tensor.numel():
            raise ValueError(self._mismatch(count))

    def _mismatch(self, count):
        return (f"recv: tensor has {self.tensor.numel()} elements of {self.tensor.dtype}, "
                f"rank {self.status.Get_source()} sent {count}; sizes must match")


def _irecv(tensor, source, tag, comm) -> tuple[Handle, _Receive]:
    _check_tensor("tensor", tensor, written=True)
    base = _base(comm)
    if source is not None:
        _check_peer("source", source, base)
    elif base.Get_size() == 1:
        raise ValueError("recv from any source (source=None) needs another rank, but comm has "
                         "1 rank and mpidp refuses messages to oneself")
    if tag is not None:
        _check_tag(tag)
    comm = _p2p_comm(comm)
    source = MPI.ANY_SOURCE if source is None else source
    tag = MPI.ANY_TAG if tag is None else tag
    _, (staged,), copy_back = _stage((), (tensor,))
    receive = _Receive(comm.Irecv(_buffer(staged), source, tag), tensor)
    label = ("recv", tensor, "source", "any" if source == MPI.ANY_SOURCE else source)
    finish = _chain(receive.check_count, copy_back)
    return Handle(receive, (tensor, staged), tensor, finish, label), receive


def recv(tensor: torch.Tensor, source: int | None = None, tag: int | None = None, *,
         comm=None) -> int:
    """Receive into ``tensor`` from ``source`` (None: any rank).

    Args:
        tensor: receives the message, which must have exactly its size.
        source: rank to receive from (not this rank), or None for any other.
        tag: message tag, or None for any.
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        The rank the message came from.
    """
    handle, receive = _irecv(tensor, source, tag, comm)
    handle.wait()
    return receive.status.Get_source()


def irecv(tensor: torch.Tensor, source: int | None = None, tag: int | None = None, *,
          comm=None) -> Handle:
    """Start receiving into ``tensor``; ``wait()`` returns ``tensor`` and checks the size."""
    return _irecv(tensor, source, tag, comm)[0]
