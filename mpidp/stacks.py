"""Every thread's stack, written where nothing else can: at a signal, and when a thread keeps the GIL.

A stalled rank's threads sit in C (an MPI call) or in Python; either way the
watchdog thread reads their stacks (``mpidp.recorder.dump`` writes them). Two
cases are beyond any Python thread, and ``faulthandler`` covers them, writing
from C without the GIL into this rank's ``rank-NNNNN.stacks.txt`` of
``recorder.directory()``, opened by ``arm()`` at import:

- **A signal** of ``MPIDP_TRACE_SIGNALS`` (default SIGTERM: what ``mpiexec``
  and ``srun`` send before SIGKILL, at a wall-clock limit or a ``scancel``):
  ``faulthandler.register(..., chain=True)`` writes every thread's stack inside
  the signal handler, then the handler that was there runs. Where that was the
  default action (the process ends), ``arm()`` first installs ``_ended_by``,
  which writes the flight record and then ends the process as the default
  would; if the main thread cannot run it (it sits in C), the watchdog thread
  sees the file grow (``poll``), writes the flight record and ends the process
  itself (status 128 + the signal). Where a handler of the program's or of
  ``mpidp.preemption`` is installed, it keeps running and the job goes on.
- **A thread that holds the GIL** (a C extension that never releases it): no
  Python thread runs, so the watchdog cannot answer rank 0. The watchdog
  re-arms ``faulthandler.dump_traceback_later(MPIDP_TIMEOUT)`` at each
  wake-up (``heartbeat``); when it has not for that long, faulthandler's own C
  thread writes every stack.

Rule (``signal`` and ``faulthandler`` are process-wide): ``arm``, ``rearm`` and
``disarm`` run on the main thread (Python's rule for ``signal.signal``);
``mpidp.preemption`` calls ``rearm`` after it installs or removes its handlers,
since ``signal.signal`` silently replaces faulthandler's. A program that uses
``faulthandler.dump_traceback_later`` itself should set ``MPIDP_TIMEOUT=0``.
Beside it, ``rank-NNNNN.pid`` names the rank with its pid and host (``mpidp rank
3/4, pid 23929 on n1``): a launcher that reports a process killed by a signal
names it by pid and host only (MPICH's and Intel MPI's hydra), and then kills
every other rank at once with SIGKILL, so this line and the flight recorder's
black box (``recorder.open_box``, opened here) are all mpidp can leave to say
which rank it was and where each rank was. It is a file of its own because ``poll`` takes any
growth of the stacks file for a signal's stacks, and a second job with the same
``MPIDP_TRACE_DIR`` (a nested launch) opens the same files. At a clean exit the
pid file, the black box and an empty stacks file are removed, and the directory
with them when that leaves it empty; so are the stacks and flight record of a
signal that a handler took (``mpidp.preemption``'s: a stop is no error), when
nothing else was written. ``absent`` reads what these files say of a rank that
sent no word (``mpidp.watchdog``, ``mpidp.trace``).
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import re
import signal
import socket
import sys
import sysconfig
import threading
import time

from . import recorder, settings

__all__ = ["arm", "rearm", "heartbeat", "poll", "site", "stack_lines", "user_site"]

_file = None  # this rank's stacks file, open from arm() to exit
_signals: tuple[int, ...] = ()  # the signals faulthandler writes on
_seen = 0  # the file's size when poll() last looked
_beat = 0.0  # when heartbeat() last re-armed faulthandler's timer
_beat_seconds = 0.0
_handlers_changed = False  # rearm() ran since poll() last looked
_pid = None  # the process that armed (a fork's child is not it)
_clock = time.monotonic
_PEERS_SECONDS = 1.5
_SIGNAL_REASON = "a signal (faulthandler wrote every thread's stack)"
_GIL_MARK = "Timeout ("  # how faulthandler.dump_traceback_later begins what it writes
_fresh = False  # the stacks file was empty when arm() opened it (no earlier launch's stacks)


def signals_from_setting() -> tuple[int, ...]:
    """The signal numbers of ``MPIDP_TRACE_SIGNALS`` ("SIGTERM", "USR1,TERM", "none")."""
    found = settings.get("MPIDP_TRACE_SIGNALS")  # parsed by mpidp.settings, as the doctor does
    return (int(signal.SIGTERM),) if found is None else found


def arm(rank: int, size: int) -> None:
    """Open this rank's stacks file, write its pid file (this rank of ``size``, its pid and
    host) and register the signals (main thread, once, at import)."""
    global _file, _signals, _pid, _seen, _fresh
    if _pid == os.getpid() or threading.current_thread() is not threading.main_thread():
        return
    try:
        _file = open(recorder.path(".stacks.txt"), "a")
        _seen = os.fstat(_file.fileno()).st_size  # an earlier launch's, in the same directory
        _fresh = _seen == 0
        with open(recorder.path(".pid"), "w") as named:
            named.write(f"mpidp rank {rank}/{size}, pid {os.getpid()} on {socket.gethostname()}\n")
        recorder.open_box()
    except OSError as error:
        os.write(2, f"mpidp: no stacks at a signal or a stall: cannot open a file in "
                    f"{recorder.directory()} ({error}); set MPIDP_TRACE_DIR\n".encode())
        return
    _pid = os.getpid()
    _signals = signals_from_setting()
    for number in _signals:
        if signal.getsignal(number) in (signal.SIG_DFL, None):
            signal.signal(number, _ended_by)
    rearm()
    atexit.register(_close)


def rearm() -> None:
    """Register faulthandler again on top of whatever ``signal.signal`` installed (main thread)."""
    global _handlers_changed
    if _file is None or _pid != os.getpid():
        return
    _handlers_changed = True  # a signal poll() sees now may have met the handler before
    for number in _signals:
        faulthandler.unregister(number)  # else register() keeps the handler it saved first
        faulthandler.register(number, file=_file, all_threads=True, chain=True)


def _owned() -> list[int]:
    return [n for n in _signals if signal.getsignal(n) is _ended_by]


def _ended_by(number, _frame) -> None:
    """The handler where the default action was to end: write the flight record, then end."""
    if _pid == os.getpid():
        recorder.dump(f"signal {signal.Signals(number).name}")
        # The launcher ends the other ranks as soon as this one is gone; a rank whose
        # main thread sits in C writes its record from the watchdog thread (poll), at
        # its next look, at most 0.2 s away (mpidp.watchdog._SIGNAL_SECONDS).
        time.sleep(_PEERS_SECONDS)
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)


def heartbeat(seconds: float) -> None:
    """From the watchdog thread, each wake-up: write the stacks if it does not run again
    within ``seconds`` (0: never)."""
    global _beat, _beat_seconds
    if _file is None or _pid != os.getpid():
        return
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, file=_file)
    elif _beat_seconds > 0:
        faulthandler.cancel_dump_traceback_later()
    _beat, _beat_seconds = _clock(), seconds


def poll() -> bool:
    """From the watchdog thread: if faulthandler wrote stacks since the last look, write the
    flight record; if a signal did it and its default was to end the process, end it.

    Returns whether stacks were written.
    """
    global _seen, _handlers_changed
    if _file is None or _pid != os.getpid():
        return False
    size = os.fstat(_file.fileno()).st_size
    if size == _seen:
        _handlers_changed = False
        return False
    _seen = size
    late = _beat_seconds > 0 and _clock() - _beat >= _beat_seconds
    why = f"a thread held the GIL for {_beat_seconds:g} s" if late else _SIGNAL_REASON
    recorder.dump(why)
    # The flag is read after the handlers, and again after the wait: a Checkpointer closed
    # since the signal (a stop, then close()) put this module's handler back and then called
    # rearm(), so a handler of ours with no rearm() since means the signal met it.
    owned = _owned()
    changed, _handlers_changed = _handlers_changed, False
    if owned and not late and not changed:  # else the signal may have met another handler
        time.sleep(1.0)  # the main thread's handler ends the process if it can run
        changed, _handlers_changed = _handlers_changed, False
        if not changed and _owned():
            os._exit(128 + owned[0])
    return True


def _library_dirs() -> tuple[str, ...]:
    dirs = [os.path.dirname(os.path.abspath(__file__))]  # mpidp/
    for name in ("mpidp.kernels", "torch"):
        module = sys.modules.get(name)
        if getattr(module, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(module.__file__)))
    return tuple(d + os.sep for d in dirs)


def _in_stdlib(path: str) -> bool:
    # threading.py and queue.py sit between a helper thread's wait and the user's line
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep
    return path.startswith(stdlib) and "-packages" not in path


def _user_code(path: str, library: tuple[str, ...]) -> bool:
    return not path.startswith(library) and not _in_stdlib(path)


def _named(path: str, line: int) -> str:
    return f"{path.removeprefix(os.getcwd() + os.sep)}:{line}"


def user_site(frame) -> str | None:
    """file:line of the first frame of the user's code (outside mpidp, torch and the standard
    library) outwards from ``frame``, or None."""
    library = _library_dirs()
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if _user_code(path, library):
            return _named(path, frame.f_lineno)
        frame = frame.f_back
    return None


def site(*frames) -> str:
    """file:line of the user's code outwards from each of ``frames`` (innermost frames of
    threads) in turn (``user_site``); failing that, the first frame outside mpidp and torch."""
    for frame in frames:
        found = user_site(frame)
        if found is not None:
            return found
    library = _library_dirs()
    for frame in frames:
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if not path.startswith(library):
                return f"{path}:{frame.f_lineno}"
            frame = frame.f_back
    return "an unknown place (no Python frame outside mpidp)"


_INNERMOST = 8  # frames nearest the call: mpidp's and torch's, for a hang inside them
_USER_FRAMES = 4  # and the user's innermost: the line that made the call, and its callers


def stack_lines(frame) -> list[str]:
    """``file:line in function`` for ``frame`` and its callers, innermost first: the
    ``_INNERMOST`` innermost frames and the ``_USER_FRAMES`` innermost frames of the
    user's code (outside mpidp, torch and the standard library), however deep a DDP
    step or a backward pass puts them; one line counts the frames left out between
    (files under the working directory named relative to it)."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    library = _library_dirs()
    first = next((n for n, f in enumerate(frames)
                  if _user_code(os.path.abspath(f.f_code.co_filename), library)), len(frames))
    kept = sorted(set(range(min(_INNERMOST, len(frames))))
                  | set(range(first, min(first + _USER_FRAMES, len(frames)))))
    lines, previous = [], -1
    for index in kept:
        if index > previous + 1:
            lines.append(f"... {index - previous - 1} frames of mpidp, torch and the standard "
                         f"library ...")
        code = frames[index].f_code
        lines.append(f"{_named(os.path.abspath(code.co_filename), frames[index].f_lineno)} "
                     f"in {code.co_name}")
        previous = index
    return lines


def absent(rank: int, folder: str | None = None, live: bool = True) -> str | None:
    """What the files of ``rank`` in ``folder`` (``recorder.directory()``) say of it, when it
    sent no word: that faulthandler found its GIL held, or that it is dead (``live``: its
    process on this host is gone; else, after the job: it left its pid file, which a clean
    exit removes). None where they cannot tell (its process lives, here or on another host)."""
    base = os.path.join(folder or recorder.directory(), f"rank-{rank:05d}")
    try:
        with open(base + ".stacks.txt", errors="replace") as stacks:
            if _GIL_MARK in stacks.read():
                return (f"a thread of it held the GIL: faulthandler wrote its stacks to "
                        f"{base}.stacks.txt")
    except OSError:
        pass
    try:
        with open(base + ".pid") as named:
            pid, host = re.fullmatch(r"mpidp rank \d+/\d+, pid (\d+) on (\S+)\s*",
                                     named.read()).groups()
    except (OSError, AttributeError):
        return None
    if not live:
        return f"dead: process {pid} on {host} ended without a clean exit (killed?)"
    if host != socket.gethostname():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return f"dead: its process {pid} on {host} is gone"
    except OSError:  # another user's: it lives
        pass
    return None


def _signal_only(stacks: str) -> bool:
    """Whether this rank's stacks and flight record were written for a signal alone (a handler
    took it: the process exits normally), and for nothing else (a stall, an error, a dump())."""
    try:
        with open(stacks, errors="replace") as written:
            if not _fresh or _GIL_MARK in written.read():
                return False
        with open(recorder.path(".json")) as record:
            return json.load(record).get("reason") == _SIGNAL_REASON
    except FileNotFoundError:
        return True  # no record: the signal came while the watchdog could not write one
    except (OSError, ValueError):
        return False


def _close() -> None:
    """At a clean exit: stop faulthandler, remove the pid file, an empty stacks file, the stacks
    and flight record of a signal that a handler took (``mpidp.preemption``'s: a stop is not an
    error), and an empty directory."""
    global _file
    if _file is None or _pid != os.getpid():
        return
    faulthandler.cancel_dump_traceback_later()
    for number in _signals:
        faulthandler.unregister(number)
    name = _file.name
    _file.close()
    _file = None
    recorder.close_box()
    try:
        os.unlink(recorder.path(".pid"))
    except OSError:
        pass
    try:
        if os.path.getsize(name) == 0:
            os.unlink(name)
        elif _signal_only(name):
            os.unlink(name)
            if os.path.exists(recorder.path(".json")):
                os.unlink(recorder.path(".json"))
        os.rmdir(os.path.dirname(name))  # fails while another rank's files are there
    except OSError:
        pass


def _forked() -> None:
    # A child (a DataLoader worker) writes nothing into its parent's files.
    global _file
    if _file is not None:
        for number in _signals:
            faulthandler.unregister(number)
    _file = None


os.register_at_fork(after_in_child=_forked)
