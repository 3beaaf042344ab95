"""The torch.distributed backend's Works: pending operations as torch sees them, and their futures.

A ``Work`` is what an asynchronous call of the backend ``"mpidp"`` returns: the engine's
operations it started (``mpidp.comm.operation``: the call's own, its call check, or a
chunked all_reduce, ``mpidp.process_group.chunks``) and the tensors torch gets. It decides
who completes them and when: the progress thread (``mpidp.process_group.progress``), or a
thread that waits on its own; ``mpidp.comm.progress`` completes them. ``Done`` completed
before it was returned, ``All`` is several as one. Rules cited by number ("rule 4") are
docs/concurrency.md's.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from ..comm import progress as _engine
from .. import watchdog as _watchdog
from .call_check import CallCheck, CallMismatch
from . import healing as _healing
from .chunks import Chunks
from .progress import progress

__all__ = ["All", "Done", "Work", "abandon", "blocking", "checked_wait", "new_future"]
# work.Chunks, work.progress, work.CallCheck and work.CallMismatch still name what they
# named before chunks.py, progress.py and call_check.py


def new_future(result) -> torch.futures.Future:
    """An unset future for ``result``, on the CUDA devices its tensors live on (if any)."""
    devices = sorted({str(t.device) for t in result if t.is_cuda})
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def _settle_future(future, result, error) -> None:
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _devices(result) -> list:
    return sorted({t.device for t in result if isinstance(t, torch.Tensor) and t.is_cuda},
                  key=str)


def abandon(kept: list) -> None:
    """Keep what MPI may still write into referenced for good (a failed Work's requests)."""
    if kept:  # list.append is atomic: callable with progress.lock held (from _test) or not
        progress._abandoned.append(kept)


def checked_wait(handles: list, check: CallCheck | None, deadline, result) -> None:
    """Wait on ``handles`` in order; once ``check``'s request (the first) is done, raise its
    error, the others' requests abandoned with ``result`` (a mismatched call may never end).

    Most calls end within microseconds: testing all the operations at once (one
    ``MPI_Testall``, ``mpidp.comm.progress.test_all``) back to back for the back-off's spin
    finds that (bench/check_cost.py). Testall completes all or none, so what is still
    pending after the spin goes the ordered way, check first.
    """
    if len(handles) > 1 and _engine.test_all(handles, within=_engine.SPIN_SECONDS):
        error = check.error() if check is not None else None
        if error is not None:  # every request is done: none is left to abandon
            raise error
        return
    for index, handle in enumerate(handles):
        _engine.wait(handle, deadline=deadline)
        if check is not None and handle is check.handle:
            error = check.error()
            if error is not None:
                abandon([handles[index + 1:], result])
                raise error


class Work(dist.Work):
    """A pending collective or message: engine operations (or Chunks), the tensors torch gets.

    Args:
        handles: started operations (``mpidp.comm.operation``), completed in order.
        result: what ``result()`` and the future give.
        finish: run once the requests are done (copies back, divisions).
        group: the group that issued it (its name, timeout and order).
        ordered: completes in the group's order (collectives); False for messages.
        source: a receive's ``MPI.Status``, which names the sender.
        chunks: a chunked all_reduce, driven by the progress thread.
        label: what it is, for stall reports and errors (see ``mpidp.watchdog``).
        deadline: ``time.monotonic()`` after which it fails (the group's timeout).
        check: the call's fingerprint check (``CallCheck``), its request first in
            ``handles``: once done, a mismatch fails the Work on every rank at once,
            whatever the operation's own requests do.
    """

    def __init__(self, handles, result, *, finish=None, group=None, ordered=True, source=None,
                 chunks: Chunks | None = None, label=None, deadline: float | None = None,
                 check: CallCheck | None = None):
        super().__init__()
        self._check = check  # its request is handles[0], or the chunks' gate
        self._handles = list(handles)
        self._result = result
        self._finish = finish
        self._group = group
        self._ordered = ordered and group is not None
        self._source = source
        self._chunks = chunks
        self._label = label
        self._scope = _watchdog.context()
        self._since = time.monotonic()
        self._deadline = deadline
        self._state = "pending"  # -> "claimed" (a thread waits on its requests) -> "done"
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future = None
        self._future_set = False
        self._events: list = []  # CUDA: recorded after the progress thread's copy-back
        self._tracked = False  # the progress thread completes it (else wait/is_completed)

    # -- on the thread that completes it ------------------------------------------------

    def _test(self) -> bool:
        """Advance without blocking; True once done (under progress.lock)."""
        if self._failed_if_spoilt():  # as _claim does: every path that completes it checks
            return True
        try:
            if self._chunks is not None:
                if not _engine.test(self._chunks):
                    return False
            else:
                while self._handles:
                    if not _engine.test(self._handles[0]):
                        return False
                    self._verify(self._handles.pop(0))
            if self._finish is not None:
                self._finish()
            # Host staging copies back inside a handle's completion (comm._stage) or in
            # finish, both queued on this thread's streams: wait() on any other stream
            # must wait for them, so events are recorded whichever path copied.
            self._record_events()
        except Exception as error:  # the future and wait() report it
            self._error = error
        self._set_done()
        return True

    def _verify(self, handle) -> None:
        """After ``handle`` completed: raise the call check's error if it was that check's."""
        if self._check is not None and handle is self._check.handle:
            error, self._check = self._check.error(), None
            if error is not None:
                abandon([self._handles, self._result])
                self._handles, self._finish = [], None
                raise error

    def _set_done(self) -> None:
        self._state = "done"
        self._done.set()

    def _record_events(self) -> None:
        # on each result device's current stream of this thread: the one its copy-back used
        for device in _devices(self._result):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)

    def _fail(self, error: BaseException) -> list:
        """Mark failed (under progress.lock); return what MPI may still touch."""
        kept = self._handles + (self._chunks.in_flight() if self._chunks is not None else [])
        self._handles, self._chunks, self._finish = [], None, None
        self._error = error
        self._set_done()
        return [kept, self._result] if kept else []

    def _complete_future(self) -> None:
        with progress.lock:
            future = self._future
            if future is None or self._future_set:
                return
            self._future_set = True
        error = self._error
        if isinstance(error, CallMismatch):  # a future taken while pending, as torch's
            progress.end_job_for(self, "failed")  # DDP does: its C++ crashes on the failure
        elif error is not None and _healing.takes(error):  # a Healer's guard() raises it
            error = None
        _settle_future(future, self._result, error)

    def describe(self) -> str:
        return _watchdog._label_text(self._label)

    def timeout_error(self) -> dist.DistBackendError:
        group = self._group
        seconds = group.timeout_seconds() if group is not None else 0
        return dist.DistBackendError(
            f"mpidp: {self.describe()} on {group!r} did not complete within the group's "
            f"timeout of {seconds:g} s: some rank did not make the same call (or is still "
            f"busy). MPI cannot cancel a collective, so end the job (an uncaught error does; "
            f"mpidp.watchdog names the ranks that stall when MPIDP_TIMEOUT is set)")

    # -- torch's Work API ---------------------------------------------------------------

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0
        explicit = time.monotonic() + seconds if seconds > 0 else None
        # As on a CUDA stream, a later operation of a group completes after the earlier
        # ones: finish those first, so futures (and their callbacks) complete in order.
        for earlier in progress.before(self):
            earlier._wait_own(explicit)
        return self._wait_own(explicit)

    def _wait_own(self, explicit: float | None) -> bool:
        deadline = explicit if explicit is not None else self._deadline
        if self._state != "done":
            if progress.in_thread():
                progress.drive(self, deadline)  # a callback's collective (rule 3)
            elif self._chunks is not None or not self._claim():
                self._sleep_until_done(deadline, explicit is not None)
            else:
                self._wait_claimed(deadline, explicit is not None)
        for event, device in zip(self._events, _devices(self._result)):
            torch.cuda.current_stream(device).wait_event(event)
        if self._error is not None:
            raise self._error
        return True

    def _claim(self) -> bool:
        with progress.lock:
            claimed = self._state == "pending" and not self._failed_if_spoilt()
            if claimed:
                self._state = "claimed"
        return claimed

    def _failed_if_spoilt(self) -> bool:
        """Fail a pending Work of a group a differing call spoilt (under progress.lock).

        Whichever thread would complete it next, the progress thread or one that claims it
        in ``wait()``: a Work completes after the group's earlier ones, so every rank has
        seen the same checks when it gets here and fails the same Works (MPI may still end
        some of them on one rank, what it leaves on the communicators being undefined).
        """
        if self._group is None or getattr(self._group, "_aborted", None) is None:
            return False
        abandon(self._fail(self._group._aborted_error()))
        return True

    def _wait_claimed(self, deadline, explicit: bool) -> None:
        """Wait on this Work's own requests on this thread (rule 4)."""
        try:
            while self._handles:
                _engine.wait(self._handles[0], deadline=deadline)
                self._verify(self._handles.pop(0))
            if self._finish is not None:
                self._finish()
            self._record_events()  # as _test does: another thread's wait() may be asleep on it
        except TimeoutError:
            self._unclaim(explicit)
            return
        except Exception as error:
            self._error = error
        self._finish_claimed()

    def _unclaim(self, explicit: bool) -> None:
        """Past the deadline: give the Work back to the progress thread, or fail it."""
        with progress.lock:
            self._state = "pending"  # the progress thread (or a later wait) goes on
        progress.wake()
        if explicit:
            raise TimeoutError(f"Work.wait: {self.describe()} did not complete within the "
                               f"timeout (it goes on; wait again to finish it)")
        progress.expire(self)

    def _finish_claimed(self) -> None:
        with progress.lock:
            self._set_done()
        progress.wake()  # the group's queue may move on
        self._complete_future()

    def _sleep_until_done(self, deadline, explicit: bool) -> None:
        progress.wake()
        while not self._done.wait(None if deadline is None else
                                  max(0.0, deadline - time.monotonic())):
            if explicit:
                raise TimeoutError(f"Work.wait: {self.describe()} did not complete within the "
                                   f"timeout (it goes on; wait again to finish it)")
            progress.expire(self)  # not while another thread holds its claim (rule 9):
            deadline = time.monotonic() + 0.05  # look again soon

    def is_completed(self) -> bool:
        if self._state == "pending":
            if self._tracked:
                progress.wake()
            else:  # below MPI_THREAD_MULTIPLE: only the program's thread may test it
                with progress.lock:
                    if self._state == "pending":
                        self._test()
                if self._state == "done":
                    self._complete_future()
        return self._state == "done"

    def is_success(self) -> bool:
        return self._state == "done" and self._error is None

    def exception(self):
        return self._error

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        if not self._tracked and self._state == "pending":
            # below MPI_THREAD_MULTIPLE nothing else would complete it: finish it now
            try:
                self._wait_own(None)
            except Exception:  # kept in self._error: the future carries it
                pass
        with progress.lock:
            if self._future is None:
                self._future = new_future(self._result)
            done = self._state == "done" and not self._future_set
            if done:
                self._future_set = True
        if done:
            _settle_future(self._future, self._result, self._error)
        return self._future

    def source_rank(self) -> int:
        if self._source is None:
            raise ValueError("source_rank() is only available for a receive from any source")
        return self._source.Get_source()

    _source_rank = source_rank


class Done(dist.Work):
    """A Work that completed before it was returned (blocking calls; below THREAD_MULTIPLE)."""

    def __init__(self, result, source=None):
        super().__init__()
        self._result = result
        self._source = source
        self._future = None

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = new_future(self._result)
            self._future.set_result(self._result)
        return self._future

    def source_rank(self) -> int:
        if self._source is None:
            raise ValueError("source_rank() is only available for a receive from any source")
        return self._source

    _source_rank = source_rank


_local = threading.local()


def blocking(result) -> Done:
    """What a blocking call (asyncOp False) returns: one completed Work per thread, reused.

    torch waits on it and drops it; creating a Work costs about a microsecond.
    Per thread, so two threads' blocking calls never see each other's result.
    """
    try:
        done = _local.blocking
    except AttributeError:
        done = _local.blocking = Done([])
    done._result = result
    return done


class All(dist.Work):
    """Several Works as one (``_coalescing_manager``'s)."""

    def __init__(self, works):
        super().__init__()
        self._works = works

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        for work in self._works:
            work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def result(self) -> list[torch.Tensor]:
        return [t for work in self._works for t in work.result()]

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(
            lambda _: self.result())
