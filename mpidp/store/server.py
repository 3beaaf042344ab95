"""Rank 0's side of ``mpidp.store``: the table of keys, and the store thread that serves it.

Also the wire format both sides share (operations, answers, tags, ``_pack``). The
rules the store thread follows are in ``mpidp.store``'s docstring and docs/concurrency.md.
"""

from __future__ import annotations

import ctypes
import datetime
import struct
import sys
import threading
import time

import torch.distributed as dist
from mpi4py import MPI


_INLINE_BYTES = 32 * 1024  # per peer on rank 0; gloo's and NCCL's values are < 1 KiB
_TAG_REQUEST = 1  # a request's head, to rank 0; tags from _TAG_SLOTS belong to slots
_TAG_SLOTS = 16
_HEAD = struct.Struct("<BIdQ")  # op, slot, timeout in seconds (0: none), body length
_ANSWER = struct.Struct("<BQ")  # status, body length
_GRACE_SECONDS = 30.0  # past a parked operation's timeout: rank 0 must have answered by then
# Polling: MPI cannot wake a thread when a message comes, so both sides poll, and neither spins
# (docs/concurrency.md, the store's communicator). A thread that polls without pausing keeps a
# core and, on rank 0, the GIL: where ranks outnumber cores (or wait spinning in MPI collectives),
# the scheduler runs it late, and rank 0's main thread, which runs torch's start-up and its own
# store calls, waits for the GIL. So every poll that finds nothing sleeps (the GIL released); the
# pause doubles from 20 us up to a limit set by the time since the last message (_PAUSES: 250 us
# in a burst such as a start-up, 1 ms within a second, 20 ms within 10 s, then 100 ms). The store
# thread keeps the 1 ms limit while a wait is pending on rank 0 (a peer's, parked, or one of rank
# 0's own threads), since keys are coming; rank 0's own store calls wake it at once. A caller
# waiting for its answer pauses up to 1 ms (_CALLER_LONGEST). An idle
# poll's wake-up costs 30-170 us of CPU on a loaded machine: rank 0's whole process used 0.94 %
# of a core idle with 20 ms pauses, 0.43 % with 100 ms, 0.25 % over the TCP store. Before, the
# store thread polled without pausing for 2 ms after each request and the caller for 0.2 ms:
# gloo's start-up at 8 ranks on 2 loaded cores took 67-72 ms against 52-60 ms without (medians
# of 5, bench/store_startup.py; at 2 and 4 ranks the difference was within the noise).
_PAUSES = ((0.05, 250e-6), (1.0, 0.001), (10.0, 0.020), (float("inf"), 0.100))  # (quiet <, longest)
_CALLER_LONGEST = 0.001  # a caller's limit: with 250 us, 7 ranks polling took most of 2 cores


# Timer slack: Linux ends a thread's sleep up to its timer slack (50 us by default) after the time
# asked, so each pause above lasted about 50 us longer than it says, on both sides of a round trip.
# Polling threads set a slack of _SLACK_NS while they poll: the store thread for its life, a
# caller only while it waits for its answer (its thread is the program's: the slack it had comes
# back). A get from rank 1 at 2 ranks (mpich wheel, 2 cores) took 136 us with the default slack
# on both sides and 90 us with 1 us on both (medians, alternating launches; docs/store.md).
_SLACK_NS = 1000
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None


def _timer_slack(nanoseconds: int) -> int | None:
    """Set the calling thread's timer slack; return the one it had (None where not Linux)."""
    if _prctl is None:
        return None
    had = _prctl(_PR_GET_TIMERSLACK, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0),
                 ctypes.c_ulong(0))
    if had <= 0 or _prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(nanoseconds), ctypes.c_ulong(0),
                          ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        return None
    return had


def _next_pause(pause: float, longest: float) -> float:
    """The pause after a poll that found nothing: double the last, from 20 us, up to ``longest``."""
    return min(max(pause * 2, 20e-6), longest)


def _longest(quiet: float, expecting: bool) -> float:
    """The store thread's limit, ``quiet`` seconds after the last message (``_PAUSES``)."""
    for below, longest in _PAUSES:
        if quiet < below:
            return longest if not expecting else min(longest, _PAUSES[1][1])
    raise AssertionError("the last row of _PAUSES has no bound")


# operations
(_SET, _MULTI_GET, _WAIT, _ADD, _CAS, _DELETE, _NUM_KEYS, _CHECK, _APPEND,
 _MULTI_SET) = range(1, 11)
# answers
_OK, _TIMEOUT, _ERROR = range(3)


def _pack(fields: list[bytes]) -> bytes:
    lengths = struct.pack(f"<I{len(fields)}Q", len(fields), *map(len, fields))
    return b"".join([lengths, *fields])


def _unpack(body) -> list[bytes]:
    body = memoryview(body)
    (count,) = struct.unpack_from("<I", body)
    lengths = struct.unpack_from(f"<{count}Q", body, 4)
    fields, at = [], 4 + 8 * count
    for length in lengths:
        fields.append(bytes(body[at:at + length]))
        at += length
    return fields


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout) -> float:
    """A timeout as seconds; 0 means none (torch's ``Store::kNoTimeout``)."""
    if isinstance(timeout, datetime.timedelta):
        return max(timeout.total_seconds(), 0.0)
    return max(float(timeout), 0.0)


def _timed_out(keys: list[str], seconds: float) -> dist.DistStoreError:
    return dist.DistStoreError(f"mpidp store: wait timeout after {seconds:g} s for key(s) "
                               f"{', '.join(keys)} (no rank set them)")


# -- rank 0: the keys ----------------------------------------------------------------------------

class _Table:
    """The keys and values, on rank 0; every method is atomic (one lock)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # rank 0's own waiting threads
        self.parked: list = []  # (keys, deadline, answer) of remote waits
        self.waiting = 0  # rank 0's own threads in wait_here
        self.on_park_ready = None  # wakes the store thread

    def _touched(self) -> None:
        self.changed.notify_all()
        if self.parked and self.on_park_ready is not None:
            self.on_park_ready()

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            self.data[key] = value
            self._touched()

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        with self.lock:
            self.data.update(zip(keys, values))
            self._touched()

    def append(self, key: str, value: bytes) -> None:
        with self.lock:
            self.data[key] = self.data.get(key, b"") + value
            self._touched()

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            current = self.data.get(key, b"0")
            try:
                total = int(current) + amount
            except ValueError:
                raise dist.DistStoreError(f"mpidp store: add({key!r}, {amount}): the key holds "
                                          f"{current[:40]!r}, not an integer") from None
            self.data[key] = str(total).encode()
            self._touched()
            return total

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's rule: a missing key is set only if ``expected`` is empty."""
        with self.lock:
            if key not in self.data:
                if expected:
                    return expected
                self.data[key] = desired
                self._touched()
                return desired
            if self.data[key] == expected:
                self.data[key] = desired
                self._touched()
            return self.data[key]

    def delete(self, key: str) -> bool:
        with self.lock:
            return self.data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self.lock:
            return len(self.data)

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(key in self.data for key in keys)

    def values(self, keys: list[str]) -> list[bytes] | None:
        """The values of ``keys``, or None while one is missing (caller holds the lock)."""
        if all(key in self.data for key in keys):
            return [self.data[key] for key in keys]
        return None

    def wait_here(self, keys: list[str], seconds: float) -> list[bytes]:
        """Rank 0's own threads: the values once every key is set, or DistStoreError."""
        deadline = time.monotonic() + seconds if seconds else None
        with self.lock:
            self.waiting += 1
            try:
                while (found := self.values(keys)) is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise _timed_out(keys, seconds)
                    self.changed.wait(left)
                return found
            finally:
                self.waiting -= 1

    def expecting(self) -> bool:
        """Whether a wait is pending (a peer's, parked, or one of rank 0's own threads)."""
        return bool(self.parked) or self.waiting > 0

    def park(self, keys: list[str], seconds: float, answer) -> None:
        """A peer's wait: ``answer(values or None)`` now, or once ready, or at its deadline."""
        with self.lock:
            found = self.values(keys)
            if found is None:
                deadline = time.monotonic() + seconds if seconds else float("inf")
                self.parked.append((keys, deadline, answer))
                return
        answer(found)

    def settle(self, now: float) -> float:
        """Answer parked waits that are ready or past their deadline; the next deadline."""
        done, soonest = [], float("inf")
        with self.lock:
            kept = []
            for keys, deadline, answer in self.parked:
                found = self.values(keys)
                if found is not None or now >= deadline:
                    done.append((answer, found))
                else:
                    kept.append((keys, deadline, answer))
                    soonest = min(soonest, deadline)
            self.parked = kept
        for answer, found in done:
            answer(found)
        return soonest


# -- rank 0: the store thread ----------------------------------------------------------------------

class _Service:
    """Rank 0's store thread, which never blocks in MPI: answers the other ranks' operations."""

    def __init__(self, comm: MPI.Intracomm, table: _Table):
        self.comm, self.table = comm, table
        self.peers = list(range(1, comm.Get_size()))
        self.inboxes = [bytearray(_INLINE_BYTES) for _ in self.peers]
        self.receives = [self._post(i) for i in range(len(self.peers))]
        self.bodies: list = []  # (request, buffer, peer, op, slot, timeout) of long requests
        self.sends: list = []  # (request, buffer) until complete
        self.wake = threading.Event()  # a key came that a parked wait needs
        self.stopping = False
        table.on_park_ready = self.wake.set
        self.thread = threading.Thread(target=self._run, name="mpidp-store", daemon=True)
        self.thread.start()

    def _post(self, index: int) -> MPI.Request:
        return self.comm.Irecv([self.inboxes[index], MPI.BYTE], self.peers[index], _TAG_REQUEST)

    def _run(self) -> None:
        _timer_slack(_SLACK_NS)  # this thread's own: it polls all its life
        try:
            self._serve_until_stopped()
        except Exception as error:  # never die silently: every peer would wait for its timeout
            sys.stderr.write(f"[mpidp rank 0] the store thread failed and stops: "
                             f"{type(error).__name__}: {error}\n")
            raise

    def _serve_until_stopped(self) -> None:
        pause, statuses = 0.0, [MPI.Status() for _ in self.peers]
        active = time.monotonic()
        while not self.stopping:
            busy = self._poll(statuses)
            now = time.monotonic()
            soonest = self.table.settle(now) if self.table.parked else float("inf")
            if busy or self.wake.is_set():
                active, pause = now, 0.0  # more may follow at once: poll again without pausing
                self.wake.clear()
                continue
            pause = _next_pause(pause, _longest(now - active, self.table.expecting()))
            self.wake.wait(min(pause, max(soonest - now, 0.0)))

    def _poll(self, statuses: list) -> bool:
        busy = False
        ready = MPI.Request.Testsome(self.receives, statuses)
        for done, index in enumerate(ready or ()):
            busy = True
            count = statuses[done].Get_count(MPI.BYTE)  # statuses in completion order
            self._heard(self.peers[index], bytes(self.inboxes[index][:count]))
            self.receives[index] = self._post(index)
        if self.bodies:
            still = []
            for entry in self.bodies:
                if entry[0].Test():
                    busy = True
                    self._serve(entry[2], entry[3], entry[4], entry[5], entry[1])
                else:
                    still.append(entry)
            self.bodies = still
        if self.sends:
            self.sends = [(r, b) for r, b in self.sends if not r.Test()]
        return busy

    def _heard(self, peer: int, message: bytes) -> None:
        op, slot, timeout, length = _HEAD.unpack_from(message)
        if len(message) == _HEAD.size + length or length == 0:
            self._serve(peer, op, slot, timeout, message[_HEAD.size:])
            return
        body = bytearray(length)  # the body follows on the slot's own tag
        request = self.comm.Irecv([body, MPI.BYTE], peer, _TAG_SLOTS + 3 * slot)
        self.bodies.append((request, body, peer, op, slot, timeout))

    def _serve(self, peer: int, op: int, slot: int, timeout: float, body) -> None:
        def answer(found, fields_of=lambda found: found):
            if found is None:
                self._answer(peer, slot, _TIMEOUT, b"")
            else:
                self._answer(peer, slot, _OK, _pack(fields_of(found)))
        try:
            fields = _unpack(body)
            if op in (_MULTI_GET, _WAIT):
                keys = [field.decode() for field in fields]
                self.table.park(keys, timeout, answer if op != _WAIT else
                                lambda found: answer(found, lambda _: []))
            else:
                self._answer(peer, slot, _OK, _pack(_immediate(self.table, op, fields)))
        except Exception as error:  # noqa: BLE001  the caller raises it
            text = str(error) if isinstance(error, dist.DistStoreError) else \
                f"mpidp store: operation {op}: {type(error).__name__}: {error}"
            self._answer(peer, slot, _ERROR, text.encode())

    def _answer(self, peer: int, slot: int, status: int, body: bytes) -> None:
        """Send an answer (the store thread only: ``settle`` runs there too)."""
        head = _ANSWER.pack(status, len(body))
        inline = len(head) + len(body) <= _INLINE_BYTES
        message = head + body if inline else head
        self.sends.append((self.comm.Isend([message, MPI.BYTE], peer, _TAG_SLOTS + 3 * slot + 1),
                           message))
        if not inline:
            self.sends.append((self.comm.Isend([body, MPI.BYTE], peer,
                                               _TAG_SLOTS + 3 * slot + 2), body))

    def stop(self) -> None:
        """At exit, before MPI_Finalize: end the thread, cancel its receives, finish its sends."""
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=5)
        for request in self.receives + [entry[0] for entry in self.bodies]:
            request.Cancel()
            request.Wait()
        deadline = time.monotonic() + 1.0
        while self.sends and time.monotonic() < deadline:
            self.sends = [(r, b) for r, b in self.sends if not r.Test()]


def _immediate(table: _Table, op: int, fields: list[bytes]) -> list[bytes]:
    """The operations that never wait, on rank 0's table: the answer's fields."""
    if op == _MULTI_SET:
        half = len(fields) // 2
        table.multi_set([key.decode() for key in fields[:half]], fields[half:])
        return []
    if op == _NUM_KEYS:
        return [str(table.num_keys()).encode()]
    if op == _CHECK:
        return [b"1" if table.check([key.decode() for key in fields]) else b""]
    key = fields[0].decode()
    if op == _SET:
        table.set(key, fields[1])
        return []
    if op == _APPEND:
        table.append(key, fields[1])
        return []
    if op == _ADD:
        return [str(table.add(key, int(fields[1]))).encode()]
    if op == _CAS:
        return [table.compare_set(key, fields[1], fields[2])]
    if op == _DELETE:
        return [b"1" if table.delete(key) else b""]
    raise ValueError(f"unknown store operation {op}")
