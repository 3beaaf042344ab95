"""The flight recorder: each rank's last collectives, kept in a ring and written out when asked.

When a job stops moving, the stall watchdog says what each rank waits in now;
the recorder says what led there. Every collective that mpidp starts, on every
communicator it uses (``mpidp.comm``'s collectives and with them DDP's buckets,
the backend's operations, Horovod's, ZeRO's, SyncBatchNorm's; the calls made
through ``watchdog.watched``; the backend's call checks and Horovod's control
messages), is one entry: its sequence number on its communicator, the
operation, the element count and dtype, the communicator's key
(``mpidp.communicators``), what it is for (the ``watchdog.Scope``: "DDP step 3
bucket 2/2"), the thread that started it, and its start and end on
``time.monotonic()``. ``python -m mpidp trace DIR`` lines up the ranks' files
by communicator and sequence number (``mpidp.trace``).

**Cost.** ``started`` fills a slot of a ring made at import
(``MPIDP_TRACE_ENTRIES`` slots, default 2048; 0 turns the recorder off): no
lock, no object made but the clock's float and the extras tuple; the ticket
and the sequence numbers are ``itertools.count`` steps, one C call each, so
two threads never take the same one. ``bench/recorder_bench.py`` measures it.
A slot is reused after ``MPIDP_TRACE_ENTRIES`` later collectives; an end that
arrives after that is dropped (its ticket no longer matches).

**Files.** ``dump(reason)`` writes ``rank-NNNNN.json`` (the ring, oldest first,
every communicator's key and owner, what each thread waits in, every
thread's Python stack, and the ranks this one heard finish: ``heard_ended``)
into ``directory()``: ``MPIDP_TRACE_DIR``, by default
``mpidp-trace-<job>`` in the working directory, where ``<job>`` is the
scheduler's job id (Slurm, PBS, LSF, Flux, Open MPI's PMIx namespace) or, under
a bare ``mpiexec``, a name rank 0 chose at import (``set_job``). mpidp dumps on
a stall (``mpidp.watchdog``), on an error that ends the job (``mpidp.runtime``),
on a signal (``mpidp.stacks``) and when the program calls ``dump()``.

**The black box.** A launcher that kills every rank with SIGKILL as soon as one
dies (MPICH's and Intel MPI's hydra) leaves no time to dump. So from
``open_box()`` on (``mpidp.stacks.arm``, at import) the ring's last
``_BOX_SLOTS`` starts and ends are also written, as they happen, into
``rank-NNNNN.box``, a file mapped into memory (``mmap``): what a killed process
wrote there is in the kernel's page cache and reaches the file whatever kills it.
A slot holds the communicator's index (``rank-NNNNN.comms`` names each: one
line per communicator, written when first seen), the sequence number, the
element count, the start, the end, the operation, the dtype and the ticket, in
that order, in one ``pack_into``: the ticket is written last, so a reader takes
no half-written slot for a whole one. ``bench/recorder_bench.py`` measures the
cost with the rest of the recorder.
``mpidp.trace`` reads a rank's box where the rank left no ``.json``. A clean
exit removes both files.

Imports nothing from mpidp but ``settings`` and ``communicators``, and never calls MPI.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import re
import socket
import struct
import sys
import threading
import time
import traceback

from . import communicators, settings

__all__ = ["close_box", "dump", "directory", "enabled", "entries", "ended", "heard_ended",
           "open_box", "read_box", "started", "write"]

_JOB_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "PMIX_NAMESPACE")
_FORMAT = 1  # the files' layout; mpidp.trace refuses others


class _Entry:
    """One collective of the ring; its fields are rewritten in place when the slot is reused."""

    __slots__ = ("ticket", "channel", "seq", "op", "count", "dtype", "extra", "what", "thread",
                 "start", "end")

    def __init__(self):
        self.ticket = -1


class _Channel:
    """A communicator as the recorder knows it: its key, its next sequence number and its
    index in the black box's ``.comms`` file."""

    __slots__ = ("comm", "index", "record", "seq")

    def __init__(self, comm, record, index):
        self.comm = comm  # held: its id() keys _channels and must not be reused
        self.record = record
        self.index = index
        self.seq = itertools.count(1)  # the first collective is #1


# The black box's layout (mpidp.trace reads it): a header, then _BOX_SLOTS slots.
_BOX_MAGIC = b"mpidpbox"
_BOX_HEAD = struct.Struct("<8s i i i i q d d 64s")  # magic, format, rank, size, slots, pid,
_BOX_HEAD_SIZE = 128                                # the anchor (wall, monotonic), host
# a slot: channel, seq, count, start, end, op, dtype, and the ticket last (packed in order)
_BOX_SLOT = struct.Struct("<i 4x q q d d 24s 16s q")
_BOX_END = struct.Struct("<d")  # at a slot's offset 32
_BOX_SLOT_SIZE = 88
_BOX_SLOTS = 256
_box_tickets = [-1] * _BOX_SLOTS  # the ticket each slot holds now: ended() writes only its own
_box = None  # the mmap, from open_box() on
_box_comms = None  # the open .comms file
_box_names: dict = {}  # op or dtype -> its bytes, encoded once

_size = settings.get("MPIDP_TRACE_ENTRIES")
_ring = [_Entry() for _ in range(_size)]
_tickets = itertools.count()
_channels: dict[int, _Channel] = {}
_channels_lock = threading.Lock()  # taken only when a communicator is first seen
_clock = time.monotonic
_ident = threading.get_ident
_anchor = (time.time(), time.monotonic())  # the wall clock at one monotonic instant
_dump_lock = threading.Lock()
_job: str | None = None
_rank, _world = 0, 1
_ended: dict[int, str] = {}  # other ranks that finished, as this rank heard (mpidp.watchdog)


def heard_ended(rank: int, text: str) -> None:
    """Keep that ``rank`` ended ("finished at train.py:42 (...)"), for the files ``dump`` writes."""
    _ended[rank] = text


def enabled() -> bool:
    """Whether the recorder keeps entries (``MPIDP_TRACE_ENTRIES`` > 0)."""
    return _size > 0


def _channel(comm) -> _Channel:
    with _channels_lock:
        found = _channels.get(id(comm))
        if found is None:
            found = _channels[id(comm)] = _Channel(comm, communicators.identify(comm),
                                                   len(_channels))
            _box_name(found)
        return found


def _box_name(channel: _Channel) -> None:
    """Name ``channel`` in the ``.comms`` file (with _channels_lock held)."""
    if _box_comms is not None:
        try:
            _box_comms.write(f"{channel.index}\t{channel.record.key}\t{channel.record.owner}\n")
            _box_comms.flush()
        except OSError:
            pass


def _encoded(value, width: int) -> bytes:
    found = _box_names.get(value)
    if found is None:
        text = "" if value is None else str(value).removeprefix("torch.")
        found = _box_names[value] = text.encode(errors="replace")[:width]
    return found


def open_box() -> None:
    """Map this rank's black box, ``rank-NNNNN.box``, and start writing into it (once, at
    import, after ``set_job``); nothing if the recorder is off or the file cannot be made."""
    global _box, _box_comms
    if not _size or _box is not None:
        return
    try:
        size = _BOX_HEAD_SIZE + _BOX_SLOTS * _BOX_SLOT_SIZE
        with open(path(".box"), "w+b") as out:
            out.truncate(size)
            box = mmap.mmap(out.fileno(), size)
        comms = open(path(".comms"), "w")
    except (OSError, ValueError) as error:
        _complain(error)
        return
    _BOX_HEAD.pack_into(box, 0, _BOX_MAGIC, _FORMAT, _rank, _world, _BOX_SLOTS, os.getpid(),
                        _anchor[0], _anchor[1], socket.gethostname().encode()[:64])
    with _channels_lock:
        _box_comms = comms
        for channel in _channels.values():
            _box_name(channel)
        _box = box


def read_box(box_path: str) -> dict | None:
    """A black box as ``dump`` would have written the rank's file (what the slots hold: no
    stacks, no scope, and ``extra`` None: not known), or None if ``box_path`` is not one. For
    ``mpidp.trace``."""
    with open(box_path, "rb") as source:
        data = source.read()
    if len(data) < _BOX_HEAD_SIZE or not data.startswith(_BOX_MAGIC):
        return None
    _, layout, rank, size, slots, pid, wall, monotonic, host = _BOX_HEAD.unpack_from(data, 0)
    if layout != _FORMAT or len(data) < _BOX_HEAD_SIZE + slots * _BOX_SLOT_SIZE:
        return None
    keys, owners = {}, {}
    try:
        with open(box_path.removesuffix(".box") + ".comms") as names:
            for line in names:
                index, key, owner = line.rstrip("\n").split("\t", 2)
                keys[int(index)] = key
                owners[key] = owner
    except (OSError, ValueError):
        pass
    found = []
    for slot in range(slots):
        channel, seq, count, start, end, op, dtype, ticket = _BOX_SLOT.unpack_from(
            data, _BOX_HEAD_SIZE + slot * _BOX_SLOT_SIZE)
        if seq < 1 or ticket % slots != slot:
            continue  # never written, or torn
        found.append(dict(
            ticket=ticket, comm=keys.get(channel, f"communicator {channel} (not named)"), seq=seq,
            op=op.rstrip(b"\0").decode(errors="replace"), count=count,
            dtype=dtype.rstrip(b"\0").decode(errors="replace") or None, extra=None, what=None,
            thread=0, start=start, end=end if end >= start else None))
    found.sort(key=lambda entry: entry["ticket"])
    latest = max([wall] + [wall + max(e["start"], e["end"] or 0.0) - monotonic for e in found])
    return dict(format=_FORMAT, rank=rank, size=size, host=host.rstrip(b"\0").decode(), pid=pid,
                reason="its black box (the process ended without writing its file: killed?)",
                box=True,
                written=latest, anchor=dict(wall=wall, monotonic=monotonic), capacity=slots,
                waits=[], communicators={key: dict(owner=owner, issuer=None, size=None)
                                         for key, owner in owners.items()},
                entries=found, threads={})


def _forked() -> None:
    global _box, _box_comms
    _box, _box_comms = None, None  # a fork's child (a DataLoader worker) writes nothing there


os.register_at_fork(after_in_child=_forked)


def close_box() -> None:
    """At a clean exit: stop writing, remove the box and its ``.comms`` file."""
    global _box, _box_comms
    box, comms, _box, _box_comms = _box, _box_comms, None, None
    if box is None:
        return
    for closing in (comms.close, box.close):
        try:
            closing()
        except (OSError, BufferError):
            pass
    for suffix in (".box", ".comms"):
        try:
            os.unlink(path(suffix))
        except OSError:
            pass


def started(comm, op: str, count: int, dtype, extra=(), what=None) -> int:
    """Record that this thread starts collective ``op`` on ``comm``; returns its ticket for ``ended``.

    Args:
        comm: the mpi4py communicator it runs on.
        op: the operation ("allreduce", "Bcast"...).
        count: elements (-1: not known, as for pickled objects).
        dtype: a torch dtype, a name, or None.
        extra: ``(key, value, ...)`` that every rank's call must share ("op", "sum").
        what: what it is for: a ``watchdog.Scope`` or a string, turned into words
            only when the ring is written.
    """
    if not _size:
        return -1
    try:
        channel = _channels[id(comm)]
    except KeyError:
        channel = _channel(comm)
    ticket = next(_tickets)
    entry = _ring[ticket % _size]
    entry.ticket = ticket
    entry.channel = channel
    entry.seq = next(channel.seq)
    entry.op = op
    entry.count = count
    entry.dtype = dtype
    entry.extra = extra
    entry.what = what
    entry.thread = _ident()
    entry.end = 0.0
    entry.start = start = _clock()
    box = _box
    if box is not None:
        slot = ticket % _BOX_SLOTS
        _box_tickets[slot] = ticket
        _BOX_SLOT.pack_into(box, _BOX_HEAD_SIZE + slot * _BOX_SLOT_SIZE, channel.index, entry.seq,
                            count, start, 0.0, _box_names.get(op) or _encoded(op, 24),
                            _box_names.get(dtype) or _encoded(dtype, 16), ticket)
    return ticket


def ended(ticket: int) -> None:
    """Record that the collective of ``ticket`` completed (any thread)."""
    if ticket >= 0:
        entry = _ring[ticket % _size]
        if entry.ticket == ticket:
            entry.end = end = _clock()
            box = _box
            if box is not None and _box_tickets[ticket % _BOX_SLOTS] == ticket:
                _BOX_END.pack_into(box, _BOX_HEAD_SIZE + (ticket % _BOX_SLOTS) * _BOX_SLOT_SIZE
                                   + 32, end)


# -- writing it out ----------------------------------------------------------------------

def set_job(job: str, rank: int, size: int) -> None:
    """Name the job (the same on every rank) and this rank, for ``directory()`` and the files."""
    global _job, _rank, _world
    _job, _rank, _world = job, rank, size


def scheduler_job() -> str | None:
    """The batch system's job id, if a launcher set one."""
    for name in _JOB_VARIABLES:
        value = settings.text(name)
        if value:
            return re.sub(r"[^A-Za-z0-9_.-]", "_", value)
    return None


def directory() -> str:
    """Where the ranks write their files: ``MPIDP_TRACE_DIR`` or ``./mpidp-trace-<job>``."""
    given = settings.get("MPIDP_TRACE_DIR")
    if given:
        return os.path.abspath(given)
    return os.path.abspath(f"mpidp-trace-{_job or scheduler_job() or os.getpid()}")


def path(suffix: str) -> str:
    """This rank's file ``rank-NNNNN<suffix>`` in ``directory()`` (made if missing)."""
    folder = directory()
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"rank-{_rank:05d}{suffix}")


def write(name: str, text: str) -> str | None:
    """Write ``text`` to ``name`` in ``directory()``; returns its path, None if that failed."""
    try:
        folder = directory()
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, name), "w") as out:
            out.write(text)
        return os.path.join(folder, name)
    except OSError as error:
        _complain(error)
        return None


def _complain(error: Exception) -> None:
    os.write(2, f"[mpidp rank {_rank}/{_world}] the flight recorder could not write its "
                f"file: {type(error).__name__}: {error}\n".encode(errors="replace"))


def _text(value) -> str | None:
    if value is None:
        return None
    try:
        return str(value)
    except Exception as error:  # a Scope whose template fails must not stop the dump
        return f"<{type(error).__name__}: {error}>"


def entries() -> list[dict]:
    """The ring's entries, oldest first, as plain values (what ``dump`` writes)."""
    if not _size:
        return []
    last = next(_tickets)  # a ticket of its own: entries begun after it are not read
    found = []
    for ticket in range(max(0, last - _size), last):
        entry = _ring[ticket % _size]
        if entry.ticket != ticket:
            continue  # not written yet, or reused by a later collective
        record = entry.channel.record
        found.append(dict(
            ticket=ticket, comm=record.key, seq=entry.seq, op=entry.op, count=entry.count,
            dtype=None if entry.dtype is None else str(entry.dtype).removeprefix("torch."),
            extra=[_text(v) for v in entry.extra], what=_text(entry.what), thread=entry.thread,
            start=entry.start, end=entry.end or None))
    return found


def _threads() -> dict:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    stacks = {}
    for ident, frame in sys._current_frames().items():
        stacks[str(ident)] = dict(name=names.get(ident, "?"),
                                  stack="".join(traceback.format_stack(frame)))
    return stacks


def _communicators() -> dict:
    with _channels_lock:
        channels = list(_channels.values())
    return {c.record.key: dict(owner=c.record.owner, issuer=c.record.issuer, size=c.record.size)
            for c in channels}


def dump(reason: str = "asked by the program", waits=None) -> str | None:
    """Write this rank's ring, communicators and threads' stacks to ``rank-NNNNN.json``.

    Local (no MPI call); any thread, also while others are inside collectives.
    Returns the file's path, or None if it could not be written (the error is
    printed on stderr: a dump must never end the program).

    Args:
        reason: why, kept in the file.
        waits: what each thread waits in now (lines), if the caller knows.
    """
    with _dump_lock:
        try:
            data = dict(format=_FORMAT, rank=_rank, size=_world, host=socket.gethostname(),
                        pid=os.getpid(), reason=reason, written=time.time(),
                        anchor=dict(wall=_anchor[0], monotonic=_anchor[1]),
                        capacity=_size, waits=list(waits or []),
                        ended={str(rank): text for rank, text in sorted(_ended.items())},
                        communicators=_communicators(), entries=entries(),
                        threads=_threads())
            target = path(".json")
            partial = target + ".partial"
            with open(partial, "w") as out:
                json.dump(data, out, indent=1)
            os.replace(partial, target)  # a reader never sees half a file
            return target
        except Exception as error:  # noqa: BLE001 (a full disk must not end the job)
            _complain(error)
            return None
