"""How bucket allreduces run alongside the backward pass.

The reducer hands each ready bucket to one of these strategies, in bucket
order, and calls ``finish()`` at the end of the backward pass. ``start(buffer,
divisor)`` allreduces the buffer; with ``pairs`` (ZeRO stage 2) it
reduce-scatters each (input chunk, output shard) pair instead:

| name          | how                                                | pays off when                                   |
|---------------|----------------------------------------------------|-------------------------------------------------|
| "inline"      | blocking collectives in the hook, as soon as a     | every core computes (CPU training): nothing can |
| (default)     | bucket is ready, while its gradients are in cache  | hide the copy work, so the fastest algorithm    |
|               |                                                    | and the warmest cache win                       |
| "thread"      | a communication thread runs blocking collectives   | ranks have idle cores for the thread            |
| "nonblocking" | nonblocking MPI collectives, progressed by the     | the MPI library progresses them well (network   |
|               | hooks polling the oldest request                   | offload, asynchronous progress)                 |

With every core computing, a communication thread only adds scheduling jitter,
and MPICH's nonblocking allreduce moves data more slowly than its blocking one:
"inline" beat both on CPU (docs/performance-ddp.md, the sweeps), so it is the
default there.

Buffers larger than ``chunk_bytes`` are reduced in chunks: MPI shared-memory
bandwidth falls once a message no longer fits the cache. ``start(buffer,
divisor)`` divides each chunk just before reducing it, while it is in cache,
instead of sweeping the whole buffer first.
"""

from __future__ import annotations

import queue
import threading

import torch
from mpi4py import MPI

from .. import comm as _comm
from ..comm import chunking as _chunking
from ..comm import progress as _engine
from ..comm import staging as _staging
from .. import cuda as _cuda
from .. import runtime
from .. import watchdog as _watchdog

__all__ = ["STRATEGIES", "make"]


class _Strategy:
    def __init__(self, pool: _comm.Pool, chunk_bytes: int):
        self.pool = pool
        self.chunk_bytes = chunk_bytes
        self.window = None  # an mpidp.comm.shm.Window: buffers in it are reduced there, blocking

    def _pieces(self, buffer: torch.Tensor, divisor: int):
        return _chunking.pieces(buffer, self.chunk_bytes, divisor)

    def _each(self, buffer, divisor, pairs, allreduce, reduce_scatter) -> list:
        # pairs: (input chunk, output) of a reduce-scatter per chunk (ZeRO stage 2)
        if pairs is None and self.window is not None and self.window.holds(buffer):
            self.window.allreduce(buffer, divisor)
            return []
        if pairs is None:
            return [allreduce(piece, "sum", comm=self.pool)
                    for piece in self._pieces(buffer, divisor)]
        return [reduce_scatter(output, piece, "sum", comm=self.pool) for piece, output in pairs]

    def poll(self) -> None:
        """Let in-flight work progress (called from every gradient hook)."""

    def close(self) -> None:
        """Release resources (threads)."""


class NonblockingStrategy(_Strategy):
    """Nonblocking collectives, progressed by polling from the autograd hooks.

    It decides only when the engine (``mpidp.comm.progress``) tests them: the oldest at
    every hook, all of them at ``finish``.
    """

    def __init__(self, pool, chunk_bytes):
        super().__init__(pool, chunk_bytes)
        self._handles: list[_comm.Handle] = []
        self._oldest = 0

    def start(self, buffer: torch.Tensor, divisor: int = 1, pairs=None) -> None:
        self._handles.extend(self._each(buffer, divisor, pairs,
                                        _comm.iallreduce, _comm.ireduce_scatter))

    def poll(self) -> None:
        # MPI progresses every pending request in any test call; testing the
        # oldest is enough and costs well under a microsecond.
        while self._oldest < len(self._handles) and _engine.test(self._handles[self._oldest]):
            self._oldest += 1

    def finish(self) -> None:
        _engine.wait_all(self._handles[self._oldest:])
        self._handles, self._oldest = [], 0


class InlineStrategy(_Strategy):
    """Blocking collectives issued from the hook as soon as a bucket is ready ("inline")."""

    def start(self, buffer: torch.Tensor, divisor: int = 1, pairs=None) -> None:
        self._each(buffer, divisor, pairs, _comm.allreduce, _comm.reduce_scatter)

    def finish(self) -> None:
        pass


class ThreadStrategy(_Strategy):
    """A communication thread runs blocking collectives on ready buckets, in order.

    For CUDA buffers the thread works on a side stream that first waits for an
    event recorded on the producing stream when the bucket was handed over, so
    the training stream goes on queueing the backward pass meanwhile; ``finish``
    makes the training stream wait for the side stream.
    """

    def __init__(self, pool, chunk_bytes):
        super().__init__(pool, chunk_bytes)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._thread = threading.Thread(target=self._run, name="mpidp-comm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        slot = _watchdog.slot()
        while (item := self._queue.get()) is not None:
            try:
                if self._error is None:
                    # A stall report names the bucket and the training thread's call site.
                    *work, slot.context, slot.site = item
                    self._reduce(*work)
            except BaseException as error:  # re-raised on the training thread
                self._error = error
            finally:
                slot.context = slot.site = None
                self._queue.task_done()
        self._queue.task_done()

    def _reduce(self, buffer: torch.Tensor, divisor: int, pairs, ready) -> None:
        if ready is None:
            self._each(buffer, divisor, pairs, _comm.allreduce, _comm.reduce_scatter)
            return
        stream = self._streams[buffer.device]
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            if pairs is None and not _cuda.takes_device_memory(nonblocking=False):
                self._staged(buffer, divisor, stream)
            else:  # each collective syncs `stream` first
                self._each(buffer, divisor, pairs, _comm.allreduce, _comm.reduce_scatter)

    def _staged(self, buffer: torch.Tensor, divisor: int, stream) -> None:
        """Allreduce a device bucket through pinned host memory, its chunks in a pipeline.

        Every chunk's copy to the host is queued at once (``mpidp.comm.staging.HostMirror``);
        MPI reduces chunk k as soon as its copy is done, while later chunks are still
        crossing and earlier results are copied back (all on the side stream, in order).
        """
        mirror = _staging.HostMirror(buffer, self.chunk_bytes).queue(stream, divisor=divisor)
        _cuda.carried("staged", len(mirror.pieces))
        for index in range(len(mirror.pieces)):
            _comm.allreduce(mirror.wait(index), "sum", comm=self.pool)
            mirror.copy_back(index)

    def start(self, buffer: torch.Tensor, divisor: int = 1, pairs=None) -> None:
        ready = None
        if buffer.device.type == "cuda":
            if buffer.device not in self._streams:
                self._streams[buffer.device] = torch.cuda.Stream(buffer.device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buffer.device))
        self._queue.put((buffer, divisor, pairs, ready, *_watchdog.handoff()))

    def finish(self) -> None:
        self._queue.join()
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"mpidp communication thread failed: {error}") from error

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


STRATEGIES = {"inline": InlineStrategy, "thread": ThreadStrategy,
              "nonblocking": NonblockingStrategy}
NAMES = ("auto", *STRATEGIES)


_LEVELS = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
           MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
           MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}


def resolve(name: str, device: torch.device, thread_level: int = MPI.THREAD_MULTIPLE) -> str:
    """Pick the strategy for ``name`` that is legal under the MPI thread level granted.

    ``auto``: "inline" for CPU training (measured), "thread" for GPUs (the CPU
    is free) when the library granted ``MPI_THREAD_MULTIPLE`` (the thread's
    collectives run while the training thread makes its own MPI calls), else
    "inline". On a GPU, autograd runs the gradient hooks on its own device
    thread, so MPI must allow calls from a thread other than the main one
    (``MPI_THREAD_SERIALIZED`` at least).

    Raises:
        ValueError: an unknown name, or a choice the thread level makes illegal.
    """
    if name not in NAMES:
        raise ValueError(f"overlap must be one of {', '.join(map(repr, NAMES))}, got {name!r}")
    granted = _LEVELS.get(thread_level, str(thread_level))
    if device.type == "cuda" and thread_level < MPI.THREAD_SERIALIZED:
        raise ValueError(f"a CUDA model needs MPI_THREAD_SERIALIZED or higher (autograd calls "
                         f"the gradient hooks from its device thread), but the MPI library "
                         f"granted {granted}; initialise MPI with a higher thread level")
    if name == "auto":
        multiple = thread_level >= MPI.THREAD_MULTIPLE
        return "thread" if device.type == "cuda" and multiple else "inline"
    if name == "thread" and thread_level < MPI.THREAD_MULTIPLE:
        raise ValueError(f"overlap='thread' calls MPI from a communication thread while the "
                         f"training thread calls it too, which needs MPI_THREAD_MULTIPLE, but "
                         f"the MPI library granted {granted}; use overlap='inline' or "
                         f"'nonblocking' (or 'auto')")
    return name


def make(name: str, pool: _comm.Pool, chunk_bytes: int, device: torch.device) -> _Strategy:
    """Build the overlap strategy called ``name`` (see the module's table) for ``device``."""
    return STRATEGIES[resolve(name, device, runtime.thread_level())](pool, chunk_bytes)
