"""The torch.distributed backend's Works and the one thread that progresses them.

The rules, which make every rank issue the same operations in the same order on
each communicator and keep every rank from waiting on something only a blocked
thread of its own could start (docs/concurrency.md has the whole model):

1. A program thread starts every operation nonblocking, in its program order,
   on the group's communicators. torch requires a group's collectives to be
   called in the same order on every rank; MPI matches them per communicator in
   the order they start.
2. The progress thread never blocks in MPI. It tests started requests,
   completes Works and their futures (in each group's order), and starts the
   next chunk of a chunked all_reduce. Since it never blocks, no rank can sit
   in one group's collective while it owes a peer the start of another group's
   (two groups over the same ranks, as in FSDP2's HSDP, issued in different
   orders on different ranks).
3. A chunked all_reduce (larger than ``MPIDP_CHUNK_MB``) goes one chunk at a
   time on its group's chunk communicator. Only the progress thread starts
   chunks, and only for the oldest unfinished Work of the group (the head of
   its queue), so the chunk communicator carries the group's chunked
   all_reduces in the group's order on every rank. One chunk in flight moves
   64 MB as fast as blocking 4 MiB chunks do (16.8 vs 17.2 ms, MPICH, 2 ranks).
4. A program thread that waits blocks only in ``MPI_Wait`` on a request it
   started (everything the rank owes has been started, or will be by rule 2),
   or sleeps on a chunked Work's event. A future's callback runs on the
   progress thread; a collective it issues is driven there (rule 2), not
   waited on.
5. Every Work has a deadline: the group's timeout (``init_process_group``'s
   ``timeout``, torch's default otherwise). Past it, ``wait()`` and the future
   fail with ``torch.distributed.DistBackendError`` naming the operation; MPI
   cannot cancel a collective, so its buffers stay referenced until exit.
   While a Work is pending the progress thread records it with the stall
   watchdog (``MPIDP_TIMEOUT``), which names it if it stalls.
6. Device memory follows torch's Work contract. A staged result is copied back
   on the stream of the thread that completes the Work, and an event recorded
   after that copy (one per device) is what ``wait()`` makes the caller's
   current stream wait on. A chunked all_reduce of device memory the library
   cannot read is copied to pinned host memory by the progress thread, on a
   side stream ordered after an event of the caller's stream, and polled: the
   caller returns at once and the progress thread never waits on a device.

Below ``MPI_THREAD_MULTIPLE`` there is no progress thread: every call completes
before it returns (chunks as blocking calls on the calling thread), and a
message completes in ``wait()`` or ``is_completed()``.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time

import torch
import torch.distributed as dist

from . import comm as _comm
from . import runtime as _runtime
from . import watchdog as _watchdog

__all__ = ["Chunks", "Done", "Work", "All", "blocking", "progress"]


class Chunks:
    """A large all_reduce as chunks of ``chunk_bytes``, one in flight (see rule 3).

    Args:
        tensor: what the chunks reduce in place (host memory where the library cannot
            read device memory).
        stage_from: ``(device tensor, event recorded on the caller's stream)``: first
            copy that tensor into ``tensor`` (pinned) on the progress thread's side
            stream after the event, polled rather than waited on (rule 6). The caller
            then returns at once, as autograd's thread must to keep queueing the backward.
    """

    def __init__(self, tensor: torch.Tensor, op: str, comm, chunk_bytes: int, *,
                 stage_from: tuple | None = None):
        self.pieces = tensor.view(-1).split(max(1, chunk_bytes // tensor.element_size()))
        self.op, self.comm = op, comm
        self._next = 0
        self._handle: _comm.Handle | None = None
        self._host = tensor
        self.moved = False  # a chunk started since the progress thread last looked
        self._stage_from = stage_from
        self._staged = None  # the side stream's event once the copy is queued

    def _staging_done(self) -> bool:
        if self._stage_from is None:
            return True
        source, ready = self._stage_from
        if self._staged is None:
            stream = _side_stream(source.device)
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                self._host.copy_(source, non_blocking=True)
                source.record_stream(stream)
                self._staged = torch.cuda.Event()
                self._staged.record(stream)
        if not self._staged.query():
            return False
        self._stage_from = None
        return True

    def advance(self) -> bool:
        """Start the next chunk once the last one is done; True when all are (progress thread)."""
        if not self._staging_done():
            return False
        while True:
            if self._handle is not None:
                if not self._handle.is_completed():
                    return False
                self._handle = None
            if self._next == len(self.pieces):
                return True
            self._handle = _comm.iallreduce(self.pieces[self._next], self.op, comm=self.comm)
            self._next += 1
            self.moved = True

    def run(self) -> None:
        """All the chunks as blocking calls on this thread (below MPI_THREAD_MULTIPLE)."""
        if self._stage_from is not None:
            self._host.copy_(self._stage_from[0])  # on the caller's stream, synchronously
            self._stage_from = None
        for piece in self.pieces[self._next:]:
            _comm.allreduce(piece, self.op, comm=self.comm)
        self._next = len(self.pieces)

    def in_flight(self) -> list:
        return [] if self._handle is None else [self._handle]


_side_streams: dict = {}  # device -> the progress thread's staging stream (that thread only)


def _side_stream(device: torch.device):
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def new_future(result) -> torch.futures.Future:
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


class Work(dist.Work):
    """A pending collective or message: mpidp.comm handles (or Chunks), the tensors torch gets.

    Args:
        handles: started requests, completed in order.
        result: what ``result()`` and the future give.
        finish: run once the requests are done (copies back, divisions).
        group: the group that issued it (its name, timeout and order).
        ordered: completes in the group's order (collectives); False for messages.
        source: a receive whose status names the sender.
        chunks: a chunked all_reduce, driven by the progress thread.
        label: what it is, for stall reports and errors (see ``mpidp.watchdog``).
        deadline: ``time.monotonic()`` after which it fails (the group's timeout).
    """

    def __init__(self, handles, result, *, finish=None, group=None, ordered=True, source=None,
                 chunks: Chunks | None = None, label=None, deadline: float | None = None):
        super().__init__()
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
        try:
            if self._chunks is not None:
                if not self._chunks.advance():
                    return False
            else:
                while self._handles:
                    if not self._handles[0].is_completed():
                        return False
                    self._handles.pop(0)
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
        _settle_future(future, self._result, self._error)

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
                progress.drive(self, deadline)  # a callback's collective (rule 4)
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
            claimed = self._state == "pending"
            if claimed:
                self._state = "claimed"
        return claimed

    def _wait_claimed(self, deadline, explicit: bool) -> None:
        """Wait on this Work's own requests on this thread (rule 4)."""
        try:
            for handle in self._handles:
                wait_request(handle, deadline)
            self._handles = []
            if self._finish is not None:
                self._finish()
        except TimeoutError:
            with progress.lock:
                self._state = "pending"  # the progress thread (or a later wait) goes on
            progress.wake()
            if explicit:
                raise
            progress.expire(self)
            return
        except Exception as error:
            self._error = error
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
            progress.expire(self)

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
        return self._source.status.Get_source()

    _source_rank = source_rank


_SPIN_SECONDS = 0.05  # a wait tests without sleeping this long, then backs off to 1 ms


def wait_request(handle: _comm.Handle, deadline: float | None) -> None:
    """``handle.wait()``, or raise TimeoutError at ``deadline``.

    MPI has no timed wait, so this tests the request: without sleeping for
    ``_SPIN_SECONDS`` (a nonblocking collective moves only inside MPI calls,
    and a sleep between tests stalls it: with a 1 ms spin, a 4 MiB all_reduce
    took 2.3 ms against 1.8 ms blocking), then sleeping from 20 us doubling to
    1 ms, so a rank that waits on a late peer does not hold a core.
    """
    if deadline is None:
        handle.wait()
        return
    if handle.is_completed():
        return
    slot = _watchdog.begin(handle._label, handle._scope, True)
    try:
        spin_until, sleep = time.monotonic() + _SPIN_SECONDS, 0.0
        while not handle.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError("the operation did not complete before its deadline")
            if now > spin_until:
                sleep = min(max(2 * sleep, 20e-6), 1e-3)
                time.sleep(sleep)
    finally:
        slot.current = None


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


class _Progress:
    """The progress thread (rule 2): tests requests, starts chunks, completes Works.

    It polls with ``MPI_Test`` (a thread blocked in ``MPI_Wait`` could not see
    requests started after it began waiting): without sleeping for
    ``spin_seconds`` after a request arrives or completes, then sleeping from
    20 us doubling up to ``_MAX_SLEEP``; a new request wakes it at once.
    """

    _MAX_SLEEP = 500e-6

    def __init__(self):
        self.lock = threading.Lock()
        self._cv = threading.Condition(self.lock)
        self._queues: dict = collections.defaultdict(collections.deque)  # group -> its order
        self._loose: list[Work] = []  # messages: each completes on its own
        self._abandoned: list = []  # what MPI may still write into after a Work failed
        self._later: list[Work] = []  # done while a callback drove progress: futures to set
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._added = False  # a request came since the thread last looked
        self.spin_seconds = 0.01

    def add(self, work: Work) -> None:
        with self._cv:
            work._tracked = True
            self._added = True
            if work._ordered:
                self._queues[work._group].append(work)
            else:
                self._loose.append(work)
            if self._thread is None:
                self._start()
            self._cv.notify()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def before(self, work: Work) -> list[Work]:
        """The works of ``work``'s group queued before it, not yet done."""
        if not work._ordered or work._state == "done":
            return []
        with self._cv:
            earlier = []
            for other in self._queues.get(work._group, ()):
                if other is work:
                    return earlier
                if other._state != "done":
                    earlier.append(other)
            return []

    def busy(self, group) -> bool:
        """Whether ``group`` has operations not yet done."""
        with self._cv:
            return any(w._group is group and w._state != "done"
                       for queue in [*self._queues.values(), self._loose] for w in queue)

    def in_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def expire(self, work: Work) -> None:
        """Fail ``work`` with the group's timeout error (its deadline has passed)."""
        with self._cv:
            if work._state == "done":
                return
            self._abandoned.extend(work._fail(work.timeout_error()))
        self._end_job_if_awaited(work)
        work._complete_future()

    @staticmethod
    def _end_job_if_awaited(work: Work) -> None:
        """A timed-out Work whose future someone already holds ends the job (rule 5).

        torch's C++ DDP reducer waits on that future and crashes (SIGSEGV, torch
        2.13) when it fails instead of completing, so, as ProcessGroupNCCL does by
        default (TORCH_NCCL_ASYNC_ERROR_HANDLING), the error is printed and the
        job torn down. ``wait()`` and futures taken later raise it instead.
        """
        if work._future is not None and not work._future_set and _runtime._abort_enabled:
            _runtime._abort([str(work._error), "a future torch waits on (DDP, a comm hook) "
                             "timed out: ending the job, as ProcessGroupNCCL does"], 1)

    def abort(self, group, error: BaseException) -> None:
        """Fail every unfinished Work of ``group`` with ``error``."""
        with self._cv:
            failed = [w for queue in [*self._queues.values(), self._loose] for w in queue
                      if w._group is group and w._state != "done"]
            for work in failed:
                self._abandoned.extend(work._fail(error))
            self._cv.notify()
        for work in failed:
            work._complete_future()

    def drive(self, work: Work, deadline: float | None) -> None:
        """Progress everything on this thread until ``work`` is done (a callback's collective).

        Futures of other Works finished meanwhile are set later by the progress
        loop, so callbacks never nest.
        """
        while work._state != "done":
            with self._cv:
                self._later.extend(self._test())
            if work._state == "done":
                break
            if deadline is not None and time.monotonic() > deadline:
                self.expire(work)
                break
            time.sleep(0)
        work._complete_future()

    def _start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mpidp-progress", daemon=True)
        self._thread.start()

    def _pending(self) -> bool:
        return bool(self._loose) or any(self._queues.values()) or bool(self._later)

    def _run(self) -> None:
        slot = _watchdog.slot()
        sleep, busy_since = 0.0, time.monotonic()
        while True:
            with self._cv:
                while not self._pending() and not self._stopping:
                    slot.current = None
                    self._cv.wait()
                if self._stopping:
                    slot.current = None
                    return
                done = self._later + self._test()
                self._later = []
                added, self._added = self._added, False
                slot.current = self._oldest()
            for work in done:  # outside the lock: callbacks may issue collectives
                work._complete_future()
            now = time.monotonic()
            if done or added:
                busy_since, sleep = now, 0.0
            if now - busy_since < self.spin_seconds:
                time.sleep(0)  # lets the program's threads take the GIL
                continue
            sleep = min(max(2 * sleep, 20e-6), self._MAX_SLEEP)
            with self._cv:
                self._cv.wait(sleep)

    def _test(self) -> list[Work]:
        """Works done now (under the lock). Past its deadline, a Work fails."""
        done = []
        now = time.monotonic()
        for group, queue in list(self._queues.items()):
            while queue:
                work = queue[0]
                chunks = work._chunks
                if work._state == "pending" and not work._test():
                    if chunks is not None and chunks.moved:
                        # a chunk started: keep testing without sleeping (a nonblocking
                        # collective moves only inside MPI calls)
                        chunks.moved, self._added = False, True
                    if work._deadline is not None and now > work._deadline:
                        self._abandoned.extend(work._fail(work.timeout_error()))
                        self._end_job_if_awaited(work)
                    else:
                        break
                elif work._state == "claimed":
                    break
                queue.popleft()
                done.append(work)
            if not queue:
                del self._queues[group]
        loose = []
        for work in self._loose:
            if work._state == "pending" and not work._test() and (
                    work._deadline is None or now <= work._deadline):
                loose.append(work)
                continue
            if work._state == "pending":
                self._abandoned.extend(work._fail(work.timeout_error()))
                self._end_job_if_awaited(work)
            if work._state == "claimed":
                loose.append(work)
            else:
                done.append(work)
        self._loose = loose
        return done

    def _oldest(self):
        """The watchdog's record for the oldest pending Work (rule 5), or None."""
        # collectives only: a receive may wait for a late message on purpose
        heads = [queue[0] for queue in self._queues.values() if queue]
        heads = [w for w in heads if w._state == "pending"]
        if not heads:
            return None
        oldest = min(heads, key=lambda w: w._since)
        return (oldest._label, oldest._since, oldest._scope, True)

    def stop(self) -> None:
        """At exit, before MPI_Finalize: no MPI call from this thread after it."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None


progress = _Progress()
