"""A ``torch.distributed`` backend over MPI: torch's distributed stack on any MPI, no TCP, no gloo.

Importing mpidp registers the backend ``"mpidp"`` and the rendezvous scheme
``mpidp://`` (both idempotent, no MPI call). Then, under ``mpiexec``/``srun``::

    mpidp.init_process_group()
    # or: torch.distributed.init_process_group("mpidp", init_method="mpidp://")

and every ``torch.distributed`` program (torch's DistributedDataParallel,
FSDP2 ``fully_shard``, ZeroRedundancyOptimizer, DTensor and DeviceMesh, the
distributed checkpoint) talks MPI through ``mpidp.comm``. Rank and size come
from ``MPI.COMM_WORLD``; the store is mpidp's rendezvous store, over MPI by
default (``mpidp.store``, ``mpidp.rendezvous``; ``store="local"``: a
process-local ``HashStore``), so ``TORCH_DIST_INIT_BARRIER=1`` and ``monitored_barrier`` (a
method here; ``mpidp.monitored_barrier`` calls it, as torch's own function is
for gloo alone) work. ``new_group`` builds an MPI sub-communicator of its global
ranks (``MPI_Comm_create_group``, collective over the members only).

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

The backend, one concept a module: ``process_group`` (this one: registration,
rendezvous, the group and how it issues an operation), ``operations`` (each of
torch's collectives and messages as mpidp.comm calls), ``operands`` (tensors as
buffers MPI moves), ``work`` (Works and futures), ``chunks`` (a chunked
all_reduce) and ``progress`` (the progress thread, and the rules all of them
follow).

Reduce ops: SUM, AVG (floating dtypes), PRODUCT, MIN, MAX, BAND/BOR/BXOR (integer
and bool dtypes) and PREMUL_SUM (the factor multiplies this rank's input first).
Dtypes: those of ``mpidp.comm`` for reductions; data movement (broadcast,
gathers, scatters, all-to-all, send/recv) carries any dtype as bytes.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import os
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import communicators as _communicators
from .. import settings
from .. import comm as _comm
from ..comm import pool as _comm_pool
from . import monitor as _monitor
from .. import rendezvous as _rendezvous
from .. import runtime as _runtime
from . import chunks as _chunks
from . import healing as _healing
from . import work as _work
from .operations import Operations
from .progress import progress as _progress
from ..rendezvous import init_process_group  # noqa: F401  (its home before mpidp.rendezvous)

__all__ = ["BACKEND", "ProcessGroupMPIDP", "init_process_group", "register"]

BACKEND = "mpidp"
# the tensors' devices a group moves: CUDA tensors through CUDA-aware MPI or host staging
# (mpidp.cuda); "cpu" first, as torch prefers it for object collectives and barriers
_DEVICES = ("cpu", "cuda")
_SCHEME = _rendezvous.SCHEME

# torch.distributed re-exports a function named rendezvous over the module's name
_rendezvous_module = importlib.import_module("torch.distributed.rendezvous")


# -- registration -----------------------------------------------------------------------------

def register() -> None:
    """Register backend ``"mpidp"`` and rendezvous scheme ``mpidp://`` with torch (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=list(_DEVICES))
    if _SCHEME not in _rendezvous_module._rendezvous_handlers:
        _rendezvous_module.register_rendezvous_handler(_SCHEME, _rendezvous.handler)


# What torch calls on a group and on its Works: run as they are under torch.compile, between
# graphs (dynamo cannot trace into a Python process group: it sees an opaque script object).
_ENTRY_POINTS = tuple(name for name, value in vars(Operations).items()
                      if not name.startswith("_") and callable(value)) + (
    "monitored_barrier", "shutdown", "abort", "_start_coalescing", "_end_coalescing")


_WORK_METHODS = ("wait", "is_completed", "is_success", "exception", "result", "get_future",
                 "source_rank")


def _create(common, options):
    """torch's backend creator: a ProcessGroupMPIDP over the group's MPI sub-communicator."""
    _runtime.require_mpi()
    _runtime.keep_out_of_torch_compile(ProcessGroupMPIDP, _ENTRY_POINTS)
    # what a compiled caller waits on; Done and All hold nothing dynamo cannot trace, and
    # each mark costs a call about 0.4 us (docs/performance-comm.md)
    _runtime.keep_out_of_torch_compile(_work.Work, _WORK_METHODS)
    world = _runtime.world()  # MPI.COMM_WORLD, or its survivors after a heal (.healing)
    members = list(common.global_ranks_in_group)
    if not members:  # the default group
        base = world
        if common.group_size != world.Get_size() or common.group_rank != world.Get_rank():
            raise ValueError(f"the mpidp backend's default group must be mpidp's world "
                             f"(MPI.COMM_WORLD, or its survivors after a heal): torch "
                             f"asked for rank {common.group_rank} of {common.group_size}, MPI "
                             f"gives rank {world.Get_rank()} of {world.Get_size()}")
    else:
        if dist.is_initialized() and dist.get_rank() != world.Get_rank():
            raise ValueError(f"an mpidp group needs torch's global ranks to be MPI's: this "
                             f"process is torch rank {dist.get_rank()}, MPI rank "
                             f"{world.Get_rank()}")
        group = world.Get_group()
        try:
            base = _communicators.made(world.Create_group(group.Incl(members)),
                                       f"torch.distributed group of ranks {members}")
        finally:
            group.Free()
    group = ProcessGroupMPIDP(base, common.group_rank, common.group_size, common.timeout)
    group._store = common.store  # monitored_barrier's (mpidp.process_group.monitor)
    _healing.adopt(group)
    return group


# -- the progress thread: mpidp.process_group.progress ----------------------------------------------------

# MPI moves a nonblocking operation on only inside MPI calls (MPICH, Open MPI without an
# asynchronous progress thread): after a request is added or completes, the progress
# thread tests without sleeping for this long, then backs off (a receive that waits for
# a late message should not keep a core busy).
_progress.spin_seconds = settings.get("MPIDP_PROGRESS_SPIN_MS") / 1e3
# The call check (mpidp.process_group.work.CallCheck) costs a tiny blocking all_reduce about 1.6x (bench/check_cost.py);
# MPIDP_CHECK_CALLS=0 trades it for MPI's undefined behaviour on calls that differ.
_CHECK_CALLS = settings.get("MPIDP_CHECK_CALLS")
atexit.register(_progress.stop)  # after mpi4py's import registered MPI_Finalize: runs before it
os.register_at_fork(after_in_child=_progress.forget_thread)


class _NoExtensions:
    """What ``ProcessGroupMPIDP._get_backend`` answers: none of the optional C++ features."""

    name = BACKEND
    supports_coalescing = supports_splitting = supports_time_estimate = False

    @staticmethod
    def supports_tensor_alloc(device) -> bool:
        return False


# -- the process group ---------------------------------------------------------------------------

class ProcessGroupMPIDP(Operations, dist.ProcessGroup):
    """torch.distributed's process group over an MPI communicator, through ``mpidp.comm``.

    Created by torch (``init_process_group``/``new_group`` with backend "mpidp"),
    not by hand. Its operations (``allreduce`` ... ``recv``) are ``Operations``'
    (``mpidp.process_group.operations``); this class holds the group's communicators, names,
    coalescing, how an operation is issued and becomes a Work, and its lifetime.
    """

    def __init__(self, comm: MPI.Intracomm, rank: int, size: int, timeout=None):
        super().__init__(rank, size)
        if comm.Get_rank() != rank or comm.Get_size() != size:
            raise ValueError(f"the MPI communicator gives rank {comm.Get_rank()} of "
                             f"{comm.Get_size()}, torch asked for rank {rank} of {size}")
        self._mpi = comm
        _chunks.set_burst(_runtime.local_size(), os.cpu_count() or 1)  # collective, cached
        self._pool = _comm.Pool(comm, _comm_pool.env_size())
        self._async = _runtime.thread_level() >= MPI.THREAD_MULTIPLE
        self._name = ""
        self._desc = ""
        self._timeout = timeout
        self._coalesced = None  # between _start_coalescing and _end_coalescing: the Works
        # large all_reduces, chunk by chunk; only the progress thread issues on it (rule 7)
        self._chunk_comm = _communicators.made(comm.Dup(), f"{self!r}: chunks",
                                               "the progress thread")
        self._aborted = None  # why abort() was called
        self._store = None  # torch's store for this group: set by _create

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

    # torch reads a group's devices from the C++ backends registered on it, one per device,
    # and registers none on a group that is its own backend (a Python ProcessGroup), so the
    # list would be empty: broadcast_from_rank0 indexes it (IndexError) and DCP's
    # _get_pg_default_device raises. The group answers register()'s devices, as gloo's does.
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(device) for device in _DEVICES]

    def _start_coalescing(self, device) -> None:
        """torch's ``_coalescing_manager(device=...)``: collect the Works until the end."""
        self._coalesced = []

    def _end_coalescing(self, device):
        works, self._coalesced = self._coalesced or [], None
        return works[0] if len(works) == 1 else _work.All(works)

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        """gloo's ``monitored_barrier`` through the group's store: rank 0 names who is missing."""
        _monitor.run(self, self._store, timeout, wait_all_ranks)

    def __repr__(self) -> str:
        name = f", name={self._name!r}" if self._name else ""
        return f"ProcessGroupMPIDP(rank={self.rank()}, size={self.size()}{name})"

    # -- issuing ---------------------------------------------------------------------------

    def _run(self, opts, start, result, finish=None, check=None):
        return self._record(self._issue(opts, start, result, finish, check))

    def _record(self, work):
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _call_check(self, check, gate: bool = False) -> _work.CallCheck | None:
        """Start the fingerprint check of ``check`` = (call, tensor, op, root); None alone.
        ``gate``: the operation starts only once it agrees, else it started beside it."""
        if check is None or self.size() == 1 or not (_CHECK_CALLS or _comm.checks._DEBUG):
            return None
        return _work.CallCheck(*check, self._pool, None if gate else self._spoilt)

    def _spoilt(self, what: str) -> None:
        """A call that differed across ranks had started in MPI (every rank learns it from the
        same check): what MPI leaves on the group's communicators is undefined, so the group
        takes no more operations, and the progress thread fails its pending ones."""
        if self._aborted is None:
            self._aborted = (f"a call differed across ranks after it had started in MPI ({what}), "
                             f"which leaves the group's communicators undefined; destroy the "
                             f"group and make a new one")

    def _aborted_error(self) -> dist.DistBackendError:
        return dist.DistBackendError(f"mpidp: {self!r} was aborted ({self._aborted}); it takes "
                                     f"no more operations")

    def _issue(self, opts, start, result, finish=None, check=None):
        """Run ``start(nonblocking)`` -> handle(s); return a Work for ``result``.

        Complete on return when the caller asked so or below THREAD_MULTIPLE (the
        blocking MPI call); from a future's callback the progress thread drives it
        (docs/concurrency.md, rule 3). ``check``, (call, tensor, op, root): the call's
        fingerprint is started right after it and tested first (``mpidp.process_group.work.CallCheck``),
        so ranks whose calls differ in element count, dtype, op or root all raise instead
        of MPI truncating quietly.
        """
        self._check_usable()
        if not self._async:
            start(False)  # blocking: a mismatch ends it in the library (runtime's report)
            check = self._call_check(check)
            _work.checked_wait([check.handle] if check else [], check, None, result)
            if finish is not None:
                finish()
            return _work.blocking(result) if not opts.asyncOp else _work.Done(result)
        # MPI never matches a blocking collective with a nonblocking one, and torch issues
        # one call with async_op=True on some ranks, False on others (Join, DDP under join;
        # a then() callback runs inline on one rank, on the progress thread on another):
        # from THREAD_MULTIPLE on, every call starts nonblocking; blocking ones wait here.
        handles = start(True)
        check = self._call_check(check)  # after: an operation that raised took no pool member
        handles = ([check.handle] if check else []) + (
            handles if isinstance(handles, list) else [handles])
        if not opts.asyncOp and not _progress.in_thread():
            deadline = self._deadline()
            try:
                _work.checked_wait(handles, check, deadline, result)
            except TimeoutError:
                work = self._work(handles, result, finish, check=check)
                _progress.expire(work)
                work.wait()  # raises the group's timeout error
            if finish is not None:
                finish()
            return _work.blocking(result)
        work = self._work(handles, result, finish, check=check)
        _progress.add(work)
        if _progress.in_thread():
            work.wait()
            return _work.Done(result) if opts.asyncOp else _work.blocking(result)
        return work

    def _work(self, handles, result, finish=None, **kwargs) -> _work.Work:
        named = handles[1:] if kwargs.get("check") else handles  # the operation, not its check
        label = kwargs.pop("label", None) or (named[0]._label if named else None)
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
            raise self._aborted_error()

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
            _communicators.free(self._chunk_comm)
            if self._mpi not in (MPI.COMM_WORLD, _runtime.world()):  # the default group's
                _communicators.free(self._mpi)

    def abort(self) -> None:
        """Fail every pending operation of the group at once, and every later one (local).

        MPI cannot cancel a collective: the operations' buffers stay referenced
        and the communicators are left as they are. Ending the job (an uncaught
        error does, see mpidp.runtime) is the way on from here.
        """
        if self._aborted is None:
            self._aborted = "abort() was called"
        _progress.abort(self, self._aborted_error())
