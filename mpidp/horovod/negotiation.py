"""The negotiation that starts each Horovod collective: every rank's call compared first.

**Why a negotiation.** Horovod's coordinator compares every rank's request
(dtype, shape, op, root, name) before any data moves, and a mismatch, or a bad
argument on one rank only, fails on every rank. Without it a rank with a
float64 tensor where the others have float32 gets silent garbage, and a rank
that refuses a bad ``root_rank`` leaves the others waiting forever. So each
collective first allreduces (bitwise or) a small control message on the set's
control communicator, and waits for it before the data starts: its
description, the description's complement (the or of the complements is the
complement of the and, so the ranks agree exactly when the or and the and are
equal), a flag for a rank whose arguments failed, and two masks of ranks for
``join``. On a disagreement every rank of the set exchanges what it called and
raises the same error: Horovod's ``HorovodInternalError`` (a ``RuntimeError``), or on a
rank whose own arguments failed, that error's type. A collective's start therefore
waits for every rank of its set to start it (as a blocking MPI call would); its data
then run nonblocking.

**Names.** As Horovod's controller, named operations meet by name, not by position
(``names``): where the ranks' calls differ, a named call is deferred on its rank
(kept in the set's queue, its handle returned) and the control messages that follow
carry a flag, then an exchange of every rank's queue, until every rank of the set
submitted that name; then every rank starts it, in the same order. ``synchronize``
of a deferred operation sends control messages as a waiting rank (no call of its
own) until it starts; ``poll`` sends nothing and answers False until then. Where no
rank can go on (each waits for a name the others never submitted, or is in a call
the others are not in), every rank raises ``HorovodInternalError``: Horovod stalls
there. As in Horovod, a name given to a collective while an earlier one of this rank
with that name is pending on the set (submitted, and not started before the set's
last control message, nor synchronized) is refused on this rank alone, before
anything is sent (``ValueError``); another process set's names are its own.

**join.** ``hvd.join()`` lets a rank that ran out of data keep serving the
other ranks' collectives of the global set, with zeros: a joined rank adds
only its masks to each control message (its description and complement stay
0, so it takes no part in the agreement), reads the description and starts
the matching collective. Both sides start the same calls in the same order on
each communicator, so MPI matches them. The collectives Horovod refuses while a
rank is joined (allgather, broadcast, alltoall, and so the object collectives)
raise ``HorovodInternalError`` on every active rank, and the joined ranks go on
waiting. Other process sets take no part in ``join``.
"""

from __future__ import annotations

import contextlib
import zlib

import numpy as np
from mpi4py import MPI

from ..comm import agreement as _agreement
from ..comm import progress as _engine
from ..comm.dtypes import _DTYPES
from ..comm.handle import issue_recorded
from ..comm.operation import Operation
from . import names as _names
from . import process_sets as _sets

__all__ = ["HorovodInternalError", "checking", "negotiate", "refuse"]

# kinds of collective, as the control message names them (0: only joined ranks called)
JOIN, ALLREDUCE, ALLGATHER, BROADCAST, REDUCESCATTER, BARRIER, ALLTOALL, OBJECT = range(8)
KIND_NAMES = ("join", "allreduce", "allgather", "broadcast", "reducescatter", "barrier",
              "alltoall", "broadcast_object/allgather_object")
OP_CODES = {"sum": 1, "min": 2, "max": 3, "prod": 4, "adasum": 5}
_MAX_DIMS = 8
# kind, dtype + 1, op, root + 1, ndim + 1, name's hash, detail's hash, problem, shape
_HEAD = 8 + _MAX_DIMS
_BITS = 62  # ranks per int64 word of a mask


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank of its set: the ranks' calls differ, or one refused.

    Horovod's name and base class (``horovod.common.exceptions``), so that
    ``except RuntimeError`` and ``except hvd.HorovodInternalError`` catch it as there.
    """


def _error_like(problem: BaseException | None, message: str) -> BaseException:
    """The error a rank raises for a failed negotiation: its own argument error's type, or Horovod's."""
    if problem is not None:
        try:
            return type(problem)(message)
        except Exception:  # an error type whose constructor takes other arguments
            pass
    return HorovodInternalError(message)


class Descriptor:
    """A control message, decoded."""

    def __init__(self, words: np.ndarray, size: int):
        head, complement = words[:_HEAD], words[_HEAD:2 * _HEAD]
        self.active = bool(complement.any())  # a rank other than a joined one called
        self.disputed = self.active and (bool(head[7]) or not np.array_equal(head, ~complement))
        self.kind, dtype, self.op, root, ndim = (int(w) for w in head[:5])
        self.dtype = _DTYPES[dtype - 1] if 0 < dtype <= len(_DTYPES) else None
        self.root = root - 1
        self.shape = tuple(int(d) for d in head[8:8 + ndim - 1]) if 0 < ndim <= _MAX_DIMS + 1 \
            else None
        self.problem = self.active and bool(head[7])
        masks = words[2 * _HEAD:]
        width = len(masks) // 4
        self.joined, self.new, self.waiting, self.pending = (
            _ranks_of(masks[k * width:(k + 1) * width], size) for k in range(4))
        # the ranks must compare their queues of named operations (names.py)
        self.exchange = not self.problem and bool(self.disputed or self.waiting or self.pending)


def _ranks_of(mask: np.ndarray, size: int) -> list[int]:
    return [r for r in range(size) if int(mask[r // _BITS]) >> (r % _BITS) & 1]


def _hash(text) -> int:
    return 0 if text is None else zlib.crc32(str(text).encode()) + 1


def control_message(process_set: _sets.ProcessSet, kind: int, *, dtype=None, op: str | None = None,
                    root: int = -1, shape=None, name=None, detail=None, problem: bool = False,
                    joined: bool = False, new: bool = False, waiting: bool = False,
                    pending: bool = False) -> np.ndarray:
    """This rank's contribution to the set's next control message.

    Args:
        detail: what else must match on every rank (Horovod's op, the scale factors).
        problem: this rank's arguments failed: every rank raises.
        joined, new: this rank is in ``join`` (its description stays 0), entered it now.
        waiting: this rank waits for a deferred operation (its description stays 0).
        pending: this rank has deferred operations on the set.
    """
    comm = process_set.control
    size, rank = comm.Get_size(), comm.Get_rank()
    width = -(-size // _BITS)
    words = np.zeros(2 * _HEAD + 4 * width, dtype=np.int64)
    if not (joined or waiting):
        head = words[:_HEAD]
        if problem:
            head[:] = (kind, *[0] * 6, 1, *[0] * _MAX_DIMS)
        else:
            if shape is not None and len(shape) > _MAX_DIMS:
                raise ValueError(f"mpidp.horovod's collectives take tensors of at most "
                                 f"{_MAX_DIMS} dimensions, got {len(shape)}")
            head[:5] = (kind, _DTYPES.index(dtype) + 1 if dtype is not None else 0,
                        OP_CODES.get(op, 0), root + 1, len(shape) + 1 if shape is not None else 0)
            head[5:7] = _hash(name), _hash(detail)
            if shape is not None:
                head[8:8 + len(shape)] = shape
        words[_HEAD:2 * _HEAD] = ~head
    if joined:
        words[2 * _HEAD + rank // _BITS] |= 1 << (rank % _BITS)
    for k, flag in enumerate((new, waiting, pending), start=1):
        if flag:
            words[2 * _HEAD + k * width + rank // _BITS] |= 1 << (rank % _BITS)
    return words


class Control(Operation):
    """A started control allreduce (bitwise or of ``words``, this rank's control message, on
    the set's control communicator): an engine operation that owns its buffer."""

    __slots__ = ("size",)

    def __init__(self, process_set: _sets.ProcessSet, words: np.ndarray, kind: int):
        self.size = process_set.control.Get_size()
        _rounds[process_set] = _rounds.get(process_set, 0) + 1
        label = f"hvd {KIND_NAMES[kind]} (control message)"
        request, ticket = issue_recorded(
            process_set.control, "Allreduce", (MPI.IN_PLACE, [words, MPI.INT64_T], MPI.BOR),
            label, ("hvd control", words.size, "int64"))
        super().__init__(request, words, words, label=label, scope=None, ticket=ticket)

    def message(self) -> Descriptor:
        """Wait for it (``mpidp.comm.progress``); the message every rank of the set got."""
        return Descriptor(_engine.wait(self), self.size)


def describe(kind: int, *, dtype=None, op=None, root: int = -1, shape=None, name=None,
             detail=None) -> str:
    """A rank's call, as a disagreement names it."""
    parts = [KIND_NAMES[kind]]
    if dtype is not None:
        parts.append(str(dtype).removeprefix("torch."))
    if shape is not None:
        parts.append(f"{'rows of shape' if kind in (ALLGATHER, ALLTOALL) else 'shape'} "
                     f"{tuple(shape)}")
    parts += [f"op {op}"] if op is not None and detail is None else []
    parts += [f"root_rank {root}"] if root >= 0 else []
    parts += [str(detail)] if detail is not None else []
    parts += [f"name {name!r}"] if name is not None else []
    return " ".join(parts)


def dispute(process_set: _sets.ProcessSet, kind: int, mine: str | None,
            problem: BaseException | None = None) -> BaseException:
    """The error every rank of the set raises when a rank's arguments failed.

    Collective over the set (joined and waiting ranks take part with ``mine`` None).
    When every rank failed alike, the error is the local one, with its type.
    """
    def judge(entries: list) -> BaseException:
        problems = [p for p, _ in entries if p is not None]
        if problem is not None and len(problems) == len(entries) and len(set(problems)) == 1:
            return problem  # every rank failed alike (this one too): each raises its own
        what = [f"error: {p}" if p is not None else m for p, m in entries]
        return _error_like(problem, _names.differ_message(KIND_NAMES[kind], what))

    return _agreement.judged(
        process_set.control, (str(problem) if problem is not None else None, mine), judge,
        f"hvd {KIND_NAMES[kind]} (disagreement)")[1]


# Each set's named operations of this rank that wait for the other ranks' (names.py), in
# submission order; changed under the set's lock, in an exchange every rank runs alike.
_deferred: dict = {}
_rounds: dict = {}  # control messages sent on each set (under its lock): _pending_named


def exchange(process_set: _sets.ProcessSet, message: Descriptor, kind: int, *, call=None,
             request=None, waiting=None, joined: bool = False) -> _names.Verdict:
    """Compare the ranks' queues of named operations; start those every rank submitted.

    Collective over the set after a control message with ``exchange`` set, under the
    set's lock; every rank gets the same verdict (``names.judge``). ``call``: this
    rank's call (``describe``); ``request``: its ``Request`` if named (deferred if the
    calls differ); ``waiting``: the deferred operation this rank waits for.
    """
    queue = _deferred.setdefault(process_set, [])
    record = _names.Record(call, request.name if request is not None else None, waiting, joined,
                           tuple((r.name, r.description) for r in queue))
    agreed = not message.disputed and not message.waiting  # the message every rank got
    _, verdict = _agreement.judged(process_set.control, record,
                                   lambda records: _names.judge(records, agreed, KIND_NAMES[kind]),
                                   f"hvd {KIND_NAMES[kind]} (names)")
    if process_set.control.Get_rank() in verdict.deferred:
        queue.append(request)
    mine = dict(zip(_names.keyed((r.name, r.description) for r in queue), queue))
    for key, error in verdict.matched:
        matched = mine[key]
        queue.remove(matched)
        if error is not None:
            matched.error = HorovodInternalError(error)
        else:
            matched.launch(True)
    return verdict


def negotiate(process_set: _sets.ProcessSet, kind: int, problem: BaseException | None = None,
              request=None, **fields) -> Descriptor | None:
    """Agree with the set's other ranks on this call, or raise the same error on all of them.

    Under the set's lock. Where the ranks' calls differ, a named call (``request``) is
    deferred (None returned: it starts once every rank submitted its name, see
    ``names``), a call without a name waits for the next control message, and where no
    rank can go on, every rank raises.

    Args:
        problem: this rank's arguments failed with it.
        fields: the call (dtype, op, root, shape, name, detail).
    """
    if problem is None:
        try:
            control_message(process_set, kind, **fields)
        except ValueError as error:
            problem = error
    call = None if problem else describe(kind, **fields)
    if request is not None:
        request.description = call
    while True:
        pending = bool(_deferred.get(process_set))
        words = control_message(process_set, kind, problem=True, pending=pending) \
            if problem is not None else control_message(process_set, kind, pending=pending,
                                                        **fields)
        message = Control(process_set, words, kind).message()
        if message.problem:
            error = dispute(process_set, kind, call, problem)
            if error is problem:
                raise error
            raise error from problem
        if message.exchange:
            verdict = exchange(process_set, message, kind, call=call, request=request)
            if verdict.stuck is not None:
                raise HorovodInternalError(verdict.stuck)
            if not verdict.agreed:
                if process_set.control.Get_rank() in verdict.deferred:
                    return None
                continue
        if message.joined and process_set is _sets.global_process_set and (
                kind in REFUSED_IN_JOIN or (kind == ALLREDUCE and message.op == OP_CODES["adasum"])):
            raise joined_error(kind, message.joined, message.op)
        return message


def wait_named(request) -> None:
    """Send control messages as a waiting rank until ``request`` (deferred) starts or fails."""
    process_set = request.process_set
    while not request.launched and request.error is None:
        with process_set.lock:
            if request.launched or request.error is not None:
                break
            message = Control(process_set, control_message(
                process_set, request.kind, waiting=True, pending=True), request.kind).message()
            if message.problem:
                dispute(process_set, message.kind, None)
                continue
            verdict = exchange(process_set, message, request.kind, waiting=request.description)
            if verdict.stuck is not None and not request.launched:
                _deferred[process_set].remove(request)  # as on every rank that waits
                raise HorovodInternalError(verdict.stuck)

def refuse(process_set: _sets.ProcessSet, kind: int, problem: BaseException):
    """Raise ``problem`` here and an error that names it on the set's other ranks (collective)."""
    with process_set.lock:
        negotiate(process_set, kind, problem)
    raise problem  # not reached: negotiate raises on a problem


@contextlib.contextmanager
def checking(process_set: _sets.ProcessSet, kind: int):
    """A bad argument found within fails on every rank of the set, not on this one alone: it
    wraps a call's local checks (no collective inside); on a ``TypeError``, ``ValueError`` or
    ``NotImplementedError`` this rank takes part in the set's negotiation with it (``refuse``)."""
    try:
        yield
    except (TypeError, ValueError, NotImplementedError) as error:
        refuse(process_set, kind, error)


# what Horovod refuses while a rank is joined (its controller's "not supported with Join")
REFUSED_IN_JOIN = (ALLGATHER, BROADCAST, ALLTOALL, OBJECT)


def joined_error(kind: int, joined: list[int], op: int = 0) -> HorovodInternalError:
    """The error every active rank raises for a collective that joined ranks cannot serve
    (Adasum: a joined rank would need the bounds of each tensor of the group)."""
    adasum = op == OP_CODES["adasum"]
    return HorovodInternalError(
        f"hvd.{KIND_NAMES[kind]}{' with op=hvd.Adasum' if adasum else ''} while rank(s) {joined} "
        f"have called hvd.join(): joined ranks serve only " + ("the sums, min, max and product"
        if adasum else "allreduce, grouped_allreduce, reducescatter and barrier, as in Horovod"))
