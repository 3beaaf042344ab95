"""``Operation``: a collective or message in flight, the one kind of pending work the engine completes.

An operation owns what MPI may still touch (its tensors) until it completes, its flight
recorder ticket, its watchdog label and how an MPI error maps to mpidp's exceptions. It
stands for one MPI request, several that complete together (as ``mpi4py.util.pkl5``'s
Request does), or, as ``Staged``, a reduction in parts started one after another (a
chunked all_reduce). ``mpidp.comm.progress`` is the one driver that completes any set of
them; ``_test`` and ``_wait`` here are its primitives, called by nothing else.

Completion is claimed once (docs/concurrency.md, rule 9): an operation's lock is held from
its MPI test or wait to the end of its settling (the finish), so two threads never touch one
MPI request at once, the finish runs once, and a thread that finds it done finds it settled.
A test that finds the lock taken answers "not yet" and never waits for it (rule 3); an error
is kept and raised again by every later test or wait.
"""

from __future__ import annotations

import threading

from mpi4py import MPI

from .. import errors as _errors
from .. import recorder as _recorder
from .. import watchdog as _watchdog
from . import progress as _progress

__all__ = ["Operation", "Staged"]

# Operations whose MPI requests are in flight; holding them here keeps their tensors
# alive even if the caller drops the operation without waiting.
_in_flight: set = set()

_HERE = object()  # the default scope: the creating thread's innermost


class Operation:
    """A pending nonblocking operation that owns its tensors until it completes.

    Args:
        request: an ``MPI.Request``, or a list of them that complete together.
        tensors: what MPI may touch until then (kept referenced).
        result: what ``wait()`` returns (see each ``i``-function).
        finish: run once the requests completed (copies back, checks).
        label: what it is, for stall reports and MPI errors (``mpidp.watchdog``).
        scope: the watchdog scope it was started in (default: the current one).
        ticket: its flight recorder entry (``mpidp.recorder``), ended on completion.
        status: an ``MPI.Status`` the (single) request fills: a receive's sender and size.

    ``wait()`` blocks and returns the result; ``is_completed()`` tests without
    blocking (and so drives MPI progress). Both go through ``mpidp.comm.progress``.
    """

    __slots__ = ("_request", "_tensors", "_finish", "_result", "_label", "_scope", "_ticket",
                 "_status", "_lock", "_error", "__weakref__")

    def __init__(self, request, tensors, result, finish=None, label=None, scope=_HERE, ticket=-1,
                 status=None):
        self._request = request  # None once completed
        self._tensors = tensors
        self._result = result
        self._finish = finish
        self._label = label
        self._scope = _watchdog.context() if scope is _HERE else scope
        self._ticket = ticket
        self._status = status
        self._lock = threading.Lock()  # held by the one thread completing it (rule 9)
        self._error: BaseException | None = None  # what it failed with, raised again
        _in_flight.add(self)

    def wait(self):
        """Block until the operation completes; return its result."""
        return _progress.wait(self)

    def is_completed(self) -> bool:
        """Return True once the operation has completed, without blocking."""
        return _progress.test(self)

    # -- the driver's primitives (mpidp.comm.progress) ----------------------------------

    def _test(self) -> bool:
        """Test without blocking; once done, settle (True). Raises the mapped MPI error.

        False while another thread tests, waits on or settles it (rule 9)."""
        if self._request is None:
            return self._ended()
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._test_held()
        finally:
            self._lock.release()

    def _test_held(self) -> bool:
        """``_test`` with the lock held (``mpidp.comm.progress.test_all`` holds several)."""
        request = self._request
        if request is None:
            return self._ended()
        try:
            if type(request) is list:
                done = MPI.Request.Testall(request)
            else:
                done = request.Test(self._status)
        except MPI.Exception as error:
            raise self._failed(error) from error
        except BaseException as error:
            self._end(error)
            raise
        return done and self._settle()

    def _wait(self) -> None:
        """Block in MPI until done (a program thread's request of its own, rule 4); settle.
        Another thread completing it meanwhile: block until it has settled (rule 9)."""
        if self._request is None:
            self._ended()
            return
        with self._lock:
            request = self._request
            if request is None:
                self._ended()
                return
            try:
                if type(request) is list:
                    MPI.Request.Waitall(request)
                else:
                    request.Wait(self._status)
            except MPI.Exception as error:
                raise self._failed(error) from error
            except BaseException as error:
                self._end(error)
                raise
            self._settle()

    def _ended(self) -> bool:
        """What a test of a completed operation says: True, or its error raised again."""
        if self._error is not None:
            raise self._error
        return True

    def _failed(self, error: MPI.Exception) -> BaseException:
        """The exception an MPI error of this operation raises (mpidp.errors' mapping)."""
        failure = _errors.mpi_failure(_watchdog._label_text(self._label), error)
        self._end(failure)
        return failure

    def _settle(self) -> bool:
        """Completed in MPI: end its record, run its finish (once), then release it.
        Released last, so that a thread that reads it released reads it settled."""
        _recorder.ended(self._ticket)
        try:
            if self._finish is not None:
                self._finish()
        except BaseException as error:
            self._end(error)
            raise
        self._release()
        return True

    def _end(self, error: BaseException) -> None:
        self._error = error  # before the release: whoever sees it released sees the error
        self._release()

    def _release(self) -> None:
        self._request = self._finish = self._tensors = None
        _in_flight.discard(self)


_STAGED = object()  # a Staged's request until it completes: its parts are its own operations


class Staged(Operation):
    """An operation in parts, one in flight at a time: a chunked or pipelined reduction.

    A subclass says what comes next in ``_next_part()``: the next part, started (an
    ``Operation``); ``LATER`` when it cannot start yet (its data not there: it is asked
    again at the next test); None when no part is left. Each part owns its tensors, ticket
    and label; the whole completes when the last part has. ``burst``: how long one test
    may test the part in flight back to back (``mpidp.comm.progress.test``'s ``within``).
    """

    __slots__ = ("_part", "burst")
    LATER = object()

    def __init__(self, tensors, result, finish=None, label=None, scope=_HERE):
        super().__init__(_STAGED, tensors, result, finish, label, scope)
        _in_flight.discard(self)  # each part holds what MPI touches, in _in_flight while in flight
        self._part: Operation | None = None
        self.burst = 0.0

    def _next_part(self):
        raise NotImplementedError

    def _test(self) -> bool:
        if self._request is None:
            return self._ended()
        if not self._lock.acquire(blocking=False):
            return False  # another thread tests it: only one starts the next part (rule 9)
        try:
            return self._test_held()
        finally:
            self._lock.release()

    def _test_held(self) -> bool:
        if self._request is None:
            return self._ended()
        try:
            while True:
                if self._part is not None:
                    if not _progress.test(self._part, within=self.burst):
                        return False
                    self._part = None
                part = self._next_part()
                if part is None:
                    return self._settle()
                if part is self.LATER:
                    return False
                self._part = part
        except BaseException as error:
            if self._request is not None:
                self._end(error)  # failed: a later test raises it again, starts nothing
            raise

    def _wait(self) -> None:
        _progress.poll(self._test)

    def in_flight(self) -> list:
        """The part MPI may still be working on (to keep referenced if this fails)."""
        return [] if self._part is None else [self._part]
