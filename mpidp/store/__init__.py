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

**How it keeps docs/concurrency.md's rules** (3 and 4 there; that page has the whole model):

- *Its own communicator.* The store's messages travel on a communicator of their own, a duplicate of
  ``MPI.COMM_WORLD`` made by ``start()`` at ``import mpidp`` (collective, on
  every rank, before any thread of mpidp's exists). Only point-to-point
  messages go there, never a collective, so nothing on it is matched by
  order across ranks.
- *The store thread never blocks in MPI.* It keeps one receive posted *per
  peer* (not ``ANY_SOURCE``, which was seen to miss messages from another
  node with MPICH over UCX: issue 29), tests it with ``Testsome``, answers
  with nonblocking sends it tests later, and sleeps on an event between
  polls (it never spins: ``server._PAUSES``; rank 0's own calls wake it).
  An operation that must wait (``get`` or ``wait`` on a key not yet
  set) is parked on rank 0 and answered when the key arrives or the store's
  timeout passes; the store thread keeps serving meanwhile.
- *A caller waits only on its own requests:* each operation takes a
  *slot* of its rank (its own tags), posts the receive for its answer, then
  sends; it tests that receive, sleeping between tests, until the answer
  comes. An answer depends on
  nothing but the store thread, which never waits on a collective, so a
  store operation can never be the missing link of a rank that owes a peer
  a collective.
- *A pending request owns its buffer* until it completes; a slot whose answer
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
import threading
import time

import torch.distributed as dist
from mpi4py import MPI

from .. import communicators as _communicators
from .. import runtime
from .server import (
    _ADD, _ANSWER, _APPEND, _CAS, _CHECK, _DELETE, _ERROR, _GRACE_SECONDS, _HEAD, _INLINE_BYTES,
    _MULTI_GET, _MULTI_SET, _NUM_KEYS, _SET, _TAG_REQUEST, _TAG_SLOTS, _TIMEOUT, _WAIT, _Service,
    _CALLER_LONGEST, _SLACK_NS, _Table, _bytes, _next_pause, _pack, _seconds, _timed_out,
    _timer_slack, _unpack,
)

__all__ = ["MPIStore", "start", "started"]


# -- the other ranks: the caller's side ------------------------------------------------------------

class _Client:
    """A rank other than 0: sends each operation to rank 0 and waits for its answer, and on nothing else."""

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
        if request.Test(status):
            return True
        had = _timer_slack(_SLACK_NS)  # the caller's thread, while it polls (server.py: Timer slack)
        try:
            pause = 0.0
            while not request.Test(status):  # pausing from the first miss (server.py: Polling)
                now = time.monotonic()
                if limit is not None and now > limit:
                    return False
                pause = _next_pause(pause, _CALLER_LONGEST)
                time.sleep(pause)
            return True
        finally:
            if had is not None:
                _timer_slack(had)


# -- the store ---------------------------------------------------------------------------------------

class _Shared:
    comm: MPI.Intracomm | None = None  # the store's communicator, point-to-point only
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
    comm = _communicators.made(world.Dup(), "the rendezvous store",
                               "any thread (point-to-point, slots of their own)", rebuild=_rebuild)
    comm.Set_name("mpidp store")
    _shared.comm = comm


def _rebuild(world: MPI.Intracomm) -> None:
    """After a heal (``mpidp.healing``), while no store was used: the same over the survivors.

    A store in use (torch.distributed's rendezvous) drops ``rebuild`` at its first
    use (``_backend``), so the healing refuses instead.
    """
    _communicators.release(_shared.comm)
    _shared.comm = None
    start(world)


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
        if comm is not None:  # rank 0's thread and peers' slots cannot follow a heal
            _communicators.set_rebuild(comm, None)
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
