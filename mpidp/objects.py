"""Python objects over MPI: pickled broadcast and allgather, and averages of numbers for logging.

Objects are pickled (protocol 5) and the bytes sent as one buffer message, so
a large object costs a pickle, one collective and an unpickle, and messages
past 2 GiB go through MPI's large-count calls (mpi4py picks them). What could
fail on one rank only is agreed on before anyone goes on: an object that
cannot be pickled, or a message that cannot be unpickled, raises the same
error on every rank instead of leaving the others waiting in a collective.

``comm`` is taken as in ``mpidp.comm``: None (the default pool), a ``Pool``
(its next member) or an mpi4py communicator; each call runs all its steps on
that one communicator, so it may be interleaved with tensor collectives as long
as every rank makes the same calls in the same order.
"""

from __future__ import annotations

import itertools
import numbers
import pickle

import torch
from mpi4py import MPI

from .comm.handle import collective
from .comm import agreement as _agreement
from . import comm as _comm

__all__ = ["broadcast_object", "allgather_object", "gather_object", "average"]


def _dumps(obj) -> tuple[bytes | None, str | None]:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as err:  # pickling runs arbitrary __reduce__ code
        return None, f"{type(err).__name__}: {err}"


def _loads(data) -> tuple[object, str | None]:
    try:
        return pickle.loads(data), None
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"


def _start(comm, name: str, **fields) -> MPI.Intracomm:
    """Take the communicator a call runs on (arguments already checked)."""
    mpi = _comm._collective_comm(comm)
    if _comm.checks._DEBUG:
        _comm._check_same_call(mpi, name, False, **fields)
    return mpi


def broadcast_object(obj, root: int = 0, *, comm=None):
    """Return rank ``root``'s ``obj`` on every rank (collective).

    Args:
        obj: the object to send on ``root`` (any picklable object); ignored elsewhere.
        root: the rank that sends.
        comm: None, an ``mpidp.comm.Pool`` or an mpi4py communicator.

    Returns:
        ``obj`` itself on ``root``, an unpickled copy elsewhere.

    Raises:
        pickle.PicklingError: on every rank, if ``root``'s object cannot be pickled.
        pickle.UnpicklingError: on every rank, if a rank cannot unpickle it.
    """
    _comm._check_root(root, _comm._base(comm))
    mpi = _start(comm, "broadcast_object", root=root)
    is_root = mpi.Get_rank() == root
    data, error = _dumps(obj) if is_root else (None, None)
    nbytes, error = collective(mpi, "bcast", ((None if data is None else len(data), error), root),
                               "broadcast_object (its size)")
    if error is not None:
        raise pickle.PicklingError(f"broadcast_object: rank {root}'s object cannot be pickled: "
                                   f"{error}")
    buffer = data if is_root else bytearray(nbytes)
    collective(mpi, "Bcast", ([buffer, nbytes, MPI.BYTE], root), "broadcast_object")
    result, error = (obj, None) if is_root else _loads(buffer)
    _agreement.raise_together(mpi, error, pickle.UnpicklingError,
                              f"broadcast_object: rank {root}'s object cannot be unpickled on",
                              "broadcast_object (every rank unpickled it?)")
    return result


def allgather_object(obj, *, comm=None) -> list:
    """Return every rank's ``obj``, in rank order, on every rank (collective).

    Args:
        obj: this rank's object (any picklable object; sizes may differ by rank).
        comm: None, an ``mpidp.comm.Pool`` or an mpi4py communicator.

    Returns:
        A list with one entry per rank: this rank's own ``obj`` itself, unpickled
        copies of the others'.

    Raises:
        pickle.PicklingError: on every rank, if a rank's object cannot be pickled.
        pickle.UnpicklingError: on every rank, if a rank cannot unpickle another's.
    """
    mpi = _start(comm, "allgather_object")
    data, counts, offsets = _pickled_with_sizes(mpi, obj, "allgather_object")
    buffer = bytearray(offsets[-1])
    collective(mpi, "Allgatherv",
               ([data, len(data), MPI.BYTE], [buffer, (counts, offsets[:-1]), MPI.BYTE]),
               "allgather_object")
    results, error = _unpickled(buffer, offsets, mpi.Get_rank(), obj)
    _agreement.raise_together(mpi, error, pickle.UnpicklingError,
                              "allgather_object: an object cannot be unpickled on",
                              "allgather_object (every rank unpickled them?)")
    return results


def gather_object(obj, root: int = 0, *, comm=None) -> list | None:
    """Return every rank's ``obj``, in rank order, on rank ``root`` (collective).

    Only ``root`` receives the objects (``allgather_object`` gives them to every
    rank): for large objects that one rank writes out, such as each rank's profile.

    Args:
        obj: this rank's object (any picklable object; sizes may differ by rank).
        root: the rank that receives.
        comm: None, an ``mpidp.comm.Pool`` or an mpi4py communicator.

    Returns:
        On ``root``, a list with one entry per rank (its own ``obj`` itself,
        unpickled copies of the others'); None elsewhere.

    Raises:
        pickle.PicklingError: on every rank, if a rank's object cannot be pickled.
        pickle.UnpicklingError: on every rank, if ``root`` cannot unpickle one.
    """
    _comm._check_root(root, _comm._base(comm))
    mpi = _start(comm, "gather_object", root=root)
    data, counts, offsets = _pickled_with_sizes(mpi, obj, "gather_object")
    rank = mpi.Get_rank()
    buffer = bytearray(offsets[-1] if rank == root else 0)
    collective(mpi, "Gatherv",
               ([data, len(data), MPI.BYTE], [buffer, (counts, offsets[:-1]), MPI.BYTE], root),
               "gather_object")
    results, error = _unpickled(buffer, offsets, rank, obj) if rank == root else (None, None)
    _agreement.raise_together(mpi, error, pickle.UnpicklingError,
                              "gather_object: an object cannot be unpickled on",
                              "gather_object (the root unpickled them?)")
    return results


def _pickled_with_sizes(mpi, obj, what: str) -> tuple[bytes, list[int], list[int]]:
    """This rank's pickled ``obj``, every rank's byte count and the offsets (collective).

    Raises ``pickle.PicklingError`` on every rank if any rank's object cannot be pickled.
    """
    data, error = _dumps(obj)
    unpicklable = _failed(pickle.PicklingError, f"{what}: an object cannot be pickled on")
    headers = _agreement.decide(mpi, (None if data is None else len(data), error), unpicklable,
                                f"{what} (the sizes)")
    counts = [nbytes for nbytes, _ in headers]
    return data, counts, [0, *itertools.accumulate(counts)]


def _unpickled(buffer, offsets, rank: int, obj) -> tuple[list, str | None]:
    """Every rank's object from ``buffer`` (this rank's own ``obj`` itself), and the first
    failure to unpickle one, as text (None if all came)."""
    view, results, error = memoryview(buffer), [], None
    for peer, (start, end) in enumerate(zip(offsets, offsets[1:])):
        result, failure = (obj, None) if peer == rank else _loads(view[start:end])
        results.append(result)
        if failure is not None and error is None:
            error = f"rank {peer}'s object: {failure}"
    return results, error


def _number(value):
    """``value`` as a float, or a message saying why it is not a number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, numbers.Real):
        return float(value), None
    return None, f"{type(value).__name__}"


def _numbers(value) -> tuple[object, str | None]:
    """(float, dict or list of floats, None) or (None, what is wrong with ``value``)."""
    if isinstance(value, (list, tuple)):
        found = [_number(item) for item in value]
        wrong = [f"item {k} is a {kind}, not a number" for k, (_, kind) in enumerate(found)
                 if kind is not None]
        return (None, wrong[0]) if wrong else ([number for number, _ in found], None)
    if isinstance(value, dict):
        numbers_of = {}
        for key, item in value.items():
            number, kind = _number(item)
            if kind is not None:
                return None, f"value of {key!r} is a {kind}, not a number"
            numbers_of[key] = number
        return numbers_of, None
    number, kind = _number(value)
    if kind is not None:
        return None, f"value is a {kind}, not a number or a dict of numbers"
    return number, None


def average(value, *, comm=None):
    """Average a number, or each number of a dict, over the ranks (collective), for logging.

    The sum runs in rank order in float64 on every rank, so every rank gets the
    same result, bit for bit.

    A list (or tuple) of numbers on every rank averages all the numbers of all
    the ranks: they are added in rank order, each rank's in its list's order,
    and divided by how many there are. With each rank's per-micro-batch losses
    of ``DistributedDataParallel(reproducible=True)`` that is the micro-batch
    order, so the result is the same, bit for bit, at any number of ranks.

    Args:
        value: a real number (a Python or numpy number, or a one-element tensor),
            a dict of them, which must have the same keys on every rank (in any
            order), or a list of them (of any length on each rank).
        comm: None, an ``mpidp.comm.Pool`` or an mpi4py communicator.

    Returns:
        A float, or a dict of floats with this rank's key order.

    Raises:
        TypeError: on every rank, if a rank's value is not a number or a dict of numbers,
            or ranks mix numbers, dicts and lists.
        ValueError: on every rank, if the dicts' keys differ across ranks.
    """
    mpi = _start(comm, "average")
    local, error = _numbers(value)
    gathered = _agreement.decide(mpi, (local, error), _averageable, "average (allgather)")
    values = [local for local, _ in gathered]
    if isinstance(local, float):
        return sum(values) / len(values)  # builtin sum: left to right, in rank order
    if isinstance(local, list):
        every = [number for numbers_of in values for number in numbers_of]
        return sum(every) / len(every)
    return {key: sum(v[key] for v in values) / len(values) for key in local}


def _failed(kind: type, what: str):
    """The ``agreement.decide`` judge of facts ``(value, problem)``: ``kind`` naming each
    rank's problem, if any rank has one."""
    def judge(facts: list):
        problems = [problem for _, problem in facts]
        if any(problem is not None for problem in problems):
            return kind(f"{what} {_agreement.by_rank(problems)}")
        return None
    return judge


def _kind(value) -> str:
    return type(value).__name__.replace("float", "number")


def _averageable(facts: list):
    """``average``'s judge: every rank's value a number, or all lists, or dicts of one set of keys."""
    error = _failed(TypeError, "average:")(facts)
    if error is not None:
        return error
    kinds = [_kind(value) for value, _ in facts]
    if kinds.count(kinds[0]) != len(kinds):
        return TypeError(f"average: ranks mix numbers and dicts: {_agreement.by_rank(kinds)}")
    if kinds[0] == "list" and not any(value for value, _ in facts):
        return ValueError("average: every rank's list is empty; there is nothing to average")
    if kinds[0] != "dict":
        return None
    keys = [sorted(map(repr, value)) for value, _ in facts]
    if keys.count(keys[0]) != len(keys):
        described = [f"keys {', '.join(k)}" for k in keys]
        return ValueError(f"average: the dicts' keys differ across ranks: "
                          f"{_agreement.by_rank(described)}; every rank must report the same keys")
    return None
