"""Preemption: a signal on any one rank becomes a stop that every rank takes at the same step.

A scheduler about to take the nodes back signals the job (SLURM: SIGTERM, or
the signal of ``--signal=SIG@T`` T seconds ahead, then SIGKILL after
``KillWait``; PBS the same with its own delays). The signal may reach one rank
or all, at any moment: inside an allreduce, in the backward, between steps.

- ``arm(signals)`` installs handlers that only set this process's flag
  (``requested()``); nothing else may run inside a handler, which interrupts
  Python code at any bytecode, a torch.save or an MPI call's return included.
- The ranks agree at a step boundary. ``agree_stop(comm)`` is one 4-byte
  allreduce (``mpidp.comm.agreement.any_failed``) that the user's loop calls once
  per step, in the same place on every rank. Under mpidp's
  ``DistributedDataParallel`` the flag travels for free: every synced step
  already sums a small bookkeeping vector across the ranks
  (``mpidp.ddp.reducer``), which carries each rank's flag in one more integer, so
  ``agreed_by(ddp)`` reads the agreement that step made, and calls nothing.
- ``exit_for_requeue()`` ends every rank together with ``EXIT_STATUS`` (75,
  ``EX_TEMPFAIL`` of sysexits.h: try again later), which the job scripts in
  ``jobscripts/`` turn into a requeue.

``mpidp.checkpoint.Checkpointer`` puts these together with an atomic save;
these are its building blocks for a user with a loop and checkpoints of their
own. Nothing here calls MPI at import; ``arm`` must run in the main thread
(Python delivers signals there only).
"""

from __future__ import annotations

import signal
import sys
import threading

from mpi4py import MPI

from .comm import agreement
from . import exits, runtime, stacks

__all__ = ["EXIT_STATUS", "DEFAULT_SIGNALS", "EARLY_SIGNALS", "signal_numbers", "arm", "keep_early", "disarm", "armed",
           "requested", "received",
           "clear", "agree_stop", "agreed_by", "exit_for_requeue"]

EXIT_STATUS = 75
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")

_received: int | None = None  # the last signal number the handler saw; the handler's only write
_previous: dict[int, object] = {}  # signal number -> the handler arm() replaced


def _handler(signum, _frame) -> None:
    global _received
    _received = signum


def _number(sig) -> int:
    if isinstance(sig, signal.Signals):
        return int(sig)
    if isinstance(sig, str):
        name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
        found = getattr(signal.Signals, name, None) if name.isidentifier() else None
        if found is None:
            raise ValueError(f"signals: unknown signal name {sig!r}")
        return int(found)
    if isinstance(sig, int) and not isinstance(sig, bool):
        try:
            return int(signal.Signals(sig))
        except ValueError:
            raise ValueError(f"signals: {sig} is not a signal number of this system") from None
    raise TypeError(f"signals: expecting signal names or numbers, got {sig!r}")


def signal_numbers(signals) -> tuple[int, ...]:
    """The numbers of ``signals`` (names such as "SIGTERM" or "USR1", or numbers), checked.

    Raises:
        ValueError: an unknown or uncatchable signal, or none at all.
    """
    if isinstance(signals, (str, int, signal.Signals)):
        signals = (signals,)
    numbers = tuple(dict.fromkeys(_number(sig) for sig in signals))
    if not numbers:
        raise ValueError("signals: name at least one signal")
    for number in numbers:
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"signals: {signal.Signals(number).name} cannot be caught")
    return numbers


def arm(signals=DEFAULT_SIGNALS) -> tuple[int, ...]:
    """Make ``signals`` set this rank's stop flag instead of their default action (local).

    Args:
        signals: names ("SIGTERM", "USR1") or numbers; SIGKILL and SIGSTOP cannot
            be caught.

    Returns:
        The signal numbers now armed.

    Raises:
        ValueError: an unknown or uncatchable signal, or none at all.
        RuntimeError: called outside the main thread.
    """
    numbers = signal_numbers(signals)
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("mpidp.preemption.arm() must be called from the main thread "
                           "(Python runs signal handlers there only)")
    for number in numbers:
        previous = signal.signal(number, _handler)
        if previous is not _handler:
            _previous[number] = previous
        elif number in _early and number not in _previous:  # kept since import: default after
            _previous[number] = signal.SIG_DFL
    stacks.rearm()  # signal.signal replaced faulthandler's stack dump (MPIDP_TRACE_SIGNALS)
    return numbers


EARLY_SIGNALS = ("SIGUSR1", "SIGUSR2")


def keep_early() -> tuple[int, ...]:
    """At ``import mpidp``: SIGUSR1 and SIGUSR2 set the stop flag from then on (main thread).

    A scheduler's warning (``--signal=USR1@T``) may come before any ``arm``: during
    start-up, or in a job whose ``Checkpointer`` is made later. MPICH takes SIGUSR1 at
    ``MPI_Init`` and does nothing with it (the signal was lost, and such a run finished as
    if never warned: bench/reports/preempt-2026-11-27);
    other libraries leave it to end the process. Either way the warning was lost; kept,
    the first ``arm`` (a ``Checkpointer``) finds it and stops at the first step. A
    handler the user installed is left alone, and so is SIGTERM, whose default (end the
    process) a job without a ``Checkpointer`` relies on.
    """
    if threading.current_thread() is not threading.main_thread():
        return ()
    kept = []
    for number in signal_numbers(EARLY_SIGNALS):
        if signal.getsignal(number) in (signal.SIG_DFL, None):
            signal.signal(number, _handler)
            _early.add(number)
            kept.append(number)
    stacks.rearm()  # signal.signal replaced faulthandler's stack dump (MPIDP_TRACE_SIGNALS)
    return tuple(kept)


_early: set[int] = set()  # signals keep_early gave the flag's handler (their old action: default)


def disarm() -> None:
    """Give every armed signal back the handler it had before ``arm`` (local)."""
    while _previous:
        number, previous = _previous.popitem()
        if number in _early:  # back to what import made it: the flag's, as before arm()
            continue
        signal.signal(number, previous if previous is not None else signal.SIG_DFL)
    stacks.rearm()


def armed() -> tuple[int, ...]:
    """The signal numbers whose handler is the stop flag's."""
    return tuple(sorted(_previous))


def requested() -> bool:
    """Whether a signal asked this rank to stop (this rank only; nothing is agreed)."""
    return _received is not None


def received() -> int | None:
    """The last signal number that asked this rank to stop, or None."""
    return _received


def clear() -> None:
    """Forget this rank's stop request (after a stop the loop chose to go on from)."""
    global _received
    _received = None


def agree_stop(comm: MPI.Intracomm | None = None) -> bool:
    """True on every rank if a stop was requested on any (collective: one 4-byte allreduce).

    Call it once per step, at the same point on every rank.

    Args:
        comm: the ranks that stop together (default: the world, ``mpidp.runtime.world()``).
    """
    comm = runtime.world() if comm is None else comm
    return agreement.any_failed(comm, requested(), "preemption: do all ranks stop here?")


def agreed_by(ddp) -> tuple[int, bool]:
    """What the bookkeeping of mpidp DDP's last synced step agreed on (local, no call).

    Returns:
        (how many bookkeeping sums ``ddp``'s reducer has made, whether any rank
        had a stop requested at the last one). Both are the same on every rank,
        so a count that moved since the caller last looked means that the last
        synced step carried the flags and no allreduce of its own is needed.
    """
    reducer = ddp.reducer
    return reducer.bookkeeping_count, reducer.stop_votes > 0


def exit_for_requeue(status: int = EXIT_STATUS) -> None:
    """End this rank with ``status``, which every rank does together after a stop (collective).

    Turns off mpidp's abort on a non-zero exit (every rank leaves with the same
    status, so nobody is left waiting), waits for the other ranks, then raises
    ``SystemExit(status)``; MPI is finalised at exit as usual.
    """
    agreement.any_failed(runtime.world(), False, "preemption: every rank leaves together")
    exits.abort_on_exception(False)
    exits.remember_exit(status)  # for the exit of a healed process (runtime.set_world)
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(status)
