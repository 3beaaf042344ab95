"""``Handle``: a pending nonblocking operation, and ``_start``, which runs one blocking or not."""

from __future__ import annotations

import threading

from mpi4py import MPI

from .. import errors as _errors
from .. import recorder as _recorder
from .. import watchdog as _watchdog

__all__ = ["Handle"]

# Handles whose MPI request is in flight; holding them here keeps their tensors
# alive even if the caller drops the handle without waiting.
_in_flight: set = set()

# The thread that must never block in MPI (docs/concurrency.md, rule 3) registers itself
# here: its thread id, and how to complete a request while progressing the rest. A
# blocking step of an mpidp.comm call made on that thread (a future's callback issuing a
# collective, an argument exchange, the MPIDP_DEBUG check) is then started nonblocking
# and driven, never waited on in MPI_Wait. Compared by id: every blocking call asks.
_driver_ident: int | None = None
_drive = None


def set_driver(ident: int | None, drive) -> None:
    """Register the never-blocking thread (``ident``, None: none) and ``drive(request)``."""
    global _driver_ident, _drive
    _driver_ident, _drive = ident, drive


def _driving() -> bool:
    return _driver_ident is not None and threading.get_ident() == _driver_ident


def wait_request(request: MPI.Request, label=None) -> None:
    """Complete ``request``: ``MPI_Wait`` on a program thread (watched under ``label``),
    driven on the registered never-blocking thread."""
    if _driving():
        _drive(request)
        return
    slot = _watchdog.begin(label)
    try:
        request.Wait()
    finally:
        slot.current = None


_HERE = object()  # Handle's default scope: the creating thread's innermost


class Handle:
    """A pending nonblocking operation that owns its tensors until it completes.

    ``wait()`` blocks and returns the result (the output tensor; see each
    ``i``-function); ``is_completed()`` tests without blocking (and drives MPI
    progress).
    """

    __slots__ = ("_request", "_tensors", "_finish", "_result", "_label", "_scope", "_ticket",
                 "__weakref__")

    def __init__(self, request, tensors, result, finish=None, label=None, scope=_HERE, ticket=-1):
        self._request = request
        self._tensors = tensors
        self._result = result
        self._finish = finish
        self._label = label  # what wait() waits in, for stall reports (mpidp.watchdog)
        self._scope = _watchdog.context() if scope is _HERE else scope
        self._ticket = ticket  # its flight recorder entry (mpidp.recorder)
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
        _recorder.ended(self._ticket)
        finish = self._finish
        self._release()
        if finish is not None:
            finish()
        return True

    def _release(self):
        self._request = self._finish = self._tensors = None
        _in_flight.discard(self)


def _record(comm, label, scope, nonblocking: bool) -> int:
    """The flight recorder's entry for a collective labelled ``(name, tensor, key, value...)``;
    a nonblocking one is named as such (MPI never matches it with a blocking one)."""
    name, tensor = label[0], label[1]
    if nonblocking:
        name = "i" + name
    if tensor is None:
        return _recorder.started(comm, name, 0, None, label[2:], scope)
    return _recorder.started(comm, name, tensor.numel(), tensor.dtype, label[2:], scope)


def _start(comm: MPI.Intracomm, name: str, args, keep, result, finish, nonblocking: bool,
           label=None):
    """Run MPI collective ``name`` (blocking) or its ``I``-form, returning tensor or Handle.

    ``label`` names the call in stall reports (``mpidp.watchdog``), built only then,
    and is what the flight recorder (``mpidp.recorder``) notes of it:
    ``(name, tensor, key, value, ...)``.
    """
    scope = _watchdog.context()
    ticket = _record(comm, label, scope, nonblocking)
    if nonblocking:
        try:
            request = getattr(comm, "I" + name.lower())(*args)
        except MPI.Exception as error:
            raise _errors.mpi_failure(_watchdog._label_text(label), error) from error
        return Handle(request, keep, result, finish, label, scope, ticket)
    try:
        if _driving():  # never block on that thread: the I-form, driven
            wait_request(getattr(comm, "I" + name.lower())(*args))
        else:
            slot = _watchdog.begin(label, scope)
            try:
                getattr(comm, name)(*args)
            finally:
                slot.current = None
    except MPI.Exception as error:
        raise _errors.mpi_failure(_watchdog._label_text(label), error) from error
    _recorder.ended(ticket)
    if finish is not None:
        finish()
    return result
