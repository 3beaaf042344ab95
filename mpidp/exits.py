"""How a rank ends: the job-wide abort, the exit it remembers, the MPI library's own exit.

Under ``mpiexec`` with more than one rank, an uncaught exception on
any rank prints a one-line summary, then its traceback, and calls
``MPI_Abort``, so the other ranks do not wait forever in a collective. A rank
leaving with a non-zero status through ``sys.exit(...)``, ``exit(...)`` or
``quit(...)`` aborts the job the same way; a bare ``raise SystemExit(3)``
cannot be seen (Python hands its status to no hook) and still hangs the others.
Under ULFM (``mpirun --with-ft ulfm``), where MPI_Abort does not end the job, the
rank sends SIGTERM to its launcher, prterun or prted, which ends the launch instead.
Set ``MPIDP_ABORT_ON_EXCEPTION=0`` before importing mpidp, or call
``abort_on_exception(False)``, to keep Python's default behaviour.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import dis
import fcntl
import os
import signal
import stat
import sys
import termios
import time
import traceback

from mpi4py import MPI

from . import errors, stacks

__all__ = ["abort_on_exception", "abort_for_exit", "arm", "ending", "remember_exit",
           "set_call_describer", "set_last_words", "ulfm"]


def _not_yet() -> bool:
    return False


_mpi_is_ours = _not_yet  # whether MPI is usable here (not a forked child's): runtime's, given to arm()


# --- abort -----------------------------------------------------------------------------

_python_excepthook = sys.excepthook
_python_exit = sys.exit
_python_quitters = {name: getattr(builtins, name) for name in ("exit", "quit")
                    if hasattr(builtins, name)}  # absent under python -S
_abort_enabled = False
_DRAIN_SECONDS = 2.0  # longest wait for the launcher to read our output before MPI_Abort
_GRACE_SECONDS = 0.1  # then time for it to pass the output on


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except InterruptedError:
            continue
        except OSError:
            return


def _unread_bytes(fd: int) -> int:
    """Bytes written to the pipe behind ``fd`` that its reader has not taken yet (0 if not a pipe)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
    except OSError:
        return 0


def _abort(lines: list[str], status: int) -> None:
    """Print ``lines`` on stderr, each prefixed with the rank, let them reach the user, abort."""
    _library_exit["quiet"] = True  # these lines say why; MPI may exit() the process meanwhile
    _last_words(f"the job ends (status {status}): {(lines[0].strip().splitlines() or [''])[0]}")
    prefix = f"[mpidp rank {MPI.COMM_WORLD.Get_rank()}/{MPI.COMM_WORLD.Get_size()}] "
    text = "".join(prefix + line + "\n" for block in lines for line in block.splitlines())
    for stream in (sys.stdout, sys.stderr):  # what the program printed comes first
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not stop the abort
            pass
    _write_all(2, text.encode(errors="replace"))
    # MPI_Abort makes the launcher kill every process and tear down the pipes
    # that carry output; what it has not read by then is lost (measured: 1 in
    # 30 aborts at 2 ranks under MPICH's hydra lost the whole message). So wait
    # until it has read stdout and stderr, then give it a moment to pass them on.
    deadline = time.monotonic() + _DRAIN_SECONDS
    while (_unread_bytes(1) or _unread_bytes(2)) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(_GRACE_SECONDS)
    if not (ulfm() and _stop_launcher()):
        MPI.COMM_WORLD.Abort(status)
    os._exit(status)  # MPI_Abort was seen to return when called from a thread (MPICH 5.0)


# Under ULFM, Open MPI 5.0's launcher (PRRTE 3.0) takes MPI_Abort as the loss of one rank:
# it tells the others and lets them go on (at 4 ranks they ran to their end, and prterun
# then waited forever), and MPI_Abort on two ranks at once left prterun waiting forever
# on a lock of an object already freed, or ending the launch with status 0. What ends
# the launch there is the launcher's own end: SIGTERM to the rank's parent, prterun (or
# prted on another node, whose loss ends the job), which kills every rank, this one too.
_PRRTE = ("prterun", "prted", "prte")
_LAUNCHER_SECONDS = 10.0  # longest wait for the launcher to kill this rank


def _stop_launcher() -> bool:
    """SIGTERM to this rank's PRRTE parent, then wait to be killed; False if there is none."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/comm") as comm:
            if comm.read().strip() not in _PRRTE:
                return False
        os.kill(parent, signal.SIGTERM)
    except OSError:
        return False
    time.sleep(_LAUNCHER_SECONDS)
    return True


_ON = ("1", "true", "yes", "on", "enabled")


def ulfm() -> bool:
    """Whether this MPI library goes on after a lost rank: Open MPI under ``mpirun --with-ft ulfm``.

    The same on every rank: the launcher sets it for the whole job.
    """
    return ("Open MPI" in MPI.Get_library_version() and hasattr(MPI.Comm, "Shrink")
            and os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in _ON)


def _abort_excepthook(exc_type, exc, tb) -> None:
    if not _mpi_is_ours():  # a forked child inherited the hook: MPI is not ours to abort
        _python_excepthook(exc_type, exc, tb)
        return
    summary = "".join(traceback.format_exception_only(exc_type, exc))
    _abort([summary, "uncaught exception; aborting the MPI job. Traceback:",
            "".join(traceback.format_exception(exc_type, exc, tb))], 1)


# sys.exit() raises SystemExit, which never reaches sys.excepthook (the rank would wait
# in MPI_Finalize). mpidp remembers each sys.exit/exit/quit status with where __main__'s
# code stood, and at exit aborts if __main__ ended right there (it did not catch the
# SystemExit and move on). A bare `raise SystemExit(3)` calls nothing mpidp can wrap.
_main_frame = None  # the frame running __main__'s module code
_exit_request = None  # (SystemExit.code, _main_frame.f_lasti) of the latest call
_exit_site = ("exit", None)  # how the latest call was made, and the user's line that made it


def _find_main_frame():
    main = sys.modules.get("__main__")
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is getattr(main, "__dict__", None):
            return frame
        frame = frame.f_back
    return None


def _remember(exc: SystemExit, how: str) -> None:
    if _main_frame is not None:
        remember_exit(exc.code, how)


def remember_exit(code, how: str = "exit_for_requeue") -> None:
    """Record ``SystemExit(code)`` about to be raised outside ``sys.exit`` (``exit_for_requeue``)."""
    global _exit_request, _exit_site
    _exit_request = (code, _main_frame.f_lasti if _main_frame is not None else -1)
    _exit_site = (how, stacks.user_site(sys._getframe(1)))


def _exit(status=None, /):
    try:
        _python_exit(status)
    except SystemExit as exc:
        _remember(exc, "sys.exit")
        raise


class _Quitter:
    """``exit``/``quit`` as the site module makes them, remembering the status."""

    def __init__(self, quitter):
        self._quitter = quitter

    def __repr__(self):
        return repr(self._quitter)

    def __call__(self, code=None):
        try:
            self._quitter(code)
        except SystemExit as exc:
            _remember(exc, getattr(self._quitter, "name", "exit"))
            raise


def _exit_status(code) -> int:
    # As Python turns SystemExit.code into the process's exit status.
    if code is None:
        return 0
    return int(code) & 0xFF if isinstance(code, int) else 1  # the OS keeps the low 8 bits


def _status_main_exits_with() -> int | None:
    """The status of the sys.exit call that ended __main__, or None if it did not end that way."""
    if _exit_request is None or _main_frame is None:
        return None
    code, position = _exit_request
    final = _main_frame.f_lasti
    # RERAISE: the SystemExit passed through a try/finally (or except: raise) in the module code.
    if final != position and dis.opname[_main_frame.f_code.co_code[final]] != "RERAISE":
        return None
    return _exit_status(code)


def ending() -> dict:
    """How this process ends, as far as it is known at exit (``atexit``), for the ranks it
    leaves behind (``mpidp.watchdog``).

    Returns:
        ``how`` (words: "sys.exit(0)", "exit_for_requeue(75)", "the end of the script", "an
        uncaught ValueError"), ``status`` (the exit status) and ``where`` (file:line of the
        user's code that ended it, None where not known).
    """
    error = getattr(sys, "last_value", None)  # Python sets it before atexit runs
    if error is not None:
        tb = sys.last_traceback
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        return dict(how=f"an uncaught {type(error).__name__}", status=1,
                    where=stacks.user_site(tb.tb_frame) if tb is not None else None)
    if _exit_request is not None and (_main_frame is None
                                      or _status_main_exits_with() is not None):
        how, where = _exit_site
        code = _exit_request[0]
        return dict(how=f"{how}({code!r})", status=_exit_status(code), where=where)
    where = stacks.user_site(_main_frame) if _main_frame is not None else None
    if where is None and sys.argv and sys.argv[0].endswith(".py"):  # python -m mpidp run x.py
        where = sys.argv[0]
    return dict(how="the end of the script", status=0, where=where)


def _abort_on_exit_status() -> None:
    if _status_main_exits_with():
        abort_for_exit(_exit_request[0])


def abort_for_exit(code) -> None:
    """Abort the job if ``SystemExit(code)`` ends this rank with a non-zero status.

    At exit for a program run as ``python program.py`` (above); ``python -m
    mpidp run`` calls it with the SystemExit its program raised, whose module
    frame did not exist yet when mpidp was imported.
    """
    if not (_abort_enabled and _mpi_is_ours()) or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    status = _exit_status(code)
    if status:
        _abort([f"exiting with status {status} (SystemExit({code!r})); aborting the MPI job, "
                f"whose other ranks may be waiting for this one"], status)


def abort_on_exception(enable: bool = True) -> None:
    """Make an uncaught exception, or a non-zero ``sys.exit``, on one rank end the whole MPI job.

    Args:
        enable: install the hooks (True) or restore Python's ``sys.excepthook``,
            ``sys.exit``, ``exit`` and ``quit`` (False).
    """
    global _abort_enabled, _main_frame
    if enable and _main_frame is None:
        _main_frame = _find_main_frame()
    _abort_enabled = enable
    sys.excepthook = _abort_excepthook if enable else _python_excepthook
    sys.exit = _exit if enable else _python_exit
    for name, quitter in _python_quitters.items():
        setattr(builtins, name, _Quitter(quitter) if enable else quitter)


# --- the MPI library ending the process ---------------------------------------------------
# MPICH (5.0, the wheel) treats some errors inside a collective as fatal whatever the
# communicator's error handler says: a truncated message, the usual sign of ranks whose
# element counts or dtypes differ, makes the library print its error stack and call exit()
# from inside the call. No Python exception is raised, and nothing of mpidp's would run.
# A C-level exit handler does run then, with the interpreter still alive: glibc's
# __cxa_atexit, under a key of mpidp's own. It names what the stall watchdog has recorded
# this rank's threads as waiting in, and the way on (MPIDP_DEBUG=1). Python's own exit
# (atexit, interpreter alive) first removes it with __cxa_finalize on that key, because
# a call into Python after the interpreter's finalization crashes; mpidp's own abort
# silences it, having said why already. Without glibc it is not armed.

_library_exit: dict = {"pid": None, "quiet": False, "key": None, "hook": None, "libc": None}
_describe_calls = list  # what this rank's threads wait in: set by mpidp.watchdog at its import


def _nothing(_reason: str) -> None:
    pass


_last_words = _nothing  # writes the flight record before the job ends: set by mpidp.watchdog


def set_last_words(write) -> None:
    """``write(reason)`` runs before this rank ends the job (an abort, the library's exit).

    mpidp.watchdog registers the flight recorder's dump (``mpidp.recorder``); it must
    never raise.
    """
    global _last_words
    _last_words = write


def set_call_describer(describe) -> None:
    """``describe()`` -> lines naming what each thread waits in, for the exit report.

    mpidp.watchdog, which records those calls and imports this module, registers it.
    """
    global _describe_calls
    _describe_calls = describe


def _report_library_exit(_arg) -> None:
    state = _library_exit
    if state["quiet"] or state["pid"] != os.getpid():
        return
    state["quiet"] = True
    try:
        calls = _describe_calls()
        where = "; ".join(calls) if calls else "no mpidp call that the stall watchdog records"
        _last_words(f"the MPI library ended this process in {where}")
        error = errors.mpi_failure(where, RuntimeError("it ended this process (see its error "
                                                       "stack above)"))
        prefix = f"[mpidp rank {MPI.COMM_WORLD.Get_rank()}/{MPI.COMM_WORLD.Get_size()}] "
        _write_all(2, (prefix + str(error) + "\n").encode(errors="replace"))
    except BaseException:  # never let the report stop the exit
        pass


def _arm_library_exit_report() -> None:
    """Arm the report above, once per process (glibc only)."""
    if _library_exit["pid"] == os.getpid():
        return
    try:
        libc = ctypes.CDLL(None)
        register, finalize = libc.__cxa_atexit, libc.__cxa_finalize
    except (OSError, AttributeError):
        return
    key = ctypes.create_string_buffer(1)
    hook = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_report_library_exit)
    if register(hook, None, ctypes.c_void_p(ctypes.addressof(key))) != 0:
        return
    _library_exit.update(pid=os.getpid(), quiet=False, key=key, hook=hook, libc=libc)

    def disarm() -> None:
        _library_exit["quiet"] = True
        finalize(ctypes.c_void_p(ctypes.addressof(key)))

    atexit.register(disarm)


def arm(mpi_is_ours) -> None:
    """Arm how this rank ends, once, at import in the launched process (``mpidp.runtime`` only).

    Arms the report of the MPI library's exit, finds ``__main__``'s frame (for
    ``ending()``) and registers the abort on a non-zero exit status, which runs
    before mpi4py's ``MPI_Finalize``.

    Args:
        mpi_is_ours: ``() -> bool``, whether MPI is usable in this process
            (``mpidp.runtime``'s; False in a forked child, whose MPI is not its to abort).
    """
    global _mpi_is_ours, _main_frame
    _mpi_is_ours = mpi_is_ours
    _arm_library_exit_report()
    if _main_frame is None:  # for ending(): where the script stood when it ended
        _main_frame = _find_main_frame()
    atexit.register(_abort_on_exit_status)  # runs before mpi4py's MPI_Finalize
