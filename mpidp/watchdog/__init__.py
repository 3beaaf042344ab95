"""The stall watchdog: when an mpidp collective waits too long, say which rank waits where.

An MPI hang is silent: the ranks sit in their calls forever. torch's
watchdog and Horovod's stall inspector turn that into a message; this is
mpidp's. This module records the calls and watches them; what a rank then
says, and rank 0's summary of every rank's state, are ``mpidp.watchdog.report``'s.

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
recorded call, wakes every min(timeout / 4, 1 s) (and every 0.2 s to look
for a signal's stacks, ``mpidp.stacks.poll``). When a call has waited
longer than its timeout, the rank prints one line on stderr, once per call:
what it waits in, and the call site (``stall_report`` shows it).

**The watchdogs' communicator.** ``start()`` duplicates ``MPI.COMM_WORLD``
for the watchdogs alone, over which rank 0 gathers the summary. It is
collective, so it must run at a moment every rank passes in the same order
of ``COMM_WORLD`` collectives. The best one is the import of mpidp, whose
start-up is collective already; the creation of the default pool and the
construction of a DDP over ``COMM_WORLD``, both collective over
``COMM_WORLD`` themselves, call it too, and the first of these moments
creates it (later calls do nothing). It is made whatever the timeout, so
that every rank takes part even where the timeouts differ. If rank 0 cannot
summarise, each stalled rank aborts the job by itself
``_SELF_ABORT_SECONDS`` after its own line.

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

**Limits.** Only calls that go through mpidp are seen. ``mpidp.barrier()``,
the sparse gradients' gathers (``mpidp.comm.allgatherv``), DDP's construction
check and every error agreement (``mpidp.comm.agreement``) are recorded; raw mpi4py
calls and the payload transfers of ``mpidp.objects`` are not, and a rank stuck
there reads as "not in an mpidp collective".
A rank whose watchdog thread never started (it made no recorded call and
nothing called ``start()``) cannot answer.

**Finished ranks.** At exit, before MPI_Finalize (or inside a program's own
``MPI.Finalize()``, through an attribute of ``MPI_COMM_SELF``), each rank tells
the others over the channel where it finished (``exits.ending()``: the
user's line of ``sys.exit``, ``exit_for_requeue``, ``MPI.Finalize()``, or the
end of the script), so a summary names it as finished, not as silent. Several threads in mpidp calls at
once: the line names the one that has waited longest. The abort status is
``ABORT_STATUS`` (124, as GNU ``timeout``).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from mpi4py import MPI

from .. import errors as _errors
from .. import settings
from .. import exits, runtime
from .. import communicators as _communicators
from .. import recorder as _recorder, stacks as _stacks
from . import report as stall_report
from .report import ABORT_STATUS
from . import slots as _slots_module
from .slots import Scope, _Slot, _clock, _lock, _slots, check_timeout, watched
# the rest of the hot path, re-exported: every layer calls them as watchdog.begin...
from .slots import begin as begin, context as context, handoff as handoff, slot as slot

__all__ = ["ABORT_STATUS", "Scope", "barrier", "set_timeout", "get_timeout", "start", "watched"]

_ACTIONS = ("abort", "report")
_SELF_ABORT_SECONDS = 8.0  # rank 0 summarises within stall_report's 3 s + a wake-up of its own
_LOCAL_GRACE_SECONDS = 2.0  # without a summary: time for the other ranks to print their lines
_MAX_PERIOD, _MIN_PERIOD = 1.0, 0.05
# Between wake-ups, how often the thread looks whether a signal's stacks were written while the
# main thread sits in C: Open MPI's mpirun sends SIGKILL about a second after SIGTERM, and
# bench/stall_soak.py found ranks killed before their next wake-up without a flight record.
_SIGNAL_SECONDS = 0.2

# Other modules name labels and ranks in their messages as the reports do.
_label_text = stall_report.label_text
_ranks = stall_report.ranks_text


def _timeout_from_env() -> tuple[float, str]:
    value = settings.get("MPIDP_TIMEOUT")
    return value, ("MPIDP_TIMEOUT" if settings.given("MPIDP_TIMEOUT") else "the default")


# Read once at import, as MPIDP_DEBUG is; set_timeout() replaces them.
_timeout, _timeout_source = _timeout_from_env()
_action = settings.get("MPIDP_TIMEOUT_ACTION")


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


# -- what this rank is doing -------------------------------------------------------------------

def _limit(record) -> tuple[float, str]:
    scope = record[2]
    if scope is not None and scope.timeout is not None:
        return scope.timeout, scope.source
    return _timeout, _timeout_source


def _in_progress() -> list[tuple[_Slot, tuple]]:
    with _lock:
        slots = list(_slots)
    found = [(s, record) for s in slots if (record := s.current) is not None]
    return sorted(found, key=lambda item: item[1][1])  # the longest waiting first


def describe_calls() -> list[str]:
    """What each of this rank's threads waits in now, the longest first (for exit reports)."""
    frames = sys._current_frames()
    return [stall_report.describe(slot, record, frames) for slot, record in _in_progress()]


exits.set_call_describer(describe_calls)
exits.set_last_words(lambda reason: _recorder.dump(reason, describe_calls()))


def barrier() -> None:
    """Block until every rank of the world (``mpidp.runtime.world()``) has called ``barrier`` (watched)."""
    runtime.require_mpi()
    watched("mpidp.barrier()", runtime.world().Barrier)


def _state(now: float) -> dict:
    """This rank's state for rank 0: stalled, waiting (under its timeout) or idle, with the
    stack of the thread it names; the flight record is written first."""
    _evidence("asked by rank 0's stall watchdog")
    frames = sys._current_frames()
    calls = _in_progress()
    main = threading.main_thread().ident
    if not calls:
        return dict(kind="idle", text=f"not in an mpidp collective, main thread at "
                                      f"{stall_report.site(frames.get(main))}",
                    stack=_stacks.stack_lines(frames.get(main)), thread="MainThread")
    slot, record = calls[0]
    limit, _ = _limit(record)
    kind = "stalled" if limit and now - record[1] > limit else "waiting"
    return _call_state(kind, slot, record, now, frames)


def _call_state(kind: str, slot: _Slot, record, now: float, frames: dict) -> dict:
    """What rank 0 hears of a call: its words, how long it waited, the stack that made it."""
    thread = slot.site or slot.thread
    return dict(kind=kind, seconds=now - record[1],
                text=stall_report.describe(slot, record, frames),
                stack=_stacks.stack_lines(frames.get(thread) or frames.get(slot.thread)),
                thread=_thread_name(thread))


def _thread_name(ident: int) -> str:
    return next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))


_evidence_at = -1e9


def _evidence(reason: str) -> None:
    """Write the flight record with every thread's stack (``mpidp.recorder``), once per stall."""
    global _evidence_at
    if _clock() - _evidence_at > 2.0:  # a stall's own line and rank 0's question: one file
        _evidence_at = _clock()
        _recorder.dump(reason, describe_calls())


# -- the watchdog thread ----------------------------------------------------------------------

_thread: threading.Thread | None = None
_channel: stall_report.Channel | None = None
_channel_lost = False  # the channel was dropped because a peer was lost (ULFM), until a heal
_multiple = False
_started = False  # start() ran (the communicator exists on every rank)
_comm: MPI.Intracomm | None = None  # the channel's communicator, kept for a heal to release
_channel_lock = threading.Lock()  # the channel, between the watchdog thread and a heal
_stopping = threading.Event()
_wake = threading.Event()
_deadline: float | None = None  # when this rank aborts by itself
_stop_registered = False


def start() -> None:
    """Create the watchdogs' communicator and start this rank's watchdog (collective).

    Every rank of ``MPI.COMM_WORLD`` must call it at the same point of its
    ``COMM_WORLD`` collectives: ``import mpidp`` does, on every rank, before any
    other collective (so nothing later calls it over a world a heal may have
    replaced). Later calls, and calls in a multiprocessing child or a one-rank
    job, do nothing.
    """
    global _started, _channel
    if _started or runtime.in_multiprocessing_child():
        return
    runtime.require_mpi()
    _started = True
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return
    _channel = _open_channel(world, first=True)
    _ensure_thread()
    _arm_finalize_hook()


def _open_channel(world: MPI.Intracomm, first: bool = False) -> "stall_report.Channel | None":
    global _comm
    comm = _comm = _communicators.made(world.Dup(), "the stall watchdog",
                                       "the watchdog's thread", rebuild=_rebuild)
    comm.Set_name("mpidp watchdog")
    if first:  # the flight recorder's directory keeps its name after a heal
        # A name alike on every rank: the batch system's job id, else one that rank 0
        # picks (the one collective on this communicator, right after its creation).
        job = _recorder.scheduler_job() or comm.bcast(
            f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}" if world.Get_rank() == 0 else None)
        _recorder.set_job(job, world.Get_rank(), world.Get_size())
        _stacks.arm(world.Get_rank(), world.Get_size())
    if runtime.thread_level() >= MPI.THREAD_MULTIPLE:
        return stall_report.Channel(comm, _state, _recorder.directory(), absent=_stacks.absent,
                                    heard=_recorder.heard_ended)
    return None


def _rebuild(world: MPI.Intracomm) -> None:
    """After a heal (``mpidp.healing``): the channel over the survivors (collective over ``world``).

    The old channel's requests died with its revoked communicator; the watchdog
    thread, which may have stopped on them, starts again.
    """
    global _channel, _thread, _channel_lost
    with _channel_lock:
        _channel = None
    _communicators.release(_comm)
    channel = _open_channel(world) if world.Get_size() > 1 else None
    stall_report.set_rank(world.Get_rank(), world.Get_size())
    with _channel_lock:
        _channel, _channel_lost = channel, False
    if _thread is not None and not _thread.is_alive():
        _thread = None
        _ensure_thread()


def _ensure_thread() -> None:
    global _thread, _multiple, _stop_registered
    if _thread is not None or runtime.in_multiprocessing_child():
        return
    if not MPI.Is_initialized() or MPI.Is_finalized() or _stopping.is_set():
        return
    with _lock:
        if _thread is not None:
            return
        # read here, on a thread that may call MPI, for the watchdog thread's lines
        rank, size = runtime.world().Get_rank(), runtime.world().Get_size()
        if size == 1:
            return  # nothing to wait for: a lone rank's collectives complete locally
        stall_report.set_rank(rank, size)
        _multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        _thread = threading.Thread(target=_run, name="mpidp-watchdog", daemon=True)
        _thread.start()
        if not _stop_registered:
            # MPI is initialised by now, so this runs before a finalisation registered
            # with atexit when it was (runtime's), and before mpi4py's, which runs last.
            atexit.register(_at_exit)
            _stop_registered = True



_slots_module.on_new_slot(_ensure_thread)

def _period() -> float:
    """A quarter of the shortest timeout in force (process-wide, or of a call in progress)."""
    limits = [_limit(record)[0] for _, record in _in_progress()] + [_timeout]
    return min(_MAX_PERIOD, max(_MIN_PERIOD, min([t for t in limits if t > 0], default=4) / 4))


def _run() -> None:
    due = _clock() + _period()
    while not _stopping.is_set():
        woken = _wake.wait(max(0.0, min(due - _clock(), _SIGNAL_SECONDS)))
        _wake.clear()
        if _stopping.is_set():
            return
        try:
            now = _clock()
            if woken or now >= due:
                _tick(now)
                due = now + _period()
            else:
                _stacks.poll()  # a signal's stacks: write the record before a SIGKILL
        except Exception as error:  # never die silently: say so once, and stop watching
            stall_report.say(f"the stall watchdog failed and stops: {type(error).__name__}: {error}")
            return


def _tick(now: float) -> None:
    _stacks.heartbeat(_timeout)  # stacks from C if this thread cannot run again in time
    _stacks.poll()  # a signal's stacks: the flight record beside them
    with _channel_lock:  # a heal replaces the channel (_rebuild)
        _tick_locked(now)


def _tick_locked(now: float) -> None:
    global _deadline, _channel, _channel_lost
    # This rank's own stall first: rank 0 may otherwise hear every other rank's
    # report in this poll and print the summary (and abort) before its own line.
    stalled = [(s, r) for s, r in _in_progress()
               if (limit := _limit(r)[0]) and now - r[1] > limit and s.reported != r[1]]
    if stalled:
        for s, record in stalled:
            s.reported = record[1]  # one line per rank and call
        _report_stall(*stalled[0], now)
    try:
        summary = _channel.poll(now) if _channel is not None else None
    except Exception as error:
        if not _errors.lost_rank(error):
            raise
        _channel, summary = None, None  # a peer is gone: no summary until a heal's new channel
        _channel_lost = True
    if summary is not None:
        _conclude(summary)
    if _deadline is not None and now >= _deadline:
        if _channel is not None and 0 in _channel.ended:
            why = "rank 0 finished, so no summary comes"
        elif _channel is not None:
            why = "rank 0 did not end the job after this rank's stall report"
        elif not _multiple:
            why = "no summary below MPI_THREAD_MULTIPLE"
        elif _channel_lost:
            why = ("no summary: a rank of the watchdogs' communicator was lost, and no heal "
                   "made a new one")
        else:
            why = "no summary: the watchdogs' communicator was never created (watchdog.start())"
        stall_report.abort(f"{why}; aborting the job from this rank (MPIDP_TIMEOUT_ACTION=abort)",
                           _multiple)


def _report_stall(slot: _Slot, record, now: float) -> None:
    global _deadline
    limit, source = _limit(record)
    state = _call_state("stalled", slot, record, now, sys._current_frames())
    stall_report.say(f"stall: waiting {state['seconds']:.1f} s (timeout {limit:g} s from "
                     f"{source}) in {state['text']}")
    _evidence(f"stall: waiting {state['seconds']:.1f} s in {state['text']}")
    if _channel is not None and _channel.rank == 0:
        _channel.open(now)
    elif _channel is not None and 0 in _channel.ended:
        stall_report.say(f"no stall summary: rank 0 {_channel.ended[0]['text']}")
    elif _channel is not None:
        _channel.tell(state, unasked=True)
    if _action == "abort" and _deadline is None:
        summarised = _channel is not None and 0 not in _channel.ended
        _deadline = now + (_SELF_ABORT_SECONDS if summarised else _LOCAL_GRACE_SECONDS)


def _conclude(report: list[str]) -> None:
    """Rank 0: print the summary of every rank's state and their stacks, then abort or go on."""
    line = f"stall summary: {report[0]}"
    end = ("aborting the job (MPIDP_TIMEOUT_ACTION=abort)" if _action == "abort" else
           "going on (MPIDP_TIMEOUT_ACTION=report)")
    lines = [f"{line}; {end}", *report[1:]]
    _recorder.write("summary.txt", "\n".join(lines) + "\n")
    if _action == "abort":
        stall_report.abort("\n".join(lines), _multiple)
    for text in lines:
        stall_report.say(text)


def _stop(ending: dict | None = None) -> None:
    """At exit, before MPI_Finalize (or from inside it, ``_finalizing``): stop the thread, tell
    the other ranks where this one finished, release the channel's requests.

    Args:
        ending: how this rank ends (``exits.ending()``'s keys); None: ask ``exits.ending()``.
    """
    global _finished
    if _finished:
        return
    _finished = True
    _stopping.set()
    _wake.set()
    if _thread is not None:
        _thread.join(timeout=5)
    with _channel_lock:
        if _channel is not None and MPI.Is_initialized() and not MPI.Is_finalized():
            try:  # best effort: a peer lost (ULFM) must not turn the exit into a traceback
                _channel.finish(dict(kind="finished",
                                     text=_finish_text(ending or exits.ending())))
            except Exception:  # noqa: BLE001
                pass
            _channel.close()


def _finish_text(ending: dict) -> str:
    """"finished at train.py:42 (sys.exit(0), status 0)"; "stopped" for a preemption's stop."""
    verb = "stopped" if ending["how"].startswith("exit_for_requeue") else "finished"
    where = f" at {ending['where']}" if ending["where"] else ""
    status = f", status {ending['status']}" if ending["status"] is not None else ""
    return f"{verb}{where} ({ending['how']}{status})"


_finished = False  # _stop ran: the other ranks were told


def _arm_finalize_hook() -> None:
    """Run ``_finalizing`` at the start of MPI_Finalize (main thread, once).

    MPI deletes ``MPI_COMM_SELF``'s attributes first thing in MPI_Finalize, while MPI
    still works (MPI 4.0, 11.2.4): a program that calls ``MPI.Finalize()`` itself leaves
    MPI before the ``atexit`` handler runs, and this is the one moment it can still
    tell the others. ``_stop`` at exit deletes the attribute (the hook then does nothing).
    """
    global _keyval
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=_finalizing)
        MPI.COMM_SELF.Set_attr(_keyval, True)


_keyval = None


def _finalizing(_comm, _keyval_, _value) -> None:
    if _finished or threading.current_thread() is not threading.main_thread():
        return
    _stop(dict(how="MPI_Finalize()", status=None, where=_stacks.user_site(sys._getframe())))


def _at_exit() -> None:
    _stop()
    if _keyval is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_SELF.Delete_attr(_keyval)  # runs _finalizing, which finds _stop done


def _forked() -> None:
    # The child has no watchdog thread and must not touch the parent's MPI.
    global _thread, _channel, _started, _lock
    _thread, _channel, _started = None, None, True
    _lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_forked)
