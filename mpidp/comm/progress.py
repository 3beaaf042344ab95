"""The one driver of operations in flight, with the one back-off policy that paces it.

Every ``mpidp.comm.operation.Operation`` completes through these functions: ``test``,
``test_all``, ``wait``, ``wait_all``, and ``poll`` for a condition that only tests them.
Callers above the engine (DDP's overlap strategies, the backend's Works and progress
thread, its chunks, Horovod's requests, the compressed hooks' pipeline) decide only who
calls them and when; how an operation is tested or waited on, and how a wait that tests
paces itself, is decided here. No other module of mpidp calls MPI's Wait or Test (or
their -all, -any, -some forms), but the watchdog's channel and the store's, which serve
this layer and so cannot depend on it (tests/test_layers.py checks it).

A thread registered with ``set_driver`` never blocks in MPI (docs/concurrency.md, rule
3): a wait there hands a test to the thread's own loop, which progresses everything it
owns until the test passes.
"""

from __future__ import annotations

import threading
import time

from mpi4py import MPI

from .. import watchdog as _watchdog

__all__ = ["Backoff", "poll", "set_driver", "test", "test_all", "wait", "wait_all"]

# The back-off policy: a wait that tests (MPI has no timed wait; a never-blocking thread
# may not block) tests back to back for SPIN_SECONDS, since most calls end within that
# and a sleep adds its whole length to the wait; then yields the core between tests
# (time.sleep(0), the GIL released) up to YIELD_SECONDS, since a nonblocking collective
# moves on only inside MPI calls and a real sleep between tests stalls it (a 1 ms spin
# before the first sleep made a 4 MiB all_reduce 2.3 ms against 1.8 ms blocking); then
# sleeps from FIRST_SLEEP, doubling up to MAX_SLEEP, so that a rank waiting on a late
# peer does not hold a core (docs/performance-comm.md, "Figures behind the code's choices").
SPIN_SECONDS = 2e-3
YIELD_SECONDS = 50e-3
FIRST_SLEEP = 20e-6
MAX_SLEEP = 1e-3


class Backoff:
    """The pauses between two tests of one wait (the policy above), from its first test.

    Args:
        spin: seconds of back-to-back tests (0 on a thread that must leave the GIL free).
        yield_for: seconds, from the start, of tests with the core yielded between them.
        max_sleep: the longest sleep.
        sleep: how to sleep (a condition's ``wait``, so that new work cuts a sleep short).
    """

    __slots__ = ("_spin", "_yield_for", "_max_sleep", "_sleep", "_since", "_last")

    def __init__(self, *, spin: float = SPIN_SECONDS, yield_for: float = YIELD_SECONDS,
                 max_sleep: float = MAX_SLEEP, sleep=time.sleep):
        self._spin, self._yield_for, self._max_sleep = spin, yield_for, max_sleep
        self._sleep = sleep
        self.reset()

    def reset(self) -> None:
        """Start over (something moved): back to back-to-back tests."""
        self._since, self._last = time.perf_counter(), 0.0

    def pause(self) -> None:
        """Pause before the next test, as long as the wait so far calls for."""
        waited = time.perf_counter() - self._since
        if waited < self._spin:
            return
        if waited < self._yield_for:
            time.sleep(0)
            return
        self._last = min(max(2 * self._last, FIRST_SLEEP), self._max_sleep)
        self._sleep(self._last)


# The thread that must never block in MPI (docs/concurrency.md, rule 3) registers itself
# here: its thread id, and ``drive(done)``, which progresses what that thread owns until
# ``done()`` is true. Compared by id: every wait asks.
_driver_ident: int | None = None
_drive = None


def set_driver(ident: int | None, drive) -> None:
    """Register the never-blocking thread (``ident``, None: none) and its ``drive(done)``."""
    global _driver_ident, _drive
    _driver_ident, _drive = ident, drive


def driving() -> bool:
    """Whether this thread is the never-blocking one (its waits are driven, not blocked)."""
    return _driver_ident is not None and threading.get_ident() == _driver_ident


def poll(done, deadline: float | None = None, *, backoff: Backoff | None = None) -> None:
    """Call ``done()`` (which tests operations) until it is true, paced by the policy
    (``backoff``: its phases set otherwise, as for a wait expected to last hours).

    Raises:
        TimeoutError: past ``deadline`` (``time.monotonic()``); what it tests goes on.
    """
    if driving():
        _drive(done if deadline is None else lambda: done() or time.monotonic() > deadline)
        if deadline is None or done():
            return
        raise TimeoutError("the operation did not complete before its deadline")
    backoff = backoff if backoff is not None else Backoff()
    while not done():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("the operation did not complete before its deadline")
        backoff.pause()


def test(operation, *, within: float = 0.0) -> bool:
    """Whether ``operation`` completed (then settled), testing it back to back for up to ``within`` s."""
    if operation._test():
        return True
    if within <= 0.0:
        return False
    until = time.perf_counter() + within
    while not operation._test():
        if time.perf_counter() > until:
            return False
    return True


def test_all(operations, *, within: float = 0.0) -> bool:
    """Whether every one of ``operations`` completed (each then settled).

    Tests them back to back for up to ``within`` seconds, in one ``MPI_Testall`` over
    their requests where each is plain (no status to fill, not staged) and no other
    thread holds one (rule 9: their locks are held from the Testall to their settling):
    all complete or none. Else, or when that Testall raised, tests each in turn, which
    then names which failed.
    """
    held, requests = [], []
    for operation in operations:
        request = operation._request
        if request is None:
            continue
        plain = type(request) is list or (isinstance(request, MPI.Request)
                                          and operation._status is None)
        if not plain or not operation._lock.acquire(blocking=False):
            _release(held)
            return _test_each(operations, within)
        if operation._request is None:  # settled meanwhile by its last holder
            operation._lock.release()
            continue
        held.append(operation)
        requests += request if type(request) is list else [request]
    until = time.perf_counter() + within
    try:
        while not MPI.Request.Testall(requests):
            if time.perf_counter() > until:
                return False
        for operation in held:  # completed in MPI: settle each (its finish)
            operation._settle()
    except MPI.Exception:
        return False
    finally:
        _release(held)
    for operation in operations:
        if operation._error is not None:  # failed before this test
            raise operation._error
    return True


def _release(held) -> None:
    for operation in held:
        operation._lock.release()


def _test_each(operations, within: float) -> bool:
    until = time.perf_counter() + within
    while not all(operation._test() for operation in operations):
        if time.perf_counter() > until:
            return False
    return True


def wait(operation, *, deadline: float | None = None):
    """Complete ``operation`` and return its result.

    On a program thread without a deadline, blocks in MPI (its own request, rule 4); with
    a deadline, tests it paced by the policy; on the never-blocking thread, drives it.
    Watched under its label (``mpidp.watchdog``) as a wait on an operation started earlier.

    Raises:
        TimeoutError: past ``deadline`` (``time.monotonic()``); the operation goes on.
        The mapped MPI error (``mpidp.errors``), or what the operation's finish raises.
    """
    if operation._request is None:
        operation._ended()  # its error, if it failed (rule 9)
        return operation._result
    if _driver_ident is not None and threading.get_ident() == _driver_ident:  # driving()
        poll(operation._test, deadline)
        return operation._result
    if deadline is not None and operation._test():
        return operation._result
    slot = _watchdog.begin(operation._label, operation._scope, True)
    try:
        if deadline is None:
            operation._wait()
        else:
            poll(operation._test, deadline)
    finally:
        slot.current = None
    return operation._result


def wait_all(operations, *, deadline: float | None = None) -> list:
    """Complete ``operations`` in order; return their results."""
    return [wait(operation, deadline=deadline) for operation in operations]


def complete(request: MPI.Request) -> None:
    """Complete a raw request of the engine's own blocking forms (``handle``): ``MPI_Wait``,
    or driven on the never-blocking thread. MPI errors are the caller's to map."""
    if driving():
        _drive(request.Test)
    else:
        request.Wait()
