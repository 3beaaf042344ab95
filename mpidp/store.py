"""A ``torch.distributed.Store`` served over MPI: only the processes of the job reach it.

torch's ``TCPStore`` listens on a port that anyone on the network can connect
to and write into; it has no authentication. An MPI job already has a private
channel between its ranks, so mpidp's default store travels over MPI instead
(``mpidp.rendezvous`` hands it to torch for ``"mpidp"``, gloo and NCCL alike).

**Who holds what.** Rank 0 holds the keys (a ``_Table``). Its own threads use
the table directly. Every other rank sends each operation to rank 0 and waits
for the answer; any thread may do so, several at once. Rank 0 answers from
one thread of its own, the *store thread*, started by the first store of the
process (at the first rendezvous).

**The rules** (docs/concurrency.md has the whole model):

1. The store's messages travel on a communicator of their own, a duplicate of
   ``MPI.COMM_WORLD`` made by ``start()`` at ``import mpidp`` (collective, on
   every rank, before any thread of mpidp's exists). Only point-to-point
   messages go there, never a collective, so nothing on it is matched by
   order across ranks.
2. The store thread never blocks in MPI. It keeps one receive posted *per
   peer* (not ``ANY_SOURCE``, which was seen to miss messages from another
   node with MPICH over UCX: issue 29), tests it with ``Testsome``, answers
   with nonblocking sends it tests later, and sleeps on an event between
   polls. An operation that must wait (``get`` or ``wait`` on a key not yet
   set) is parked on rank 0 and answered when the key arrives or the store's
   timeout passes; the store thread keeps serving meanwhile.
3. A calling thread waits only on its own requests: each operation takes a
   *slot* of its rank (its own tags), posts the receive for its answer, then
   sends; it tests that receive until the answer comes. An answer depends on
   nothing but the store thread, which never waits on a collective, so a
   store operation can never be the missing link of a rank that owes a peer
   a collective.
4. A pending request owns its buffer until it completes; a slot whose answer
   never came (rank 0 gone) is never used again.

Below ``MPI_THREAD_MULTIPLE`` the store thread may not call MPI beside the
program's threads, so ``mpidp.rendezvous`` keeps torch's ``TCPStore`` there.
The store thread is Python: while a thread of rank 0 holds the GIL for long
(pure-Python work that calls no C), the other ranks' operations wait for it,
where ``TCPStore``'s C++ server would not. torch uses the store at start-up,
in barriers and in ``new_group``, not per step.

Messages carry no pickles: an operation is a code, a slot, a timeout and
length-prefixed byte strings (``_pack``). A message longer than
``_INLINE_BYTES`` sends its body as a second message on the slot's own tag.
"""

from __future__ import annotations

import atexit
import datetime
import os
import struct
import sys
import threading
import time

import torch.distributed as dist
from mpi4py import MPI

from . import runtime

__all__ = ["MPIStore", "start", "started"]

_INLINE_BYTES = 32 * 1024  # per peer on rank 0; gloo's and NCCL's values are < 1 KiB
_TAG_REQUEST = 1  # a request's head, to rank 0; tags from _TAG_SLOTS belong to slots
_TAG_SLOTS = 16
_HEAD = struct.Struct("<BIdQ")  # op, slot, timeout in seconds (0: none), body length
_ANSWER = struct.Struct("<BQ")  # status, body length
_GRACE_SECONDS = 30.0  # past a parked operation's timeout: rank 0 must have answered by then
# Polling: a poll costs ~0.1 ms of CPU (MPICH's progress engine). After a request the store
# thread polls without pausing for 2 ms, then pauses up to 1 ms between polls; after a second
# without one, up to 20 ms (0.5 % of a core), so the first request after a quiet spell waits up
# to 20 ms more, unless rank 0 used the store itself just before, and the ones right after it
# do not. A caller polls for its answer without
# pausing for 0.2 ms, then pauses up to 1 ms. With 5 ms pauses gloo's start-up at 2 ranks took
# 42 ms against the TCP store's 31 ms (bench/store_startup.py).
_SPIN_SECONDS = (0.002, 0.0002)  # store thread, caller
_MAX_SLEEP = 0.001
_IDLE_SECONDS, _IDLE_SLEEP = 1.0, 0.020

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
            while (found := self.values(keys)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise _timed_out(keys, seconds)
                self.changed.wait(left)
            return found

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
    """Rank 0's store thread (rule 2): answers every other rank's operations on ``table``."""

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
                active, pause = now, 0.0
                self.wake.clear()
            elif now - active > _SPIN_SECONDS[0]:
                longest = _MAX_SLEEP if now - active < _IDLE_SECONDS else _IDLE_SLEEP
                pause = min(max(pause * 2, 20e-6), longest)
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


# -- the other ranks: the caller's side ------------------------------------------------------------

class _Client:
    """A rank other than 0: sends each operation to rank 0 and waits for its answer (rule 3)."""

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        self.lock = threading.Lock()
        self.free: list[int] = []
        self.next_slot = 0
        self.max_slots = (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - _TAG_SLOTS) // 3
        self.abandoned: list = []  # what MPI may still write into: kept until exit

    def _take(self) -> int:
        with self.lock:
            if self.free:
                return self.free.pop()
            if self.next_slot >= self.max_slots:
                raise dist.DistStoreError(f"mpidp store: more than {self.max_slots} operations "
                                          f"in flight on this rank")
            self.next_slot += 1
            return self.next_slot - 1

    def call(self, op: int, fields: list[bytes], timeout: float, what: str) -> list[bytes]:
        """Send one operation to rank 0 and return its answer's fields.

        Raises:
            DistStoreError: the keys did not come within ``timeout`` seconds
                (rank 0 says so), rank 0 raised, or it did not answer within
                ``_GRACE_SECONDS`` more.
        """
        slot = self._take()
        base = _TAG_SLOTS + 3 * slot
        body = _pack(fields)
        head = _HEAD.pack(op, slot, timeout, len(body))
        inline = len(head) + len(body) <= _INLINE_BYTES
        message = head + body if inline else head
        inbox = bytearray(_INLINE_BYTES)
        pending = [self.comm.Irecv([inbox, MPI.BYTE], 0, base + 1)]
        sends = [self.comm.Isend([message, MPI.BYTE], 0, _TAG_REQUEST)]
        if not inline:
            sends.append(self.comm.Isend([body, MPI.BYTE], 0, base))
        limit = None if not timeout else time.monotonic() + timeout + _GRACE_SECONDS
        status = MPI.Status()
        if not self._wait(pending[0], limit, status):
            self.abandoned.append((pending, sends, inbox, message, body))
            raise dist.DistStoreError(f"mpidp store: rank 0 did not answer {what} within "
                                      f"{timeout + _GRACE_SECONDS:g} s")
        answer = bytes(inbox[:status.Get_count(MPI.BYTE)])
        code, length = _ANSWER.unpack_from(answer)
        if len(answer) == _ANSWER.size + length:
            reply = answer[_ANSWER.size:]
        else:  # the body, sent right after the head
            reply = bytearray(length)
            pending.append(self.comm.Irecv([reply, MPI.BYTE], 0, base + 2))
            if not self._wait(pending[-1], limit, status):
                self.abandoned.append((pending, sends, inbox, message, body, reply))
                raise dist.DistStoreError(f"mpidp store: rank 0's answer to {what} stopped "
                                          f"half-way")
        MPI.Request.Waitall(sends)
        with self.lock:
            self.free.append(slot)
        if code == _TIMEOUT:
            raise _timed_out([field.decode() for field in fields], timeout)
        if code == _ERROR:
            raise dist.DistStoreError(bytes(reply).decode())
        return _unpack(reply)

    @staticmethod
    def _wait(request: MPI.Request, limit: float | None, status: MPI.Status) -> bool:
        pause, start = 0.0, time.monotonic()
        while not request.Test(status):
            now = time.monotonic()
            if limit is not None and now > limit:
                return False
            if now - start > _SPIN_SECONDS[1]:
                pause = min(max(pause * 2, 20e-6), _MAX_SLEEP)
                time.sleep(pause)
        return True


# -- the store ---------------------------------------------------------------------------------------

class _Shared:
    comm: MPI.Intracomm | None = None  # the store's communicator (rule 1)
    table: _Table | None = None  # rank 0
    service: _Service | None = None  # rank 0, once a store exists
    client: _Client | None = None  # other ranks, once a store exists
    lock = threading.Lock()
    stores: list = []  # every MPIStore made: torch may hold one after Python drops it


_shared = _Shared()


def start(world: MPI.Intracomm) -> None:
    """Create the store's communicator (collective over ``world``; ``import mpidp`` calls it).

    Every rank must call it at the same point of its ``world`` collectives;
    later calls do nothing. One rank: no communicator (the store is local).
    """
    if _shared.comm is not None or world.Get_size() == 1:
        return
    comm = world.Dup()
    comm.Set_name("mpidp store")
    _shared.comm = comm


def started() -> bool:
    """Whether ``start()`` made the communicator (or the job has one rank)."""
    return _shared.comm is not None or MPI.COMM_WORLD.Get_size() == 1


def _backend():
    """(table, client) of this process; starts rank 0's store thread the first time."""
    runtime.require_mpi()
    with _shared.lock:
        comm = _shared.comm
        if comm is None and MPI.COMM_WORLD.Get_size() > 1:
            raise RuntimeError("mpidp store: its communicator is made at import mpidp "
                               "(mpidp.store.start); it was not")
        if comm is None or comm.Get_rank() == 0:
            if _shared.table is None:
                _shared.table = _Table()
            if comm is not None and _shared.service is None:
                if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                    raise RuntimeError("mpidp store: rank 0 serves it from a thread of its own, "
                                       "which needs MPI_THREAD_MULTIPLE; use store='tcp'")
                _shared.service = _Service(comm, _shared.table)
                atexit.register(_stop)
            return _shared.table, None
        if _shared.client is None:
            _shared.client = _Client(comm)
        return None, _shared.client


def _stop() -> None:
    service = _shared.service
    if service is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        service.stop()


def _forked() -> None:
    # a forked child must not touch the parent's MPI: MPIStore's methods raise there
    _shared.lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


class MPIStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys live on rank 0 and travel over MPI.

    Any thread of any rank may call any method, several at once. ``get`` and
    ``wait`` wait for missing keys up to the store's ``timeout`` (or the one
    given); past it they raise ``torch.distributed.DistStoreError``. ``add``,
    ``compare_set`` and ``append`` are atomic (rank 0 applies one operation
    at a time); ``compare_set`` follows ``TCPStore``: a missing key is set
    only when ``expected`` is empty, else ``expected`` is returned. Queues
    (``queue_push``...) and ``list_keys`` are not supported (torch's
    ``NotImplementedError``), as in ``HashStore``.

    Args:
        timeout: the store's timeout (torch's default: 300 s); 0 means none.

    Raises:
        RuntimeError: in a process started by multiprocessing, or when rank 0's
            MPI was not granted ``MPI_THREAD_MULTIPLE``.
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=300)):
        super().__init__()
        self.set_timeout(timeout)
        self._table, self._client = _backend()
        with _shared.lock:
            _shared.stores.append(self)

    def _here(self) -> _Table | None:
        """Rank 0's table, or None on the other ranks (which ask rank 0)."""
        runtime.require_mpi()  # never in a forked child: its copy of the table is stale
        if self._table is not None and _shared.service is not None:
            # torch uses the store on every rank at once (start-up, new_group, barriers):
            # rank 0's own use wakes the store thread from its idle pauses for the others
            _shared.service.wake.set()
        return self._table

    def _call(self, op: int, fields: list[bytes], what: str, timeout: float | None = None) -> list[bytes]:
        # every operation gives up after the store's timeout and a grace (rank 0 gone);
        # only get and wait wait that long on rank 0 for their keys
        return self._client.call(op, fields, self._timeout(timeout), what)

    def _timeout(self, timeout=None) -> float:
        return _seconds(self.timeout if timeout is None else timeout)

    def set(self, key: str, value) -> None:
        if (table := self._here()) is not None:
            return table.set(key, _bytes(value))
        self._call(_SET, [key.encode(), _bytes(value)], f"set({key!r})")

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        seconds = self._timeout()
        if (table := self._here()) is not None:
            return table.wait_here(list(keys), seconds)
        return self._call(_MULTI_GET, [key.encode() for key in keys], f"get({keys})")

    def multi_set(self, keys: list[str], values: list) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        values = [_bytes(value) for value in values]
        if (table := self._here()) is not None:
            return table.multi_set(list(keys), values)
        self._call(_MULTI_SET, [key.encode() for key in keys] + values, f"multi_set({keys})")

    def append(self, key: str, value) -> None:
        if (table := self._here()) is not None:
            return table.append(key, _bytes(value))
        self._call(_APPEND, [key.encode(), _bytes(value)], f"append({key!r})")

    def add(self, key: str, amount: int) -> int:
        if (table := self._here()) is not None:
            return table.add(key, int(amount))
        return int(self._call(_ADD, [key.encode(), str(int(amount)).encode()],
                              f"add({key!r})")[0])

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected, desired = _bytes(expected), _bytes(desired)
        if (table := self._here()) is not None:
            return table.compare_set(key, expected, desired)
        return self._call(_CAS, [key.encode(), expected, desired], f"compare_set({key!r})")[0]

    def delete_key(self, key: str) -> bool:
        if (table := self._here()) is not None:
            return table.delete(key)
        return bool(self._call(_DELETE, [key.encode()], f"delete_key({key!r})")[0])

    def num_keys(self) -> int:
        if (table := self._here()) is not None:
            return table.num_keys()
        return int(self._call(_NUM_KEYS, [], "num_keys()")[0])

    def check(self, keys: list[str]) -> bool:
        if (table := self._here()) is not None:
            return table.check(list(keys))
        return bool(self._call(_CHECK, [key.encode() for key in keys], f"check({keys})")[0])

    def wait(self, keys: list[str], timeout=None) -> None:
        seconds = self._timeout(timeout)
        if (table := self._here()) is not None:
            table.wait_here(list(keys), seconds)
            return
        self._call(_WAIT, [key.encode() for key in keys], f"wait({keys})", seconds)

    # torch's C++ side (PrefixStore, gloo) calls these two by their C++ names
    deleteKey = delete_key
    getNumKeys = num_keys

    def has_extended_api(self) -> bool:
        return True  # append, multi_get and multi_set: gloo then fetches its peers in one go

    def clone(self) -> MPIStore:
        return MPIStore(self.timeout)
