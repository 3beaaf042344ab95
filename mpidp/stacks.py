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
with them when that leaves it empty.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import socket
import threading
import time

from . import recorder, settings

__all__ = ["arm", "rearm", "heartbeat", "poll", "stack_lines"]

_file = None  # this rank's stacks file, open from arm() to exit
_signals: tuple[int, ...] = ()  # the signals faulthandler writes on
_seen = 0  # the file's size when poll() last looked
_beat = 0.0  # when heartbeat() last re-armed faulthandler's timer
_beat_seconds = 0.0
_handlers_changed = False  # rearm() ran since poll() last looked
_pid = None  # the process that armed (a fork's child is not it)
_clock = time.monotonic
_PEERS_SECONDS = 1.5


def signals_from_setting() -> tuple[int, ...]:
    """The signal numbers of ``MPIDP_TRACE_SIGNALS`` ("SIGTERM", "USR1,TERM", "none")."""
    found = settings.get("MPIDP_TRACE_SIGNALS")  # parsed by mpidp.settings, as the doctor does
    return (int(signal.SIGTERM),) if found is None else found


def arm(rank: int, size: int) -> None:
    """Open this rank's stacks file, write its pid file (this rank of ``size``, its pid and
    host) and register the signals (main thread, once, at import)."""
    global _file, _signals, _pid, _seen
    if _pid == os.getpid() or threading.current_thread() is not threading.main_thread():
        return
    try:
        _file = open(recorder.path(".stacks.txt"), "a")
        _seen = os.fstat(_file.fileno()).st_size  # an earlier launch's, in the same directory
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
    changed, _handlers_changed = _handlers_changed, False
    if size == _seen:
        return False
    _seen = size
    late = _beat_seconds > 0 and _clock() - _beat >= _beat_seconds
    why = (f"a thread held the GIL for {_beat_seconds:g} s" if late else
           "a signal (faulthandler wrote every thread's stack)")
    recorder.dump(why)
    owned = _owned()
    if owned and not late and not changed:  # else the signal may have met another handler
        time.sleep(1.0)  # the main thread's handler ends the process if it can run
        os._exit(128 + owned[0])
    return True


def stack_lines(frame, limit: int = 12) -> list[str]:
    """``file:line in function`` for ``frame`` and its callers, innermost first (files
    under the working directory named relative to it)."""
    lines, here = [], os.getcwd() + os.sep
    while frame is not None and len(lines) < limit:
        code = frame.f_code
        name = os.path.abspath(code.co_filename).removeprefix(here)
        lines.append(f"{name}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return lines


def _close() -> None:
    """At a clean exit: stop faulthandler, remove the pid file, an empty stacks file and an
    empty directory."""
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
