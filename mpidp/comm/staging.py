"""Host and contiguous staging: what MPI gets in place of a tensor it cannot take as it is.

Before MPI touches device memory, the stream that produced it is synchronised
(mpi4py cannot do that); a CUDA-aware library then reads device memory
directly, any other gets a copy staged through pinned host memory (see
``mpidp.cuda``). A non-contiguous tensor is staged the same way: MPI gets a
contiguous copy, and a tensor that receives a result gets it copied back when
the operation completes (at ``wait()`` for the ``i``-forms); only a result
tensor whose elements share memory (a stride-0 ``expand()``) is refused (see
``checks._check_tensor``). Contiguous tensors go to MPI as they are.
"""

from __future__ import annotations

import torch

from .. import cuda as _cuda
from . import chunking as _chunking
from . import handle as _handle

# Read once at import (as mpidp.settings declares); a test switches it by setting
# mpidp.comm.staging._STAGE_CPU, which _stage reads at each call.
_STAGE_CPU = _cuda.stage_cpu()  # testing aid: CPU tensors take the staging path too


class HostMirror:
    """A device tensor's pinned host copy, filled piece by piece on a stream: mpidp's one staging.

    DDP's communication thread (a side stream), the backend's progress thread (its side
    stream, polled) and single calls (``_stage``: one piece, the caller's stream) all stage
    device memory through it. The rule: ``queue(stream, ready)`` queues every piece's copy to
    the host on ``stream``, after ``ready`` (an event of the producer's stream; None: the
    stream is already ordered after it); piece ``k`` of ``pieces`` may go to MPI only once
    ``arrived(k)`` (polled) or ``wait(k)`` (blocking) says its copy is done; ``copy_back``
    queues the result's copy into the device tensor, on the mirror's stream or the one
    given, which a reader must then order itself after. torch's pinned-memory cache hands
    the host block out again only once the copies queued from it are done.

    Args:
        source: the device tensor (contiguous).
        chunk_bytes: the most bytes a piece holds (``mpidp.comm.chunking.pieces``).
    """

    def __init__(self, source: torch.Tensor, chunk_bytes: int):
        self.source = source
        self.host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        self.pieces = list(_chunking.pieces(self.host, chunk_bytes))
        self._chunk_bytes = chunk_bytes
        self._sources: list = []
        self._arrived: list = []
        self._stream = None

    def queue(self, stream, ready=None, divisor: int = 1) -> HostMirror:
        """Queue the copies to the host on ``stream`` (each source piece divided first)."""
        self._stream = stream
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            self._sources = list(_chunking.pieces(self.source, self._chunk_bytes, divisor))
            for piece, mirror in zip(self._sources, self.pieces):
                mirror.copy_(piece, non_blocking=True)
                self._arrived.append(torch.cuda.Event())
                self._arrived[-1].record(stream)
        self.source.record_stream(stream)
        return self

    def arrived(self, index: int) -> bool:
        return self._arrived[index].query()

    def wait(self, index: int) -> torch.Tensor:
        self._arrived[index].synchronize()
        return self.pieces[index]

    def copy_back(self, index: int | None = None, stream=None) -> None:
        """Queue piece ``index``'s (None: every piece's) copy into the device tensor."""
        stream = self._stream if stream is None else stream
        with torch.cuda.stream(stream):
            for k in range(len(self.pieces)) if index is None else (index,):
                self._sources[k].copy_(self.pieces[k], non_blocking=True)


def _stage(inputs: tuple, outputs: tuple, host_only: bool = False, nonblocking: bool = False):
    """Make tensors safe to hand to MPI; return (mpi inputs, mpi outputs, copy back or None).

    A contiguous tensor MPI can read goes as it is. Device memory the library
    cannot read (it is not CUDA-aware, or not for ``nonblocking`` collectives, which
    the progress thread's blocking calls are too (``handle._driving``), or ``host_only``,
    as for reductions that torch computes on the host) gets a pinned host stand-in; a non-contiguous
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
    device_to_host = bool(devices) and (
        host_only or not _cuda.takes_device_memory(nonblocking or _handle._driving()))
    if devices:
        _cuda.carried("staged" if device_to_host else "pointer")
    pinned = torch.cuda.is_available()
    stand_ins: dict[int, torch.Tensor] = {}

    mirrors: dict[int, HostMirror] = {}

    def stand_in(tensor, fill):
        if id(tensor) not in stand_ins:
            if device_to_host and tensor.is_cuda and tensor.is_contiguous():
                mirror = mirrors[id(tensor)] = HostMirror(tensor, tensor.nbytes or 1)
                if fill:
                    mirror.queue(torch.cuda.current_stream(tensor.device)).wait(0)
                stand_ins[id(tensor)] = mirror.host
                return mirror.host
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
