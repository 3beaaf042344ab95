"""What each thread of this rank is waiting in: the stall watchdog's hot path.

A thread about to block in MPI writes ``(label, since, scope, waiting)`` into its
own slot (``begin``) and clears it after; the watchdog thread only reads the
slots. ``Scope`` names what the calls inside a ``with`` block are for, and
``watched`` is the door for blocking calls below ``mpidp.comm``'s engine.
"""

from __future__ import annotations

import threading
import time
import weakref

from mpi4py import MPI

from .. import recorder as _recorder
from .._args import check_number

__all__ = ["Scope", "begin", "check_timeout", "context", "handoff", "slot", "watched"]

_on_new_slot = None  # the watchdog's: start its thread when a thread first calls MPI


def on_new_slot(call) -> None:
    """Have ``call()`` run whenever a thread takes its first slot (the watchdog's start)."""
    global _on_new_slot
    _on_new_slot = call


def check_timeout(name: str, value) -> None:
    """Raise unless ``value`` is None or a timeout in seconds (a number >= 0)."""
    try:
        check_number(name, value, strict=False, optional=True)
    except ValueError:
        raise ValueError(f"{name} must be None or a number of seconds >= 0 (0 turns the stall "
                         f"watchdog off), got {value!r}") from None


# -- the hot path -------------------------------------------------------------------------

class _Slot:
    """What one thread is waiting in; written by that thread, read by the watchdog."""

    __slots__ = ("current", "context", "site", "thread", "reported", "__weakref__")

    def __init__(self, thread: int):
        self.current = None  # (label, since, scope or None, waiting on a handle) during a call
        self.context = None  # the innermost Scope of this thread
        self.site = None  # the thread whose stack names the call site (None: this one)
        self.thread = thread
        self.reported = None  # `since` of the call last reported (watchdog thread only)


_local = threading.local()
_slots: weakref.WeakSet = weakref.WeakSet()  # a thread's slot goes with its thread
_lock = threading.Lock()
_clock = time.monotonic


def _new_slot() -> _Slot:
    slot = _local.slot = _Slot(threading.get_ident())
    with _lock:
        _slots.add(slot)
    if _on_new_slot is not None:
        _on_new_slot()
    return slot


def slot() -> _Slot:
    """This thread's slot."""
    try:
        return _local.slot
    except AttributeError:
        return _new_slot()


def begin(label, context=None, waiting: bool = False) -> _Slot:
    """Record that this thread enters a blocking MPI call; set ``.current = None`` after it.

    Args:
        label: what the call is (see the module docstring); formatted only in a report.
        context: the Scope it belongs to (default: this thread's innermost).
        waiting: it waits on a nonblocking operation's request.
    """
    try:
        slot = _local.slot
    except AttributeError:
        slot = _new_slot()
    slot.current = (label, _clock(), context or slot.context, waiting)
    return slot


def watched(label, call, *args, **kwargs):
    """``call(*args, **kwargs)``, a blocking MPI call, recorded under ``label`` while it runs.

    The one door for the blocking calls mpidp makes outside ``mpidp.comm`` (mpi4py's
    pickled object collectives, a few small agreements): a rank that waits in one
    is named in stall reports like any other collective. A bound method of a
    communicator (``comm.allgather``) is also an entry of the flight recorder
    (``mpidp.recorder``), under the method's name, its element count unknown.
    """
    comm = getattr(call, "__self__", None)
    ticket = -1
    if isinstance(comm, MPI.Comm):
        ticket = _recorder.started(comm, call.__name__, -1, None, (),
                                   label if isinstance(label, str) else None)
    slot = begin(label)
    try:
        return call(*args, **kwargs)
    finally:
        slot.current = None
        _recorder.ended(ticket)


def context():
    """This thread's innermost Scope, for a nonblocking operation to report under later."""
    try:
        return _local.slot.context
    except AttributeError:
        return None


def handoff() -> tuple:
    """(Scope, thread id) of this thread, for a helper thread that calls MPI on its behalf."""
    return context(), threading.get_ident()


class Scope:
    """Name what the mpidp calls inside a ``with`` block are for, in stall reports.

    Args:
        what: a ``str.format`` template filled with ``args``, or a callable called
            with them; evaluated only when a report is due.
        args: its arguments: plain values, never tensors (the flight recorder
            keeps the Scope of its last collectives).
        timeout: seconds the calls inside may wait (0: never reported); None
            keeps the enclosing scope's, or the process-wide one.
        source: how the report names where ``timeout`` came from.
    """

    __slots__ = ("what", "args", "timeout", "source", "_slot", "_outer")

    def __init__(self, what, *args, timeout: float | None = None, source: str = "a Scope"):
        if timeout is not None:
            check_timeout("timeout", timeout)
        self.what, self.args, self.timeout, self.source = what, args, timeout, source

    def __enter__(self) -> "Scope":
        self._slot = slot()
        outer = self._outer = self._slot.context
        if self.timeout is None and outer is not None:
            self.timeout, self.source = outer.timeout, outer.source
        self._slot.context = self
        return self

    def __exit__(self, *exc) -> None:
        self._slot.context = self._outer

    def __str__(self) -> str:
        what = self.what
        text = what(*self.args) if callable(what) else what.format(*self.args)
        outer = getattr(self, "_outer", None)
        return text if outer is None else f"{outer}, {text}"
