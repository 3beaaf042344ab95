"""Where a collective starts: ``issue``, ``collective``, and ``_start``, which runs one blocking or not.

A nonblocking start returns a ``Handle``: the engine's ``Operation`` (``mpidp.comm.operation``),
completed through ``mpidp.comm.progress``.
"""

from __future__ import annotations

import array
import itertools
import os
import signal

from mpi4py import MPI

from .. import errors as _errors
from .. import recorder as _recorder
from .. import settings
from .. import watchdog as _watchdog
from . import progress as _progress
from .operation import Operation as Handle

__all__ = ["Handle"]

# A blocking step of an mpidp.comm call made on the never-blocking thread (a future's
# callback issuing a collective, an argument exchange, the MPIDP_DEBUG check) is started
# nonblocking and driven there (mpidp.comm.progress), never waited on in MPI_Wait.
_driving = _progress.driving


# A test's kill points: this rank counts the collectives it starts whose label holds a
# point's text; at the point's count it starts that one and ends itself, so that its peers
# lose it inside that very call.
_KILLS: dict = settings.get("MPIDP_TEST_KILL") or {}  # {(launch rank, label text): N}
_counted: dict[str, int] = {}


def _kill_point(label, start=None) -> None:
    """Count a collective; at an ``MPIDP_TEST_KILL`` point, ``start()`` it and end with SIGKILL."""
    rank, text = MPI.COMM_WORLD.Get_rank(), _watchdog._label_text(label)
    for (who, part), count in _KILLS.items():
        if who != rank or part not in text:
            continue
        _counted[part] = _counted.get(part, 0) + 1
        if _counted[part] == count:
            if start is not None:
                start()
            os.write(2, f"rank {rank}: SIGKILL inside its collective {count} of "
                        f"{part or 'any kind'!r} ({text})\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)


def issue(comm: MPI.Intracomm, name: str, args, label=None) -> MPI.Request:
    """Start MPI's nonblocking ``I<name>`` on ``comm``: the one place a collective starts.

    Every collective mpidp issues starts here or in ``_start`` (which uses this for its
    nonblocking form): tensor collectives, a backend call's check, Horovod's control
    message, an agreement. An MPI error raises ``mpidp.errors``' mapped exception, named
    after ``label`` (what the call is, as the stall watchdog names it).
    """
    try:
        request = getattr(comm, "I" + name.lower())(*args)
    except MPI.Exception as error:
        raise _errors.mpi_failure(_watchdog._label_text(label), error) from error
    if _KILLS:
        _kill_point(label)
    return request


def issue_recorded(comm: MPI.Intracomm, name: str, args, label, record: tuple) -> tuple:
    """``issue``, with the flight recorder's entry made first: ``(request, ticket)``.

    For an engine operation whose buffer is not a tensor (a backend call's check, Horovod's
    control message): ``record`` is what the recorder notes, ``(call, count, dtype, extra,
    scope)``, and the ticket goes to the ``Operation`` that completes it.
    """
    ticket = _recorder.started(comm, *record)
    return issue(comm, name, args, label), ticket


# Blocking forms that Open MPI 5.0.11 under ULFM (mpirun --with-ft ulfm) may complete with
# MPI_SUCCESS without moving any data when a rank of ``comm`` dies during them: MPI_Allgatherv
# returned success on some or all survivors with the receive buffer untouched in 5 of 5
# launches of 4 ranks whose rank 0, 2 or 3 SIGKILLed itself in a loop of them, while
# Iallgatherv, Allgather, Allreduce, Bcast, Gather(v), Scatterv, Alltoall(v) and
# Reduce_scatter_block always raised MPI_ERR_PROC_FAILED
# (docs/healing.md#gathers-across-a-lost-rank).
# These run as their I-form and a wait, everywhere: the same messages, in the same order.
_WAITED = frozenset({"Allgatherv"})


def _allgather_objects(comm: MPI.Intracomm, obj) -> list:
    """mpi4py's ``comm.allgather(obj)`` without its MPI_Allgatherv (``_WAITED``): the sizes by
    Allgather, the pickles by Iallgatherv and a wait."""
    data = MPI.pickle.dumps(obj)
    sizes = array.array("q", [0]) * comm.Get_size()
    comm.Allgather([array.array("q", [len(data)]), MPI.INT64_T], [sizes, MPI.INT64_T])
    offsets = [0, *itertools.accumulate(sizes)]
    received = bytearray(offsets[-1])
    _progress.complete(comm.Iallgatherv([data, len(data), MPI.BYTE],
                                        [received, (list(sizes), offsets[:-1]), MPI.BYTE]))
    view = memoryview(received)
    return [MPI.pickle.loads(view[a:b]) for a, b in zip(offsets, offsets[1:])]


_OBJECT_FORMS = {"allgather": _allgather_objects}


def collective(comm: MPI.Intracomm, name: str, args, label):
    """Run MPI collective ``name`` on ``comm``, blocking, for what is not a tensor; return its result.

    ``name`` is mpi4py's: a buffer form (``"Allreduce"``, ``"Barrier"``...: control
    words, a flag), or a pickled object form (``"allgather"``, ``"bcast"``...: small
    Python objects, trusted because only ranks of the job send them). Watched under
    ``label``, an entry of the flight recorder, MPI errors mapped. On the never-blocking thread a buffer form is driven;
    a pickled form has no nonblocking twin, so it raises there (rule 3).
    """
    if name[0].isupper():
        return _start(comm, name, args, None, None, None, False, label)
    if _driving():
        raise RuntimeError(f"{_watchdog._label_text(label)}: a pickled collective cannot run on "
                           f"the progress thread, which must never block (docs/concurrency.md, rule 3)")
    ticket = _recorder.started(comm, name, -1, None, (), label if isinstance(label, str) else None)
    if _KILLS:
        _kill_point(label)
    slot = _watchdog.begin(label)
    try:
        if name in _OBJECT_FORMS:
            return _OBJECT_FORMS[name](comm, *args)
        return getattr(comm, name)(*args)
    except MPI.Exception as error:
        raise _errors.mpi_failure(_watchdog._label_text(label), error) from error
    finally:
        slot.current = None
        _recorder.ended(ticket)


def _record(comm, call: str, label, scope, nonblocking: bool) -> int:
    """The flight recorder's entry for MPI call ``call`` labelled ``(name, tensor, key, value...)``,
    or, for what is not a tensor (``collective``), by a text; a nonblocking one is named as
    such (MPI never matches it with a blocking one)."""
    if isinstance(label, tuple):
        name, tensor, extra = label[0], label[1], label[2:]
    else:
        name, tensor, extra = call.lower(), None, ()
        scope = label if isinstance(label, str) else scope
    if nonblocking:
        name = "i" + name
    if tensor is None:
        return _recorder.started(comm, name, 0, None, extra, scope)
    return _recorder.started(comm, name, tensor.numel(), tensor.dtype, extra, scope)


def _start(comm: MPI.Intracomm, name: str, args, keep, result, finish, nonblocking: bool,
           label=None):
    """Run MPI collective ``name`` (blocking) or its ``I``-form, returning tensor or Handle.

    ``label`` names the call in stall reports (``mpidp.watchdog``), built only then,
    and is what the flight recorder (``mpidp.recorder``) notes of it:
    ``(name, tensor, key, value, ...)``.
    """
    scope = _watchdog.context()
    ticket = _record(comm, name, label, scope, nonblocking)
    if nonblocking:
        return Handle(issue(comm, name, args, label), keep, result, finish, label, scope, ticket)
    if _KILLS:
        _kill_point(label, lambda: getattr(comm, "I" + name.lower())(*args))
    try:
        if _driving():  # never block on that thread: the I-form, driven
            _progress.complete(getattr(comm, "I" + name.lower())(*args))
        else:
            slot = _watchdog.begin(label, scope)
            try:
                if name in _WAITED:
                    _progress.complete(getattr(comm, "I" + name.lower())(*args))
                else:
                    getattr(comm, name)(*args)
            finally:
                slot.current = None
    except MPI.Exception as error:
        raise _errors.mpi_failure(_watchdog._label_text(label), error) from error
    _recorder.ended(ticket)
    if finish is not None:
        finish()
    return result
