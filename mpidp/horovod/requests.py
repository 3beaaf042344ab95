"""Pending collectives behind Horovod's integer handles: the table of started requests.

Every collective of ``mpidp.horovod`` starts nonblocking, on the calling
thread, in call order, on its process set's data communicator, and returns a
handle; ``synchronize(handle)`` waits and ``poll(handle)`` tests. A pending
``Request`` holds its tensors (and the ``mpidp.comm.Handle``s, which hold
theirs) until it completes, and a handle never synchronized still keeps them.

Each starts after its negotiation (``mpidp.horovod.negotiation``), which compares every
rank's call first; its operations complete through the engine (``mpidp.comm.progress``).
"""

from __future__ import annotations

import itertools
import threading

import torch

from ..comm import progress as _engine
from . import negotiation as _negotiation
from . import state as _state
from . import process_sets as _sets
# the negotiation's names the other modules of mpidp.horovod reach through this one
from .negotiation import (  # noqa: F401
    ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN, KIND_NAMES, OBJECT, OP_CODES,
    REDUCESCATTER, HorovodInternalError, checking)

__all__ = ["HorovodInternalError", "poll", "synchronize"]


class Request:
    """A started collective: its ``mpidp.comm.Handle``s and what finishes it."""

    __slots__ = ("handles", "finish", "keep", "kind", "name", "process_set", "started", "nbytes",
                 "start", "launched", "round", "description", "error", "_lock", "_outcome")

    def __init__(self, handles, finish, keep, kind, name, process_set, nbytes, start=None):
        """``start(own)`` starts a negotiated request (``own``: no rank serves it from
        ``join``); without it, ``handles`` are started already."""
        self.handles, self.finish, self.keep = handles, finish, keep
        self.kind, self.name, self.process_set, self.nbytes = kind, name, process_set, nbytes
        self.start, self.launched, self.round = start, start is None, 0
        self.description, self.error = None, None
        self._lock = threading.Lock()  # held by the one thread that completes it (rule 9)
        self._outcome: tuple | None = None  # (result, error) once completed
        timeline = _state._state.timeline
        self.started = timeline.now() if timeline is not None else None

    def launch(self, own: bool) -> None:
        """Start the data collectives, negotiated on every rank (under the set's lock)."""
        self.handles = self.start(own)
        self.launched, self.round = True, _negotiation._rounds.get(self.process_set, 0)

    def taken(self) -> bool:
        """Its name is still pending: not started, or started since the set's last round."""
        if self.start is None:  # a group: its parts
            return any(isinstance(p, Request) and p.taken() for p in self.handles)
        return not self.launched or self.round == _negotiation._rounds.get(self.process_set, 0)

    def done(self) -> bool:
        """Whether it completed: its parts (Requests of a group) and operations, tested by
        the engine (``mpidp.comm.progress``)."""
        return self.error is not None or self.launched and all(
            h.done() if isinstance(h, Request) else _engine.test(h) for h in self.handles)

    def wait(self):
        """Complete it and return ``finish()``'s value. The first thread to ask completes it
        (the finish runs once); another one blocks until then and gets the same result or
        error (docs/concurrency.md, rule 9): ``synchronize`` of one handle from two threads,
        or beside ``hvd.shutdown()``."""
        with self._lock:
            if self._outcome is None:
                try:
                    self._outcome = (self._complete(), None)
                except BaseException as error:
                    self._outcome = (None, error)
        result, error = self._outcome
        if error is not None:
            raise error
        return result

    def _complete(self):
        if not self.launched:
            _negotiation.wait_named(self)
        if self.error is not None:
            raise self.error
        for handle in self.handles:
            handle.wait() if isinstance(handle, Request) else _engine.wait(handle)
        result = self.finish()
        timeline = _state._state.timeline
        if timeline is not None and self.started is not None:
            timeline.record(KIND_NAMES[self.kind], self.name, self.started,
                            self.process_set.process_set_id, self.nbytes)
        return result


_table: dict[int, Request] = {}
_numbers = itertools.count(1)
_table_lock = threading.Lock()


def begin(process_set: _sets.ProcessSet, kind: int, launch, finish, keep=(), *, name=None,
          nbytes: int = 0, direct=None, **fields) -> Request:
    """Negotiate a collective with the set's other ranks, then start it; ``register`` it next.

    Args:
        launch: starts the data collectives on ``process_set.data``; returns their Handles.
        finish: called once they completed; its value is what ``synchronize`` returns.
        keep: tensors to hold until then.
        direct: runs the data collectives to completion instead of ``launch`` (returns no
            Handles) where no rank has joined, which every rank learns from the
            negotiation alike; joined ranks serve only what ``launch`` starts.
        fields: the call, which every rank must make alike (dtype, op, root, shape, detail).
    """
    if name is not None and _pending_named(process_set, name):
        raise ValueError(f"hvd.{KIND_NAMES[kind]}: name {name!r} is the name of an operation of "
                         f"this rank still pending on {process_set} (submitted, and not started "
                         f"before the set's last collective call, nor synchronized); as in "
                         f"Horovod, each pending operation needs its own name")
    request = Request([], finish, keep, kind, name, process_set, nbytes,
                      lambda own: direct() if direct is not None and own else launch())
    with process_set.lock:
        message = _negotiation.negotiate(
            process_set, kind, request=request if name is not None else None, name=name, **fields)
        if message is not None:
            request.launch(not message.joined)
    return request


def _pending_named(process_set: _sets.ProcessSet, name) -> bool:
    with _table_lock:
        return any(r.name == name and r.process_set is process_set and r.taken()
                   for r in _table.values())


def register(request: Request) -> int:
    """The handle of a started ``request``, for ``synchronize`` and ``poll``."""
    with _table_lock:
        number = next(_numbers)
        _table[number] = request
    return number


def _request(handle, what: str) -> Request:
    request = _table.get(handle)
    if request is None:
        raise ValueError(f"{what}: handle {handle!r} is not a pending operation (each handle "
                         f"is synchronized once, and hvd.shutdown() forgets them all)")
    return request


def poll(handle: int) -> bool:
    """Return True if the operation behind ``handle`` has completed (``synchronize`` won't block)."""
    return _request(handle, "poll").done()


def synchronize(handle: int):
    """Wait for the operation behind ``handle`` and return its result (the output tensor)."""
    request = _request(handle, "synchronize")
    try:
        return request.wait()
    finally:
        with _table_lock:
            _table.pop(handle, None)


def _forget_all() -> None:
    """Wait for every started operation, then forget them all (``hvd.shutdown``).

    An operation still deferred (no other rank submitted its name) is dropped on this
    rank alone, as Horovod's shutdown fails what its queue holds: no control message.
    """
    with _table_lock:
        pending = list(_table.values())
        _table.clear()
    for queue in _negotiation._deferred.values():
        for request in queue:
            request.error = _Dropped(f"hvd.shutdown() before every rank submitted the "
                                     f"operation {request.description}")
    _negotiation._deferred.clear()
    _negotiation._rounds.clear()
    for request in pending:
        try:
            request.wait()
        except _Dropped:  # the request, or a part of its group
            pass


class _Dropped(HorovodInternalError):
    """A deferred operation that ``hvd.shutdown()`` dropped."""


_state.on_shutdown(_forget_all)


def wrap_tensor(value) -> torch.Tensor:
    """``value`` as it travels: detached (autograd never sees MPI's writes)."""
    return value.detach() if value.requires_grad else value
