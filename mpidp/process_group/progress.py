"""The backend's progress thread, and the rules every Work of the backend follows.

One thread per process tests the pending operations of the torch.distributed
backend ``"mpidp"`` through the engine's driver (``mpidp.comm.progress``), which starts
the next chunk of a chunked all_reduce (``mpidp.process_group.chunks``), and completes
Works (``mpidp.process_group.work``) and their futures. This module decides only who
tests and when: the engine tests, and paces every wait with its one back-off.

The rules that make every rank issue the same operations in the same order on
each communicator, and keep every rank from waiting on something only a blocked
thread of its own could start, are numbered once, in docs/concurrency.md ("The
rules"); code cites them by those numbers. Here: a program thread starts each
operation nonblocking in program order (rule 2); this thread only tests requests,
completes Works and their futures in each group's order, and starts chunks, and a
blocking step of a future's callback is driven here, never waited on (rule 3);
only this thread starts chunks, one in flight, for the head of each group's queue,
on the group's chunk communicator (rule 7); every Work has the group's deadline,
and a pending Work is recorded with the stall watchdog (rule 8); staged device
memory follows torch's Work contract (rule 6).

Below ``MPI_THREAD_MULTIPLE`` there is no progress thread: every call completes
before it returns (chunks as blocking calls on the calling thread), and a
message completes in ``wait()`` or ``is_completed()``.
"""

from __future__ import annotations

import collections
import threading
import time
from .. import exits as _exits
from .. import watchdog as _watchdog
from ..comm import progress as _engine


__all__ = ["progress"]


class _Progress:
    """The progress thread (rule 3): tests operations, starts chunks, completes Works.

    It tests (a thread blocked in ``MPI_Wait`` could not see requests started after it
    began waiting), paced by the engine's back-off (``mpidp.comm.progress.Backoff``) with
    no back-to-back spin (the program's threads need the GIL): the core yielded between
    rounds for ``spin_seconds`` after an operation arrives or completes, then sleeps from
    20 us doubling up to ``_MAX_SLEEP``; a new operation wakes it at once.
    """

    _MAX_SLEEP = 500e-6

    def __init__(self):
        self.lock = threading.Lock()
        self._cv = threading.Condition(self.lock)
        self._queues: dict = collections.defaultdict(collections.deque)  # group -> its order
        self._loose: list = []  # messages: each completes on its own
        self._abandoned: list = []  # what MPI may still write into after a Work failed
        self._later: list = []  # done while a callback drove progress: futures to set
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._added = False  # a request came since the thread last looked
        self.spin_seconds = 0.01

    def add(self, work) -> None:
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

    def before(self, work) -> list:
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

    def expire(self, work) -> None:
        """Fail ``work`` with the group's timeout error (its deadline has passed).

        Not while another thread holds its claim (``Work._claim``): that thread is inside its
        requests and finish, and fails it at its own deadline (rule 9)."""
        with self._cv:
            if work._state != "pending":
                return
            self._abandoned.extend(work._fail(work.timeout_error()))
        self._end_job_if_awaited(work)
        work._complete_future()

    @classmethod
    def _end_job_if_awaited(cls, work) -> None:
        """A timed-out Work whose future someone already holds ends the job (rule 8)."""
        if work._future is not None and not work._future_set:
            cls.end_job_for(work, "timed out")

    @staticmethod
    def end_job_for(work, what: str) -> None:
        """End the job for a failed Work whose future was taken while it was pending.

        torch's C++ DDP reducer waits on that future and crashes (SIGSEGV, torch
        2.13) when it fails instead of completing: seen with a timeout, and with a
        call check that found another rank's all_reduce of a different size. So, as
        ProcessGroupNCCL does by default (TORCH_NCCL_ASYNC_ERROR_HANDLING), the error
        is printed and the job torn down. ``wait()`` and futures taken later raise it.
        With the abort off (``MPIDP_ABORT_ON_EXCEPTION=0``) the future fails instead.
        """
        if _exits._abort_enabled:
            _exits._abort([str(work._error), f"a future torch waits on (DDP, a comm hook) "
                             f"{what}: ending the job, as ProcessGroupNCCL does"], 1)

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

    def drive(self, work, deadline: float | None) -> None:
        """Progress everything on this thread until ``work`` is done (a callback's collective).

        Futures of other Works finished meanwhile are set later by the progress
        loop, so callbacks never nest.
        """
        backoff = _engine.Backoff(spin=0.0)
        while work._state != "done":
            with self._cv:
                self._later.extend(self._test())
            if work._state == "done":
                break
            if deadline is not None and time.monotonic() > deadline:
                self.expire(work)  # not while a program thread holds its claim: it ends it
            backoff.pause()
        work._complete_future()

    def drive_until(self, done) -> None:
        """Progress everything on this thread until ``done()`` (an engine test) is true.

        What a wait of the engine becomes on this thread (rule 3): a blocking step of an
        mpidp.comm call, a wait on an operation, through ``mpidp.comm.progress.set_driver``.
        Never called from inside ``_test`` (chunks start without such steps), so it does
        not nest.
        """
        backoff = _engine.Backoff(spin=0.0)
        while not done():
            with self._cv:
                self._later.extend(self._test())
            backoff.pause()

    def _start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mpidp-progress", daemon=True)
        self._thread.start()
        _engine.set_driver(self._thread.ident, self.drive_until)

    def _pending(self) -> bool:
        return bool(self._loose) or any(self._queues.values()) or bool(self._later)

    def _nap(self, seconds: float) -> None:
        with self._cv:
            self._cv.wait(seconds)

    def _run(self) -> None:
        slot = _watchdog.slot()
        backoff = _engine.Backoff(spin=0.0, yield_for=self.spin_seconds,
                                  max_sleep=self._MAX_SLEEP, sleep=self._nap)
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
            if done or added:
                backoff.reset()
            backoff.pause()

    def _test(self) -> list:
        """Works done now (under the lock). Past its deadline, a Work fails."""
        done = []
        now = time.monotonic()
        for group, queue in list(self._queues.items()):
            while queue:
                work = queue[0]
                chunks = work._chunks
                if work._state == "pending" and not work._test():  # fails it if spoilt
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
        """The watchdog's record for the oldest pending Work (rule 8), or None."""
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
        self.forget_thread()

    def forget_thread(self) -> None:
        """No progress thread any more (stopped, or this is a forked child)."""
        self._thread = None
        _engine.set_driver(None, None)  # a later thread may be given the same id


progress = _Progress()
