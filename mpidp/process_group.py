"""A ``torch.distributed`` backend over MPI: torch's distributed stack on any MPI, no TCP, no gloo.

Importing mpidp registers the backend ``"mpidp"`` and the rendezvous scheme
``mpidp://`` (both idempotent, no MPI call). Then, under ``mpiexec``/``srun``::

    mpidp.init_process_group()
    # or: torch.distributed.init_process_group("mpidp", init_method="mpidp://")

and every ``torch.distributed`` program (torch's DistributedDataParallel,
FSDP2 ``fully_shard``, ZeroRedundancyOptimizer, DTensor and DeviceMesh, the
distributed checkpoint) talks MPI through ``mpidp.comm``. Rank and size come
from ``MPI.COMM_WORLD``; the store is a process-local ``HashStore`` (no
MASTER_ADDR), so torch features that exchange data through the store across
ranks (``TORCH_DIST_INIT_BARRIER=1``, gloo's ``monitored_barrier``) are not
available. ``new_group`` builds an MPI sub-communicator of its global ranks
(``MPI_Comm_create_group``, collective over the members only).

Each group owns a ``mpidp.comm.Pool`` of duplicated communicators
(``MPIDP_POOL_SIZE``, default 2): several collectives progress at once, and
torch's traffic never mixes with mpidp's own. Every call starts MPI's nonblocking
operation on the calling thread (so every rank issues in its own program order;
MPI never matches a blocking collective with a nonblocking one, and torch may
call one collective blocking on some ranks, async on others). A blocking call
(``async_op=False``) waits for it and returns; an asynchronous one returns a
``Work`` at once; a progress thread tests the pending requests and
completes their futures (torch's DDP waits on futures, never calls ``wait()``),
per group in issue order, so callbacks chained with ``then`` run in that order.
An all_reduce over ``MPIDP_CHUNK_MB`` (4) goes chunk by chunk on a communicator of
its own, in the group's order, run by the progress thread for an async call.
The progress thread calls MPI while the program's threads do, which needs
``MPI_THREAD_MULTIPLE``; below it, every call completes before it returns.
A collective issued from a future's callback (PowerSGD's hook does it) completes
on the progress thread before the callback goes on; its place in the group's
order is decided by when the callback runs, as with gloo's worker threads, so
such a hook must not race collectives of the main thread on the same group (one
DDP bucket is safe).

Reduce ops: SUM, AVG (floating dtypes), PRODUCT, MIN, MAX, BAND/BOR/BXOR (integer
and bool dtypes) and PREMUL_SUM (the factor multiplies this rank's input first).
Dtypes: those of ``mpidp.comm`` for reductions; data movement (broadcast,
gathers, scatters, all-to-all, send/recv) carries any dtype as bytes.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import importlib
import os
import time
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed import ReduceOp

from . import _env
from . import comm as _comm
from . import cuda as _cuda
from . import runtime as _runtime
from . import work as _work

__all__ = ["BACKEND", "ProcessGroupMPIDP", "init_process_group", "register"]

BACKEND = "mpidp"
_SCHEME = "mpidp"

_c10d = torch._C._distributed_c10d  # the *Options classes (some not re-exported by dist)

# torch.distributed re-exports a function named rendezvous over the module's name
_rendezvous_module = importlib.import_module("torch.distributed.rendezvous")

# torch's reduce op -> mpidp.comm's, keyed by the enum's value (hashing the enum costs
# a microsecond, a noticeable share of a small all_reduce)
_OPS = {int(op): name for op, name in (
    (ReduceOp.SUM, "sum"), (ReduceOp.AVG, "avg"), (ReduceOp.PRODUCT, "prod"),
    (ReduceOp.MIN, "min"), (ReduceOp.MAX, "max"), (ReduceOp.BAND, "band"),
    (ReduceOp.BOR, "bor"), (ReduceOp.BXOR, "bxor"), (ReduceOp.PREMUL_SUM, "premul_sum"))}


# -- registration -----------------------------------------------------------------------------

def register() -> None:
    """Register backend ``"mpidp"`` and rendezvous scheme ``mpidp://`` with torch (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    if _SCHEME not in _rendezvous_module._rendezvous_handlers:
        _rendezvous_module.register_rendezvous_handler(_SCHEME, _rendezvous)


def init_process_group(**kwargs) -> None:
    """``torch.distributed.init_process_group`` with backend "mpidp" and rendezvous ``mpidp://``.

    Args:
        **kwargs: passed on (``timeout``, ``group_name``, ``pg_options``, ...); ``rank``
            and ``world_size`` may be given and must equal MPI's.
    """
    for name, value in (("backend", BACKEND), ("init_method", f"{_SCHEME}://")):
        if kwargs.setdefault(name, value) != value:
            raise ValueError(f"mpidp.init_process_group: {name} must be {value!r} (or left out), "
                             f"got {kwargs[name]!r}")
    register()
    dist.init_process_group(**kwargs)


def _rendezvous(url: str, timeout=None, **kwargs):
    """``mpidp://``: rank and size from MPI.COMM_WORLD, a process-local store."""
    _runtime.require_mpi()
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query).items()}
    for name, actual in (("rank", rank), ("world_size", size)):
        if name in query and int(query[name]) not in (-1, actual):
            raise ValueError(f"init_process_group: {name}={query[name]} disagrees with MPI, "
                             f"which gives this process {name} {actual}; leave {name} out "
                             f"with init_method='mpidp://'")
    store = dist.HashStore()
    if timeout is not None:
        store.set_timeout(timeout)
    yield store, rank, size
    raise RuntimeError("the mpidp:// rendezvous cannot be repeated: MPI's ranks are fixed")


def _create(common, options):
    """torch's backend creator: a ProcessGroupMPIDP over the group's MPI sub-communicator."""
    _runtime.require_mpi()
    world = MPI.COMM_WORLD
    members = list(common.global_ranks_in_group)
    if not members:  # the default group
        base = world
        if common.group_size != world.Get_size() or common.group_rank != world.Get_rank():
            raise ValueError(f"the mpidp backend's default group must be MPI.COMM_WORLD: torch "
                             f"asked for rank {common.group_rank} of {common.group_size}, MPI "
                             f"gives rank {world.Get_rank()} of {world.Get_size()}")
    else:
        if dist.is_initialized() and dist.get_rank() != world.Get_rank():
            raise ValueError(f"an mpidp group needs torch's global ranks to be MPI's: this "
                             f"process is torch rank {dist.get_rank()}, MPI rank "
                             f"{world.Get_rank()}")
        group = world.Get_group()
        try:
            base = world.Create_group(group.Incl(members))
        finally:
            group.Free()
    return ProcessGroupMPIDP(base, common.group_rank, common.group_size, common.timeout)


# -- work and its progress: mpidp.work ------------------------------------------------------

# An all_reduce larger than this goes chunk by chunk (see ProcessGroupMPIDP.allreduce).
_CHUNK_BYTES = int(_env.number("MPIDP_CHUNK_MB", 4, minimum=0.001) * (1 << 20))
# MPI moves a nonblocking operation on only inside MPI calls (MPICH, Open MPI without an
# asynchronous progress thread): after a request is added or completes, the progress
# thread tests without sleeping for this long, then backs off (a receive that waits for
# a late message should not keep a core busy).
_progress = _work.progress
_progress.spin_seconds = _env.number("MPIDP_PROGRESS_SPIN_MS", 10, minimum=0) / 1e3
atexit.register(_progress.stop)  # after mpi4py's import registered MPI_Finalize: runs before it
os.register_at_fork(after_in_child=lambda: setattr(_progress, "_thread", None))


class _NoExtensions:
    """What ``ProcessGroupMPIDP._get_backend`` answers: none of the optional C++ features."""

    name = BACKEND
    supports_coalescing = supports_splitting = supports_time_estimate = False

    @staticmethod
    def supports_tensor_alloc(device) -> bool:
        return False


# -- the process group ---------------------------------------------------------------------------

def _as_moved(tensor: torch.Tensor) -> torch.Tensor:
    """A view of ``tensor`` that mpidp.comm can move: complex as real, other dtypes as bytes."""
    if tensor.is_complex():
        return torch.view_as_real(tensor)
    if tensor.dtype in _comm._DATATYPES:
        return tensor
    if not tensor.is_contiguous():
        raise TypeError(f"a non-contiguous tensor of dtype {tensor.dtype} cannot be moved "
                        f"(mpidp moves it as bytes); pass a contiguous tensor")
    # a trailing dimension of bytes: rows stay rows (all_to_all_single's splits), 0-d works
    return tensor.unsqueeze(-1).view(torch.uint8)


def _one(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{what}: the mpidp backend takes one tensor per call (one device per "
                         f"rank), got {len(tensors)}")
    # as with gloo and NCCL, a tensor that requires grad is communicated (outside autograd)
    tensor = tensors[0]
    return tensor.detach() if isinstance(tensor, torch.Tensor) and tensor.requires_grad else tensor


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """As with gloo and NCCL, a tensor that requires grad is communicated (outside autograd)."""
    return tensor.detach() if tensor.requires_grad else tensor


def _flat(tensors) -> torch.Tensor:
    """One contiguous tensor holding ``tensors`` one after the other."""
    return torch.cat([_detached(t).reshape(-1) for t in tensors]) if len(tensors) > 1 else \
        _detached(tensors[0]).reshape(-1).contiguous()


def _check_same_sizes(name: str, tensors, numel: int) -> None:
    sizes = [t.numel() for t in tensors]
    if any(n != numel for n in sizes):
        raise ValueError(f"{name}: every tensor must have {numel} elements (the mpidp backend "
                         f"needs equal sizes), got {sizes}")


def _check_dtypes(name: str, tensors, dtype: torch.dtype) -> None:
    bad = sorted({str(t.dtype) for t in tensors if t.dtype != dtype})
    if bad:
        raise TypeError(f"{name}: every tensor must have dtype {dtype}, got {', '.join(bad)}")


def _unpack(flat: torch.Tensor, outputs):
    """A step that copies consecutive blocks of ``flat`` into ``outputs``."""
    def copy():
        offset = 0
        for out in outputs:
            n = out.numel()
            out.copy_(flat[offset:offset + n].view_as(out))
            offset += n
    return copy


def _chain(*steps):
    steps = [s for s in steps if s is not None]
    if not steps:
        return None
    if len(steps) == 1:
        return steps[0]

    def run():
        for step in steps:
            step()
    return run


class ProcessGroupMPIDP(dist.ProcessGroup):
    """torch.distributed's process group over an MPI communicator, through ``mpidp.comm``.

    Created by torch (``init_process_group``/``new_group`` with backend "mpidp"),
    not by hand.
    """

    def __init__(self, comm: MPI.Intracomm, rank: int, size: int, timeout=None):
        super().__init__(rank, size)
        if comm.Get_rank() != rank or comm.Get_size() != size:
            raise ValueError(f"the MPI communicator gives rank {comm.Get_rank()} of "
                             f"{comm.Get_size()}, torch asked for rank {rank} of {size}")
        self._mpi = comm
        self._pool = _comm.Pool(comm, int(_env.number("MPIDP_POOL_SIZE", 2, minimum=1,
                                                      integer=True)))
        self._async = _runtime.thread_level() >= MPI.THREAD_MULTIPLE
        self._name = ""
        self._desc = ""
        self._timeout = timeout
        self._coalesced = None  # between _start_coalescing and _end_coalescing: the Works
        self._chunk_comm = comm.Dup()  # large allreduces, chunk by chunk (see allreduce)
        self._aborted = None  # why abort() was called

    # names torch and its functional collectives look up
    def getBackendName(self) -> str:
        return BACKEND

    name = getBackendName

    def _set_group_name(self, name: str) -> None:
        self._name = name

    setGroupName = _set_group_name

    def getGroupName(self) -> str:
        return self._name

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    setGroupDesc = _set_group_desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def group_desc(self) -> str:
        return self._desc

    # torch asks a group for its C++ backend per device (coalescing, splitting, time
    # estimates, FSDP's allocator); this group is its own backend and supports none of it.
    def _get_backend(self, device=None):
        return _NoExtensions

    def _start_coalescing(self, device) -> None:
        """torch's ``_coalescing_manager(device=...)``: collect the Works until the end."""
        self._coalesced = []

    def _end_coalescing(self, device):
        works, self._coalesced = self._coalesced or [], None
        return works[0] if len(works) == 1 else _work.All(works)

    def __repr__(self) -> str:
        name = f", name={self._name!r}" if self._name else ""
        return f"ProcessGroupMPIDP(rank={self.rank()}, size={self.size()}{name})"

    # -- issuing ---------------------------------------------------------------------------

    def _run(self, opts, start, result, finish=None):
        return self._record(self._issue(opts, start, result, finish))

    def _record(self, work):
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _issue(self, opts, start, result, finish=None):
        """Run ``start(nonblocking)`` -> handle(s); return a Work for ``result``.

        Complete on return when the caller asked so or below THREAD_MULTIPLE (the
        blocking MPI call); from a future's callback the progress thread drives it
        (mpidp.work, rule 4).
        """
        self._check_usable()
        if not self._async:
            start(False)
            if finish is not None:
                finish()
            return _work.blocking(result) if not opts.asyncOp else _work.Done(result)
        # MPI never matches a blocking collective with a nonblocking one, and torch issues
        # one call with async_op=True on some ranks, False on others (Join, DDP under join;
        # a then() callback runs inline on one rank, on the progress thread on another):
        # from THREAD_MULTIPLE on, every call starts nonblocking; blocking ones wait here.
        handles = start(True)
        handles = handles if isinstance(handles, list) else [handles]
        if not opts.asyncOp and not _progress.in_thread():
            deadline = self._deadline()
            try:
                for handle in handles:
                    _work.wait_request(handle, deadline)
            except TimeoutError:
                work = self._work(handles, result, finish)
                _progress.expire(work)
                work.wait()  # raises the group's timeout error
            if finish is not None:
                finish()
            return _work.blocking(result)
        work = self._work(handles, result, finish)
        _progress.add(work)
        if _progress.in_thread():
            work.wait()
            return _work.Done(result) if opts.asyncOp else _work.blocking(result)
        return work

    def _work(self, handles, result, finish=None, **kwargs) -> _work.Work:
        label = kwargs.pop("label", None) or (handles[0]._label if handles else None)
        return _work.Work(handles, result, finish=finish, group=self, label=label,
                          deadline=self._deadline(), **kwargs)

    def _deadline(self) -> float | None:
        seconds = self.timeout_seconds()
        return time.monotonic() + seconds if seconds > 0 else None

    def timeout_seconds(self) -> float:
        """The group's timeout (``init_process_group``/``new_group``'s), in seconds; 0: none."""
        timeout = self._timeout
        return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0.0

    def _check_usable(self) -> None:
        if self._aborted is not None:
            raise dist.DistBackendError(f"mpidp: {self!r} was aborted ({self._aborted}); "
                                        f"it takes no more operations")

    def _op(self, opts, tensor: torch.Tensor) -> str:
        op = opts.reduceOp  # a fresh copy at each read: read once
        kind = op.op
        name = _OPS.get(int(kind))
        if name is None:
            raise ValueError(f"reduce op {kind} is not supported by the mpidp backend")
        if name == "premul_sum":  # scale this rank's input, then sum
            if not tensor.is_floating_point():
                raise TypeError(f"reduce op PREMUL_SUM needs a floating-point dtype, got "
                                f"{tensor.dtype}")
            factor = op.factor
            tensor.mul_(factor.to(tensor.device) if isinstance(factor, torch.Tensor) else factor)
            return "sum"
        return name

    # -- collectives -------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else _c10d.AllreduceOptions()
        tensor = _one(tensors, "allreduce")
        op = self._op(opts, tensor)
        if tensor.nbytes <= _CHUNK_BYTES:
            return self._run(opts, lambda nb: (_comm.iallreduce if nb else _comm.allreduce)(
                tensor, op, comm=self._pool), [tensor])
        # MPI's shared-memory bandwidth drops once a message leaves the cache: reduce a
        # large tensor (one DDP bucket may hold 100 MB) in chunks, one after the other,
        # as mpidp.DistributedDataParallel does (4 MiB measured best there), on the
        # group's chunk communicator (mpidp.work, rule 3). The size alone decides, so
        # every rank takes the same path. The tensor is staged once (rule 6 of mpidp.work):
        # device memory the library cannot read is copied to pinned host memory by the
        # progress thread on a side stream ordered after the caller's (an event, so the
        # caller, often autograd's thread, returns at once); otherwise comm._stage on the
        # calling thread (a non-contiguous tensor through a contiguous copy). Chunks then
        # move host memory only; the copy back runs in finish, and wait() orders the
        # waiting stream after it (Work._record_events).
        self._check_usable()
        if tensor.is_cuda and not _cuda.cuda_aware() and self._async:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
            chunks = _work.Chunks(host, op, self._chunk_comm, _CHUNK_BYTES,
                                  stage_from=(tensor, ready))
            finish = lambda: tensor.copy_(host, non_blocking=True)  # noqa: E731
        else:
            _, (staged,), finish = _comm._stage((tensor,), (tensor,))
            chunks = _work.Chunks(staged, op, self._chunk_comm, _CHUNK_BYTES)
        if not self._async:
            chunks.run()
            if finish is not None:
                finish()
            return self._record(_work.Done([tensor]) if opts.asyncOp else _work.blocking([tensor]))
        work = self._work([], [tensor], finish, chunks=chunks,
                          label=("allreduce in chunks", tensor, "op", op))
        _progress.add(work)
        if not opts.asyncOp or _progress.in_thread():
            work.wait()
            return self._record(_work.Done([tensor]) if opts.asyncOp else _work.blocking([tensor]))
        return self._record(work)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else _c10d.AllreduceCoalescedOptions()
        tensors = list(tensors)
        if not tensors:
            return _work.Done([])
        _check_dtypes("allreduce_coalesced", tensors, tensors[0].dtype)
        flat = _flat(tensors)
        op = self._op(opts, flat)
        return self._run(opts, lambda nb: (_comm.iallreduce if nb else _comm.allreduce)(
            flat, op, comm=self._pool), tensors, _unpack(flat, tensors))

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else _c10d.BroadcastOptions()
        tensor = _one(tensors, "broadcast")
        moved = _as_moved(tensor)
        root = opts.rootRank
        return self._run(opts, lambda nb: (_comm.ibroadcast if nb else _comm.broadcast)(
            moved, root, comm=self._pool), [tensor])

    def _allgather_flat(self, opts, output, tensor, result, finish=None):
        out, inp = _as_moved(_detached(output)), _as_moved(_detached(tensor))
        return self._run(opts, lambda nb: (_comm.iallgather if nb else _comm.allgather)(
            out, inp, comm=self._pool), result, finish)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        tensor = _one(inputs, "allgather")
        outputs = _one(output_lists, "allgather")
        if len(outputs) != self.size():
            raise ValueError(f"all_gather: tensor_list must have world size ({self.size()}) "
                             f"tensors, got {len(outputs)}")
        _check_same_sizes("all_gather: tensor_list", outputs, tensor.numel())
        _check_dtypes("all_gather: tensor_list", outputs, tensor.dtype)
        flat = tensor.new_empty((self.size() * tensor.numel(),))
        return self._allgather_flat(opts, flat, tensor, list(outputs), _unpack(flat, outputs))

    def _allgather_base(self, output, tensor, opts=None):
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        if output.dtype != tensor.dtype:
            raise TypeError(f"all_gather_into_tensor: output and input must have the same dtype, "
                            f"got {output.dtype} and {tensor.dtype}")
        if output.is_contiguous():
            return self._allgather_flat(opts, output, tensor, [output])
        flat = output.new_empty(output.shape)  # the comm layer stages it; keep the alias rule
        return self._allgather_flat(opts, flat, tensor, [output], lambda: output.copy_(flat))

    all_gather_single = _allgather_base

    def _many(self, opts, calls, result, finish=None):
        """Coalesced calls: each ``call(nonblocking)`` returns a handle; one Work for all."""
        def start(nb):
            handles = [call(nb) for call in calls]
            return handles if nb else None
        return self._run(opts, start, result, finish)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        if len(output_lists) != len(inputs):
            raise ValueError(f"all_gather_coalesced: {len(output_lists)} output lists for "
                             f"{len(inputs)} inputs")
        calls, steps = [], []
        for outputs, tensor in zip(output_lists, inputs):
            if len(outputs) != self.size():
                raise ValueError(f"all_gather_coalesced: each output list must have world size "
                                 f"({self.size()}) tensors, got {len(outputs)}")
            _check_same_sizes("all_gather_coalesced", outputs, tensor.numel())
            _check_dtypes("all_gather_coalesced", outputs, tensor.dtype)
            flat = tensor.new_empty((self.size() * tensor.numel(),))
            calls.append(functools.partial(_gather_call, _as_moved(flat), _as_moved(tensor),
                                           self._pool))
            steps.append(_unpack(flat, outputs))
        return self._many(opts, calls, [t for outs in output_lists for t in outs],
                          _chain(*steps))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        for out, tensor in zip(outputs, inputs):
            if out.dtype != tensor.dtype or not out.is_contiguous():
                raise ValueError("all_gather_into_tensor (coalesced): outputs must be contiguous "
                                 "and of their input's dtype")
        calls = [functools.partial(_gather_call, _as_moved(o), _as_moved(t), self._pool)
                 for o, t in zip(outputs, inputs)]
        return self._many(opts, calls, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        output = _one(outputs, "reduce_scatter")
        inputs = _one(input_lists, "reduce_scatter")
        if len(inputs) != self.size():
            raise ValueError(f"reduce_scatter: input_list must have world size ({self.size()}) "
                             f"tensors, got {len(inputs)}")
        _check_same_sizes("reduce_scatter: input_list", inputs, output.numel())
        _check_dtypes("reduce_scatter: input_list", inputs, output.dtype)
        flat = _flat(inputs)
        if len(inputs) == 1 and opts.reduceOp.op == ReduceOp.PREMUL_SUM:
            flat = flat.clone()  # a view of the input, which PREMUL_SUM's factor must not touch
        op = self._op(opts, flat)
        return self._run(opts, lambda nb: (_comm.ireduce_scatter if nb else _comm.reduce_scatter)(
            output, flat, op, comm=self._pool), [output])

    def _reduce_scatter_base(self, output, tensor, opts=None):
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        output, tensor = _detached(output), _detached(tensor)
        if _comm._overlap(output, tensor) or opts.reduceOp.op == ReduceOp.PREMUL_SUM:
            tensor = tensor.clone()  # PREMUL_SUM scales it: the caller's input stays as it was
        op = self._op(opts, tensor)
        return self._run(opts, lambda nb: (_comm.ireduce_scatter if nb else _comm.reduce_scatter)(
            output, tensor, op, comm=self._pool), [output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        premul = opts.reduceOp.op == ReduceOp.PREMUL_SUM  # scales the input: work on a copy
        inputs = [t.clone() if premul or _comm._overlap(o, t) else t
                  for o, t in zip(outputs, inputs)]
        ops = [self._op(opts, t) for t in inputs]
        calls = [functools.partial(_reduce_scatter_call, o, t, op, self._pool)
                 for o, t, op in zip(outputs, inputs, ops)]
        return self._many(opts, calls, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, tensor, output_splits, input_splits, opts=None):
        opts = opts if opts is not None else _c10d.AllToAllOptions()
        out, inp = _as_moved(_detached(output)), _as_moved(_detached(tensor))
        if _comm._overlap(out, inp):  # in place: MPI forbids aliased buffers
            inp = inp.clone()
        if out.dtype != inp.dtype:
            raise TypeError(f"all_to_all_single: output and input must have the same dtype, got "
                            f"{output.dtype} and {tensor.dtype}")
        outs = list(output_splits) or None
        ins = list(input_splits) or None
        return self._run(opts, lambda nb: (_comm.ialltoall if nb else _comm.alltoall)(
            out, inp, outs, ins, comm=self._pool), [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _c10d.AllToAllOptions()
        for name, tensors in (("output_tensor_list", outputs), ("input_tensor_list", inputs)):
            if len(tensors) != self.size():
                raise ValueError(f"all_to_all: {name} must have world size ({self.size()}) "
                                 f"tensors, got {len(tensors)}")
        _check_dtypes("all_to_all", list(outputs) + list(inputs), inputs[0].dtype)
        sent = _flat(inputs)
        received = sent.new_empty((sum(t.numel() for t in outputs),))
        moved_in, moved_out = _as_moved(sent).reshape(-1), _as_moved(received).reshape(-1)
        scale = moved_in.numel() // sent.numel() if sent.numel() else 1  # bytes, complex halves
        splits_in = [t.numel() * scale for t in inputs]
        splits_out = [t.numel() * scale for t in outputs]
        return self._run(opts, lambda nb: (_comm.ialltoall if nb else _comm.alltoall)(
            moved_out, moved_in, splits_out, splits_in, comm=self._pool), list(outputs),
            _unpack(received, outputs))

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else _c10d.ReduceOptions()
        tensor = _one(tensors, "reduce")
        root = opts.rootRank
        # PREMUL_SUM scales the input: a sender's tensor stays as it was, as with other ops
        sent = tensor.clone() if opts.reduceOp.op == ReduceOp.PREMUL_SUM and \
            self.rank() != root else tensor
        op = self._op(opts, sent)
        return self._run(opts, lambda nb: (_comm.ireduce if nb else _comm.reduce)(
            sent, root, op, comm=self._pool), [tensor])

    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else _c10d.GatherOptions()
        tensor = _one(inputs, "gather")
        root = opts.rootRank
        if self.rank() != root:
            if output_lists and len(output_lists[0]):
                raise ValueError(f"gather: gather_list must be empty on ranks other than the "
                                 f"destination ({root})")
            moved = _as_moved(tensor)
            return self._run(opts, lambda nb: (_comm.igather if nb else _comm.gather)(
                moved, None, root, comm=self._pool), [])
        outputs = _one(output_lists, "gather")
        if len(outputs) != self.size():
            raise ValueError(f"gather: gather_list must have world size ({self.size()}) "
                             f"tensors on the destination, got {len(outputs)}")
        _check_same_sizes("gather: gather_list", outputs, tensor.numel())
        _check_dtypes("gather: gather_list", outputs, tensor.dtype)
        moved = _as_moved(tensor)
        flat = tensor.new_empty((self.size() * tensor.numel(),))
        return self._run(opts, lambda nb: (_comm.igather if nb else _comm.gather)(
            moved, _as_moved(flat), root, comm=self._pool), list(outputs), _unpack(flat, outputs))

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else _c10d.ScatterOptions()
        output = _one(outputs, "scatter")
        root = opts.rootRank
        moved_out = _as_moved(output)
        if self.rank() != root:
            if input_lists and len(input_lists[0]):
                raise ValueError(f"scatter: scatter_list must be empty on ranks other than the "
                                 f"source ({root})")
            flat = None
        else:
            inputs = _one(input_lists, "scatter")
            if len(inputs) != self.size():
                raise ValueError(f"scatter: scatter_list must have world size ({self.size()}) "
                                 f"tensors on the source, got {len(inputs)}")
            _check_same_sizes("scatter: scatter_list", inputs, output.numel())
            _check_dtypes("scatter: scatter_list", inputs, output.dtype)
            flat = _as_moved(_flat(inputs)).reshape(-1)
        target = moved_out if moved_out.is_contiguous() else moved_out.contiguous()
        finish = None if target is moved_out else (lambda: moved_out.copy_(target))
        return self._run(opts, lambda nb: (_comm.iscatter if nb else _comm.scatter)(
            target.reshape(-1), flat, root, comm=self._pool), [output], finish)

    def barrier(self, opts=None):
        opts = opts if opts is not None else _c10d.BarrierOptions()
        return self._run(opts, lambda nb: _comm.ibarrier(comm=self._pool) if nb else
                         _comm.barrier(comm=self._pool), [])

    # -- point to point (first member of the pool: ordered between two ranks) ----------------

    def send(self, tensors, dst: int, tag: int):
        tensor = _one(tensors, "send")
        moved = _as_moved(tensor)
        self._check_usable()
        handle = _comm.isend(moved, dst, tag, comm=self._pool)
        work = self._work([handle], [tensor], ordered=False)
        if self._async:  # else wait() or is_completed() on the program's thread completes it
            _progress.add(work)
        return work

    def recv(self, tensors, src: int, tag: int):
        return self._receive(tensors, src, tag, "recv")

    def recv_anysource(self, tensors, tag: int):
        return self._receive(tensors, None, tag, "recv_anysource")

    def _receive(self, tensors, src, tag, what):
        tensor = _one(tensors, what)
        moved = _as_moved(tensor)
        self._check_usable()
        handle, receive = _comm._irecv(moved, src, tag, self._pool)
        work = self._work([handle], [tensor], ordered=False, source=receive)
        if self._async:  # else wait() or is_completed() on the program's thread completes it
            _progress.add(work)
        return work

    # -- lifetime ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish the group's pending operations, then free its communicators (collective).

        torch's destroy_process_group calls it on every rank. After ``abort()``
        nothing is freed: MPI may still be working on the aborted operations.
        """
        if self._aborted is not None:
            return
        deadline = self._deadline()
        while _progress.busy(self):
            if deadline is not None and time.monotonic() > deadline:
                raise dist.DistBackendError(f"mpidp: {self!r} could not shut down: operations "
                                            f"were still pending after the group's timeout")
            time.sleep(1e-4)
        if self._pool.comms:
            self._pool.free()
            self._chunk_comm.Free()
            if self._mpi != MPI.COMM_WORLD:
                self._mpi.Free()

    def abort(self) -> None:
        """Fail every pending operation of the group at once, and every later one (local).

        MPI cannot cancel a collective: the operations' buffers stay referenced
        and the communicators are left as they are. Ending the job (an uncaught
        error does, see mpidp.runtime) is the way on from here.
        """
        if self._aborted is None:
            self._aborted = "abort() was called"
        _progress.abort(self, dist.DistBackendError(f"mpidp: {self!r} was aborted"))


def _gather_call(output, tensor, pool, nonblocking):
    return (_comm.iallgather if nonblocking else _comm.allgather)(output, tensor, comm=pool)


def _reduce_scatter_call(output, tensor, op, pool, nonblocking):
    return (_comm.ireduce_scatter if nonblocking else _comm.reduce_scatter)(
        output, tensor, op, comm=pool)
