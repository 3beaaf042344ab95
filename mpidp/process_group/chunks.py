"""A large all_reduce of the backend as chunks, one in flight at a time.

A ``Chunks`` is an engine operation in parts (``mpidp.comm.operation.Staged``): the progress
thread tests it through ``mpidp.comm.progress`` without blocking, which starts each chunk once
the last one completed (docs/concurrency.md, rules 3, 6 and 7); below ``MPI_THREAD_MULTIPLE``
the calling thread runs every chunk as a blocking call. ``mpidp.comm.chunking`` cuts the
tensor: it is the one place that says how large a chunk is and how a buffer is cut.
"""

from __future__ import annotations

import torch

from ..comm import chunking as _chunking
from ..comm import collectives as _collectives
from ..comm import progress as _engine
from ..comm.operation import Staged

__all__ = ["Chunks"]


class Chunks(Staged):
    """A large all_reduce as chunks of ``chunk_bytes``, one in flight (see mpidp.process_group.progress).

    Args:
        tensor: what the chunks reduce in place (host memory where the library cannot
            read device memory).
        op: the reduce op's name in ``mpidp.comm``.
        comm: the group's chunk communicator.
        chunk_bytes: the most bytes a chunk holds.
        stage_from: ``(mirror, event recorded on the caller's stream)``: ``tensor`` is the
            ``mpidp.comm.staging.HostMirror``'s host copy of a device tensor, filled piece by
            piece on the progress thread's side stream after the event; chunk k starts once
            its piece has arrived, polled rather than waited on (rule 6). The caller then
            returns at once, as autograd's thread must to keep queueing the backward.

    ``gate``, set by the caller: the call's fingerprint check (``mpidp.process_group.work.CallCheck``);
    the first chunk starts once it agrees, and a mismatch raises on every rank with no
    chunk started.

    Each test tests the chunk in flight back to back for up to ``burst`` seconds (the
    engine's spin): MPICH moves a large nonblocking allreduce on only inside a test, and
    the progress loop yields the core between two of its rounds (time.sleep(0)), which
    slowed each chunk several times over (docs/performance-comm.md, "Figures behind the
    code's choices"). A burst is still bounded: the progress thread never blocks (rule 3).
    Where a node holds more ranks than cores, a burst keeps a core from the peer whose
    turn it is, so ``set_burst`` turns it off there.
    """

    __slots__ = ("_mirror", "_ready", "pieces", "op", "comm", "_next", "moved", "_queued",
                 "gate")

    def __init__(self, tensor: torch.Tensor, op: str, comm, chunk_bytes: int, *,
                 stage_from: tuple | None = None):
        super().__init__((tensor,), tensor)
        self._mirror, self._ready = stage_from if stage_from is not None else (None, None)
        self.pieces = (self._mirror.pieces if self._mirror is not None
                       else list(_chunking.pieces(tensor, chunk_bytes)))
        self.op, self.comm = op, comm
        self._next = 0
        self.moved = False  # a chunk started since the progress thread last looked
        self._queued = False  # the mirror's copies are queued (progress thread)
        self.gate = None  # a CallCheck: no chunk starts before every rank agrees
        self.burst = burst_seconds

    def _arrived(self, index: int) -> bool:
        if self._mirror is None:
            return True
        if not self._queued:
            self._mirror.queue(_side_stream(self._mirror.source.device), self._ready)
            self._queued = True
        return self._mirror.arrived(index)

    def _next_part(self):
        """Start the next chunk once the gate agreed and its piece arrived (progress thread)."""
        if self.gate is not None:
            if not _engine.test(self.gate):
                return self.LATER
            error, self.gate = self.gate.error(), None
            if error is not None:  # chunk counts may differ: none starts, on any rank
                self._next = len(self.pieces)
                raise error
        if self._next == len(self.pieces):
            return None
        if not self._arrived(self._next):
            return self.LATER
        # no MPIDP_DEBUG check per chunk: the gate checked the whole call, and that
        # check would be a collective step inside the progress loop's own test
        part = _collectives._allreduce(self.pieces[self._next], self.op, self.comm, True,
                                       debug=False)
        self._next += 1
        self.moved = True
        return part

    def run(self) -> None:
        """All the chunks as blocking calls on this thread (below MPI_THREAD_MULTIPLE)."""
        if self._mirror is not None and not self._queued:  # on the caller's stream
            self._mirror.queue(torch.cuda.current_stream(self._mirror.source.device))
            self._queued = True
        for index in range(self._next, len(self.pieces)):
            if self._mirror is not None:
                self._mirror.wait(index)
            _collectives._allreduce(self.pieces[index], self.op, self.comm, False, debug=False)
        self._next = len(self.pieces)
        self._release()  # complete: is_completed() says so

    def in_flight(self) -> list:
        return ([] if self.gate is None else [self.gate]) + super().in_flight()


burst_seconds = _engine.SPIN_SECONDS  # a new Chunks' burst (set_burst)


def set_burst(ranks_on_node: int, cores: int) -> None:
    """Test chunks in bursts only where every rank of the node can have a core of its own."""
    global burst_seconds
    burst_seconds = _engine.SPIN_SECONDS if ranks_on_node <= cores else 0.0


_side_streams: dict = {}  # device -> the progress thread's staging stream (that thread only)


def _side_stream(device: torch.device):
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]
