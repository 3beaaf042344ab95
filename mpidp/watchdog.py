"""The stall watchdog: when an mpidp collective waits too long, say which rank waits where.

An MPI hang is silent: the ranks sit in their calls forever. torch's
watchdog and Horovod's stall inspector turn that into a message; this is
mpidp's.

**What is recorded.** Every blocking MPI call mpidp makes (the ``mpidp.comm``
collectives and point-to-point calls, ``Handle.wait()``, and through them
DDP's bucket allreduces, buffer broadcasts and per-step bookkeeping
allreduce) stores ``(label, time.monotonic(), scope, waiting)`` in a
per-thread slot before the call and None after it: a thread-local lookup, one
clock read, a tuple and two attribute stores. Nothing is formatted and no
stack is captured on that path (``bench/watchdog_bench.py`` measures it). A label is a
string, a callable, or a ``(name, tensor, key, value, ...)`` tuple, formatted
only when a report is due. ``Scope`` blocks say what the calls inside are for
(DDP names its step, bucket and size with them) and may set their timeout.

**The watchdog thread.** A daemon thread, started by ``start()`` or the first
recorded call, wakes every min(timeout / 4, 1 s). When a call has waited
longer than its timeout, the rank prints one line on stderr, once per call:
what it waits in, and the call site, which is the first frame of the waiting
thread outside mpidp, torch and the standard library, read with
``sys._current_frames()`` while that thread sits in C (the thread strategy's
communication thread reports the call site of the thread that handed it the
bucket)::

    [mpidp rank 1/3] stall: waiting 5.4 s (timeout 5 s from MPIDP_TIMEOUT) in DDP step 3 bucket 2/2 (0.1 MB): allreduce op=sum dtype=float32 count=25605 at train.py:42

**Rank 0's summary.** ``start()`` duplicates ``MPI.COMM_WORLD`` for the
watchdogs alone, so their messages can never match the program's. It is
collective, so it must run at a moment every rank passes in the same order
of ``COMM_WORLD`` collectives. The best one is the import of mpidp, whose
start-up is collective already; the creation of the default pool and the
construction of a DDP over ``COMM_WORLD``, both collective over
``COMM_WORLD`` themselves, call it too, and the first of these moments
creates it (later calls do nothing). It is made whatever the timeout, so
that every rank takes part even where the timeouts differ. Over it go
point-to-point messages only, so nothing the watchdog does can hang on a
missing rank: rank 0's watchdog keeps an ``Irecv(ANY_SOURCE)`` posted and
every other rank's keeps one posted for rank 0's questions. A stalled rank
sends its line to rank 0. At the first such line, or its own stall, rank 0
asks every other rank for its state, collects answers for up to
``_COLLECT_SECONDS`` (less once all have answered), prints one summary line,
and aborts the job::

    [mpidp rank 0/3] stall summary: ranks 0, 2: waiting in DDP step 3 bucket 2/2 (0.1 MB): allreduce op=sum dtype=float32 count=25605 at train.py:42 (5.4 s); rank 1: not in an mpidp collective, main thread at train.py:40; aborting the job (MPIDP_TIMEOUT_ACTION=abort)

A rank answers from its watchdog thread, so rank 0 hears even from a rank
whose main thread is busy in user code, and rank 0 summarises while its own
main thread is. A rank that does not answer is dead or cannot run Python
(a call that holds the GIL): "no report". If rank 0 cannot summarise, each
stalled rank aborts the job by itself ``_SELF_ABORT_SECONDS`` after its own
line.

**Timeouts.** The process-wide timeout is ``MPIDP_TIMEOUT`` (seconds, a
number; default 600; 0 turns the watchdog off), replaced by
``set_timeout()``. A ``Scope`` with a timeout sets it for the calls inside:
``DistributedDataParallel(timeout=...)`` puts the collectives of its steps
(bucket allreduces, the bookkeeping allreduce, buffer broadcasts) under its
own timeout, longer or shorter than the process-wide one (0: never watched);
everything else keeps the process-wide one. ``MPIDP_TIMEOUT_ACTION=report``
only prints: the job goes on, and a later stall is reported again.

**Thread levels.** Calling MPI from the watchdog thread while the main thread
sits in MPI needs ``MPI_THREAD_MULTIPLE`` (mpidp asks for it). Under a lower
level no summary is possible: each rank prints its own line and, to abort,
ends its own process with ``os._exit`` instead of ``MPI_Abort``, which the
library may not allow from this thread while another is inside MPI; the
launcher then ends the job as for any rank that dies (mpiexec does; under
``srun`` that needs ``--kill-on-bad-exit``).

**Limits.** Only calls that go through mpidp are seen: raw mpi4py calls,
``mpidp.barrier()``, ``mpidp.objects``, the sparse gradients' gathers and
DDP's construction are not recorded, and a rank stuck there reads as "not in
an mpidp collective".
A rank whose watchdog thread never started (it made no recorded call and
nothing called ``start()``) cannot answer. Several threads in mpidp calls at
once: the line names the one that has waited longest. The abort status is
``ABORT_STATUS`` (124, as GNU ``timeout``).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import sysconfig
import threading
import time
import weakref
from numbers import Real

from mpi4py import MPI

from . import _env
from . import runtime

__all__ = ["ABORT_STATUS", "Scope", "set_timeout", "get_timeout", "start"]

ABORT_STATUS = 124
_ACTIONS = ("abort", "report")
_TAG_LINE = 1  # a rank's state, to rank 0
_TAG_QUERY = 2  # rank 0 asks for it
_MESSAGE_BYTES = 8192  # a longer state is cut to fit
_COLLECT_SECONDS = 3.0  # a few wake-ups of every rank's watchdog
_SELF_ABORT_SECONDS = 8.0  # rank 0 summarises within _COLLECT_SECONDS + a wake-up of its own
_LOCAL_GRACE_SECONDS = 2.0  # without a summary: time for the other ranks to print their lines
_MAX_PERIOD, _MIN_PERIOD = 1.0, 0.05


def _timeout_from_env() -> tuple[float, str]:
    value = _env.number("MPIDP_TIMEOUT", 600.0)
    given = os.environ.get("MPIDP_TIMEOUT", "").strip()
    return value, ("MPIDP_TIMEOUT" if given else "the default")


def _action_from_env() -> str:
    value = os.environ.get("MPIDP_TIMEOUT_ACTION", "").strip()
    if value.lower() not in ("", *_ACTIONS):
        raise ValueError(f"MPIDP_TIMEOUT_ACTION must be one of {', '.join(_ACTIONS)} (any case), "
                         f"got {value!r}")
    return value.lower() or "abort"


# Read once at import, as MPIDP_DEBUG is; set_timeout() replaces them.
_timeout, _timeout_source = _timeout_from_env()
_action = _action_from_env()


def check_timeout(name: str, value) -> None:
    """Raise unless ``value`` is None or a timeout in seconds (a number >= 0)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, Real)
                              or not value >= 0):
        raise ValueError(f"{name} must be None or a number of seconds >= 0 (0 turns the stall "
                         f"watchdog off), got {value!r}")


def set_timeout(seconds: float | None, *, action: str | None = None) -> None:
    """Set how long an mpidp call may wait before its rank reports a stall (process-wide).

    Args:
        seconds: a number >= 0 (0: off), or None for ``MPIDP_TIMEOUT`` (default 600).
            A ``Scope``'s own timeout, such as DistributedDataParallel's
            ``timeout``, still applies to the calls inside it.
        action: "abort" (print, then abort the job) or "report" (print only);
            None keeps the current one (``MPIDP_TIMEOUT_ACTION``, default "abort").
    """
    global _timeout, _timeout_source, _action
    check_timeout("seconds", seconds)
    if action is not None and action not in _ACTIONS:
        raise ValueError(f"action must be one of {', '.join(_ACTIONS)}, got {action!r}")
    if seconds is None:
        _timeout, _timeout_source = _timeout_from_env()
    else:
        _timeout, _timeout_source = float(seconds), "set_timeout()"
    if action is not None:
        _action = action
    _ensure_thread()
    _wake.set()  # a shorter period applies now


def get_timeout() -> tuple[float, str]:
    """Return the process-wide (timeout in seconds, 0 = off; action)."""
    return _timeout, _action


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
    _ensure_thread()
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
        args: its arguments.
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


# -- describing what a rank does ------------------------------------------------------------

def _label_text(label) -> str:
    if label is None:
        return "an MPI call"
    if isinstance(label, str):
        return label
    if callable(label):
        return label()
    name, tensor, *pairs = label
    words = [name] + [f"{key}={value}" for key, value in zip(pairs[::2], pairs[1::2])]
    if tensor is not None:
        words.append(f"dtype={str(tensor.dtype).removeprefix('torch.')} count={tensor.numel()}")
    return " ".join(words)


def _library_dirs() -> tuple[str, ...]:
    dirs = [os.path.dirname(os.path.abspath(__file__))]
    for name in ("mpidp.kernels", "torch"):
        module = sys.modules.get(name)
        if getattr(module, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(module.__file__)))
    return tuple(d + os.sep for d in dirs)


def _in_stdlib(path: str) -> bool:
    # threading.py and queue.py sit between a helper thread's wait and the user's line
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep
    return path.startswith(stdlib) and "-packages" not in path


def _site(*frames) -> str:
    """file:line of the user's code: the first frame, outwards from each of ``frames``
    (innermost frames of threads) in turn, outside mpidp, torch and the standard
    library; failing that, the first one outside mpidp and torch."""
    library = _library_dirs()
    fallback = None
    for frame in frames:
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if not path.startswith(library):
                if not _in_stdlib(path):
                    return f"{path.removeprefix(os.getcwd() + os.sep)}:{frame.f_lineno}"
                fallback = fallback or f"{path}:{frame.f_lineno}"
            frame = frame.f_back
    return fallback or "an unknown place (no Python frame outside mpidp)"


def _limit(record) -> tuple[float, str]:
    scope = record[2]
    if scope is not None and scope.timeout is not None:
        return scope.timeout, scope.source
    return _timeout, _timeout_source


def _describe(slot: _Slot, record, frames: dict) -> str:
    label, _, scope, waiting = record
    text = _label_text(label)
    if waiting:
        text = f"i{text} (Handle.wait)"
    if scope is not None:
        text = f"{scope}: {text}"
    # A helper thread (the thread strategy's, autograd's device threads) has no user
    # frame; the thread that handed it the work, or the main thread, has.
    threads = (slot.site or slot.thread, slot.thread, threading.main_thread().ident)
    return f"{text} at {_site(*(frames.get(t) for t in threads))}"


def _in_progress() -> list[tuple[_Slot, tuple]]:
    with _lock:
        slots = list(_slots)
    found = [(s, record) for s in slots if (record := s.current) is not None]
    return sorted(found, key=lambda item: item[1][1])  # the longest waiting first


def _state(now: float) -> dict:
    """This rank's state for rank 0: stalled, waiting (under its timeout) or idle."""
    frames = sys._current_frames()
    calls = _in_progress()
    if not calls:
        main = frames.get(threading.main_thread().ident)
        return dict(kind="idle", text=f"not in an mpidp collective, main thread at {_site(main)}")
    slot, record = calls[0]
    limit, _ = _limit(record)
    elapsed = now - record[1]
    kind = "stalled" if limit and elapsed > limit else "waiting"
    return dict(kind=kind, seconds=elapsed, text=_describe(slot, record, frames))


def _ranks(ranks) -> str:
    """Name ranks as mpidp.comm's messages do, folding runs: 'rank 3', 'ranks 0-2, 5'."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _summary(states: dict[int, dict], size: int) -> str:
    """One line: the ranks grouped by what they do, the longest waits first."""
    groups: dict[tuple, list[int]] = {}
    for rank, state in states.items():
        groups.setdefault((state["kind"], state["text"]), []).append(rank)
    order = {"stalled": 0, "waiting": 1, "idle": 2}
    parts = []
    for (kind, text), ranks in sorted(groups.items(), key=lambda g: (order[g[0][0]], min(g[1]))):
        if kind == "idle":
            parts.append(f"{_ranks(ranks)}: {text}")
            continue
        seconds = max(states[r]["seconds"] for r in ranks)
        under = ", under the timeout" if kind == "waiting" else ""
        parts.append(f"{_ranks(ranks)}: waiting in {text} ({seconds:.1f} s{under})")
    missing = sorted(set(range(size)) - set(states))
    if missing:
        parts.append(f"{_ranks(missing)}: no report (not reachable: dead, or no Python thread "
                     f"can run there, as in a call that holds the GIL)")
    return "; ".join(parts)


# -- printing and ending the job ----------------------------------------------------------

_rank = _size = None  # read on a thread that may call MPI, before the watchdog starts


def _say(line: str) -> None:
    data = f"[mpidp rank {_rank}/{_size}] {line}\n".encode(errors="replace")
    while data:
        try:
            data = data[os.write(2, data):]
        except InterruptedError:
            continue
        except OSError:
            return


def _abort(line: str) -> None:
    """End the job from the watchdog thread, the legal way for the thread level granted."""
    if _multiple:
        runtime._abort([line], ABORT_STATUS)  # prints, lets the launcher read it, MPI_Abort
        # MPICH 5.0's MPI_Abort, called from a thread other than the main one, was
        # seen to return (in 1 of 3 tries) once the launcher had the job in hand.
        os._exit(ABORT_STATUS)
    _say(f"{line}, by os._exit({ABORT_STATUS}): MPI_Abort may not be called from this thread "
         f"below MPI_THREAD_MULTIPLE; the launcher ends the other ranks")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not stop the exit
            pass
    deadline = _clock() + 2.0
    while (runtime._unread_bytes(1) or runtime._unread_bytes(2)) and _clock() < deadline:
        time.sleep(0.01)
    os._exit(ABORT_STATUS)


# -- the channel to rank 0 --------------------------------------------------------------------

class _Channel:
    """Point-to-point on the watchdog's communicator: lines to rank 0, its questions back.

    Built on a thread that may call MPI; used by the watchdog thread only.
    """

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.inbox = bytearray(_MESSAGE_BYTES)
        self.status = MPI.Status()
        self.sends: list = []  # (request, buffer) until complete
        self.states: dict[int, dict] | None = None  # rank 0, while it collects
        self.closes_at = 0.0
        self.request = self._post()

    def _post(self) -> MPI.Request:
        if self.rank == 0:
            return self.comm.Irecv([self.inbox, MPI.BYTE], MPI.ANY_SOURCE, _TAG_LINE)
        return self.comm.Irecv([self.inbox, MPI.BYTE], 0, _TAG_QUERY)

    def _send(self, data: bytes, dest: int, tag: int) -> None:
        self.sends.append((self.comm.Isend([data, MPI.BYTE], dest, tag), data))

    def tell(self, state: dict, unasked: bool) -> None:
        """Send this rank's state to rank 0 (``unasked``: a stall of its own)."""
        text = state["text"]
        while True:
            data = json.dumps(dict(state, text=text, unasked=unasked), ensure_ascii=False)
            if len(data.encode()) <= _MESSAGE_BYTES:
                break
            text = text[:len(text) // 2] + "..."
        self._send(data.encode(), 0, _TAG_LINE)

    def poll(self, now: float) -> None:
        self.sends = [(r, d) for r, d in self.sends if not r.Test()]
        while self.request.Test(self.status):
            source = self.status.Get_source()
            data = bytes(self.inbox[:self.status.Get_count(MPI.BYTE)])
            self.request = self._post()
            if self.rank == 0:
                try:
                    state = json.loads(data)
                except ValueError:  # cannot happen between mpidp watchdogs of one version
                    state = dict(kind="idle", text=f"unreadable report {data[:80]!r}", unasked=True)
                self._heard(source, state, now)
            else:
                self.tell(_state(now), unasked=False)
        if self.states is not None and (now >= self.closes_at or len(self.states) == self.size):
            self._close()

    def _heard(self, source: int, state: dict, now: float) -> None:
        if self.states is None:
            if not state["unasked"]:
                return  # a late answer to a summary already printed
            self.open(now)
        self.states[source] = state

    def open(self, now: float) -> None:
        """Rank 0: start collecting every rank's state (a stall was reported or is ours)."""
        if self.states is not None:
            self.states[0] = _state(now)  # rank 0's own stall, while it collects
            return
        self.states = {0: _state(now)}
        self.closes_at = now + _COLLECT_SECONDS
        for rank in range(1, self.size):
            self._send(b"", rank, _TAG_QUERY)

    def _close(self) -> None:
        states, self.states = self.states, None
        line = f"stall summary: {_summary(states, self.size)}"
        if _action == "abort":
            _abort(f"{line}; aborting the job (MPIDP_TIMEOUT_ACTION=abort)")
        _say(f"{line}; going on (MPIDP_TIMEOUT_ACTION=report)")

    def close(self) -> None:
        """Cancel the posted receive and finish the sends, before MPI_Finalize."""
        if self.request:  # not MPI.REQUEST_NULL: still posted
            self.request.Cancel()
            self.request.Wait()
        deadline = _clock() + 1.0
        while self.sends and _clock() < deadline:
            self.sends = [(r, d) for r, d in self.sends if not r.Test()]


# -- the watchdog thread ----------------------------------------------------------------------

_thread: threading.Thread | None = None
_channel: _Channel | None = None
_multiple = False
_started = False  # start() ran (the communicator exists on every rank)
_stopping = threading.Event()
_wake = threading.Event()
_deadline: float | None = None  # when this rank aborts by itself
_stop_registered = False


def start() -> None:
    """Create the watchdogs' communicator and start this rank's watchdog (collective).

    Every rank of ``MPI.COMM_WORLD`` must call it at the same point of its
    ``COMM_WORLD`` collectives. The creation of the default pool and of a DDP over
    ``COMM_WORLD``, collective there already, call it; the import of mpidp is the
    earliest such point. Later calls, and calls in a multiprocessing child or a
    one-rank job, do nothing.
    """
    global _started, _channel
    if _started or runtime.in_multiprocessing_child():
        return
    runtime.require_mpi()
    _started = True
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return
    comm = world.Dup()
    comm.Set_name("mpidp watchdog")
    if runtime.thread_level() >= MPI.THREAD_MULTIPLE:
        _channel = _Channel(comm)
    _ensure_thread()


def _ensure_thread() -> None:
    global _thread, _rank, _size, _multiple, _stop_registered
    if _thread is not None or runtime.in_multiprocessing_child():
        return
    if not MPI.Is_initialized() or MPI.Is_finalized() or _stopping.is_set():
        return
    with _lock:
        if _thread is not None:
            return
        _rank, _size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        if _size == 1:
            return  # nothing to wait for: a lone rank's collectives complete locally
        _multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        _thread = threading.Thread(target=_run, name="mpidp-watchdog", daemon=True)
        _thread.start()
        if not _stop_registered:
            # MPI is initialised by now, so this runs before a finalisation registered
            # with atexit when it was (runtime's), and before mpi4py's, which runs last.
            atexit.register(_stop)
            _stop_registered = True


def _period() -> float:
    """A quarter of the shortest timeout in force (process-wide, or of a call in progress)."""
    limits = [_limit(record)[0] for _, record in _in_progress()] + [_timeout]
    return min(_MAX_PERIOD, max(_MIN_PERIOD, min([t for t in limits if t > 0], default=4) / 4))


def _run() -> None:
    while not _stopping.is_set():
        _wake.wait(_period())
        _wake.clear()
        if _stopping.is_set():
            return
        try:
            _tick(_clock())
        except Exception as error:  # never die silently: say so once, and stop watching
            _say(f"the stall watchdog failed and stops: {type(error).__name__}: {error}")
            return


def _tick(now: float) -> None:
    global _deadline
    # This rank's own stall first: rank 0 may otherwise hear every other rank's
    # report in this poll and print the summary (and abort) before its own line.
    stalled = [(s, r) for s, r in _in_progress()
               if (limit := _limit(r)[0]) and now - r[1] > limit and s.reported != r[1]]
    if stalled:
        for s, record in stalled:
            s.reported = record[1]  # one line per rank and call
        _report(*stalled[0], now)
    if _channel is not None:
        _channel.poll(now)
    if _deadline is not None and now >= _deadline:
        if _channel is not None:
            why = "rank 0 did not end the job after this rank's stall report"
        elif not _multiple:
            why = "no summary below MPI_THREAD_MULTIPLE"
        else:
            why = "no summary: the watchdogs' communicator was never created (watchdog.start())"
        _abort(f"{why}; aborting the job from this rank (MPIDP_TIMEOUT_ACTION=abort)")


def _report(slot: _Slot, record, now: float) -> None:
    global _deadline
    limit, source = _limit(record)
    state = dict(kind="stalled", seconds=now - record[1],
                 text=_describe(slot, record, sys._current_frames()))
    _say(f"stall: waiting {state['seconds']:.1f} s (timeout {limit:g} s from {source}) in "
         f"{state['text']}")
    if _channel is not None and _channel.rank == 0:
        _channel.open(now)
    elif _channel is not None:
        _channel.tell(state, unasked=True)
    if _action == "abort" and _deadline is None:
        _deadline = now + (_SELF_ABORT_SECONDS if _channel is not None else _LOCAL_GRACE_SECONDS)


def _stop() -> None:
    """At exit, before MPI_Finalize: stop the thread, then release the channel's requests."""
    _stopping.set()
    _wake.set()
    if _thread is not None:
        _thread.join(timeout=5)
    if _channel is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        _channel.close()


def _forked() -> None:
    # The child has no watchdog thread and must not touch the parent's MPI.
    global _thread, _channel, _started, _lock
    _thread, _channel, _started = None, None, True
    _lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_forked)
