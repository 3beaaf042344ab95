"""Every rank reaches the same decision: one rule for checks that span ranks.

A check that one rank fails must end in the same error on every rank, never
in an error on one rank while the others walk into the next collective and
wait forever. The rule: each rank computes its own verdict (an error or
None), one 4-byte allreduce says whether any rank failed, and only then do
the messages travel, so the usual case costs one small allreduce (docs/performance-comm.md, "Figures
behind the code's choices"). Every call here is a collective on ``comm``,
started through the engine (``handle.collective``: recorded by the stall
watchdog under ``label``, its MPI errors mapped, driven on the progress thread).
"""

from __future__ import annotations

import array

import numpy as np

from mpi4py import MPI

from .. import watchdog as _watchdog
from .handle import collective
from .pool import _collective_comm

__all__ = ["agree", "agree_facts", "all_equal", "any_failed", "by_rank", "decide", "decide_alike",
           "decide_rows", "extremes", "gather_rows", "judged", "raise_gathered", "raise_together",
           "survivors_agree", "watched_allgather"]


def watched_allgather(comm: MPI.Intracomm, obj, label: str) -> list:
    """``comm.allgather(obj)``, named ``label`` in the stall watchdog's reports."""
    return collective(comm, "allgather", (obj,), label)


def decide(comm: MPI.Intracomm, fact, judge, label: str) -> list:
    """Gather every rank's ``fact``, then run ``judge(facts)`` on every rank; raise what it returns.

    The agreement in its general form: ``judge`` sees the same list on every rank and
    must decide from it alone (never from this rank's own state), so every rank
    returns the facts, or raises the same exception. Use it where the facts are
    needed anyway; ``agree``/``raise_together``/``agree_facts`` send less when only
    a verdict is.
    """
    facts, error = judged(comm, fact, judge, label)
    if error is not None:
        raise error
    return facts


def judged(comm: MPI.Intracomm, fact, judge, label: str) -> tuple[list, object]:
    """``decide`` that hands back its verdict instead of raising it: every rank's facts and
    ``judge(facts)``, the same on every rank.

    The verdict is an error or None, or a choice every rank then acts on alike (a root,
    a step to go back to, the operations that start); ``judge`` reads the facts alone.
    For a caller that must act on the facts before it raises (line a counter up), whose
    own rank has raised its own error already, or that acts on a choice.
    """
    facts = watched_allgather(comm, fact, label)
    return facts, judge(facts)


def decide_alike(comm: MPI.Intracomm, summary, details, judge, label: str) -> list:
    """Every rank's ``summary``; where they differ, ``judge(every rank's details())`` raised
    on every rank.

    ``decide`` for facts too large to send each time: the summaries (small and
    comparable: a digest) travel always, ``details()`` only when they differ, and
    ``judge`` may then return None (the difference is allowed) or the error.
    """
    summaries = watched_allgather(comm, summary, label)
    if any(entry != summaries[0] for entry in summaries):  # the same list on every rank
        decide(comm, details(), judge, f"{label} (the details)")
    return summaries


def any_failed(comm: MPI.Intracomm, failed: bool, label: str) -> bool:
    """True on every rank if ``failed`` is true on any (one 4-byte allreduce)."""
    flag = array.array("i", [bool(failed)])
    collective(comm, "Allreduce", (MPI.IN_PLACE, [flag, MPI.INT], MPI.MAX), label)
    return bool(flag[0])


def survivors_agree(comm: MPI.Intracomm, ok: bool, label: str) -> bool:
    """True on every surviving rank if ``ok`` is true on all of them (ULFM's ``MPI_Comm_agree``).

    The one agreement that works on a communicator with a lost rank, revoked or not:
    the failures this rank knows of are acknowledged first. A failure it did not know of
    yet (a rank that failed out of a revoked communicator may not have seen the loss
    itself) makes the agreement raise ``MPI_ERR_PROC_FAILED``, on every survivor alike
    (ULFM's agreement is uniform, its error included; seen on all 3 survivors of 4): then
    every survivor acknowledges it and agrees again. Needs an MPI library with ULFM
    (``mpidp.healing``).
    """
    for _ in range(comm.Get_size()):  # each retry acknowledges at least one more failure
        comm.Ack_failed()
        try:
            return bool(_watchdog.watched(label, comm.Agree, int(bool(ok))))
        except MPI.Exception as error:
            if error.Get_error_class() != MPI.ERR_PROC_FAILED:
                raise
    raise RuntimeError(f"{label}: MPI_Comm_agree kept raising MPI_ERR_PROC_FAILED after "
                       f"{comm.Get_size()} acknowledgements")


def by_rank(entries: list) -> str:
    """'rank 1: X; ranks 0, 2-3: Y' for the entries that are not None, equal ones folded."""
    ranks_of: dict[str, list[int]] = {}
    for rank, entry in enumerate(entries):
        if entry is not None:
            ranks_of.setdefault(entry, []).append(rank)
    return "; ".join(f"{_watchdog._ranks(ranks)}: {entry}" for entry, ranks in ranks_of.items())


def raise_together(comm: MPI.Intracomm, problem: str | None, kind: type, what: str,
                   label: str | None = None) -> None:
    """Raise ``kind(f"{what} {by_rank(problems)}")`` on every rank if any rank has a ``problem``."""
    label = label or f"{what.rstrip(':')} (do all ranks agree?)"
    if any_failed(comm, problem is not None, label):
        raise_gathered(comm, problem, kind, what, label)


def raise_gathered(comm: MPI.Intracomm, problem: str | None, kind: type, what: str,
                   label: str) -> None:
    """The second half of ``raise_together``, where every rank already knows that some rank
    failed (a flag that rode on a collective the check needed anyway): gather the problems
    and raise ``kind(f"{what} {by_rank(problems)}")`` on every rank."""
    raise kind(f"{what} {by_rank(watched_allgather(comm, problem, label))}")


def agree(comm: MPI.Intracomm, error: BaseException | None, label: str) -> None:
    """Raise on every rank if ``error`` is set on any: the lowest failing rank's, with its type.

    The type that travels is the nearest built-in one (a class of the user's
    may not unpickle elsewhere), and the message names the original type
    where they differ; ranks that did not fail raise it ``from`` nothing.
    """
    if not any_failed(comm, error is not None, label):
        return
    report = None
    if error is not None:
        kind = next(k for k in type(error).__mro__ if k.__module__ == "builtins")
        prefix = "" if kind is type(error) else f"{type(error).__name__}: "
        report = (kind, prefix + str(error))
    reports = watched_allgather(comm, report, label)
    failed_ranks = [rank for rank, entry in enumerate(reports) if entry is not None]
    kind, message = reports[failed_ranks[0]]
    if len(failed_ranks) < len(reports):
        message += f" (found on rank(s) {failed_ranks})"
    try:
        agreed = kind(message)
    except Exception:  # a built-in type that wants more arguments (UnicodeDecodeError...)
        agreed = RuntimeError(f"{kind.__name__}: {message}")
    raise agreed from error


def agree_facts(comm, facts: list[int], problem: bool, describe, what: str, label: str) -> None:
    """Raise ``ValueError(what + each rank's describe())`` on every rank unless all ranks'
    ``facts`` are equal and no rank has a ``problem``.

    One allreduce of the maxima of the facts and of their negatives, on the
    communicator a pool would hand the next collective (all ranks take the
    same one); the descriptions travel only when something differs.
    """
    both = extremes([*facts, int(problem)])
    base = _collective_comm(comm)
    collective(base, "Allreduce", (MPI.IN_PLACE, both, MPI.MAX), label)
    if all_equal(both) and not both[len(facts)]:
        return
    raise ValueError(f"{what} "
                     f"{by_rank(watched_allgather(base, describe(), label))}")


# -- the fixed-size forms: checks that the progress thread may run -----------------------------
# The forms above gather pickled objects, whose size a rank learns only from the message, and
# mpi4py's pickled collectives block: they run on program threads only. A check that the
# progress thread may run (docs/concurrency.md, rule 3: the MPIDP_DEBUG call check, alltoall's
# splits, allgatherv's shapes, the backend's call check) uses these: numpy rows of one length
# and dtype on every rank, each step a handle.collective (driven there, never waited on). The
# policy is the same: gather, then every rank judges the same table.

_ROW_TYPES = {np.dtype(np.uint8): MPI.BYTE, np.dtype(np.int64): MPI.INT64_T}


def extremes(values) -> np.ndarray:
    """``values`` and their negatives, as int64: allreduced with MAX, they give every rank each
    value's largest and smallest over the ranks (``all_equal`` reads them)."""
    values = np.asarray(values, dtype=np.int64)
    return np.concatenate([values, -values])


def all_equal(reduced: np.ndarray) -> bool:
    """Whether every rank held the same values, from ``extremes`` allreduced with MAX."""
    half = len(reduced) // 2
    return bool(np.array_equal(reduced[:half], -reduced[half:]))


def gather_rows(comm: MPI.Intracomm, row: np.ndarray, label) -> np.ndarray:
    """Every rank's ``row`` (one length and dtype, uint8 or int64, on every rank) as a table."""
    table = np.empty((comm.Get_size(), row.size), dtype=row.dtype)
    kind = _ROW_TYPES[row.dtype]
    collective(comm, "Allgather", ([row, kind], [table, kind]), label)
    return table


def decide_rows(comm: MPI.Intracomm, row: np.ndarray, judge, label) -> np.ndarray:
    """``decide`` in fixed-size form: gather every rank's ``row``, then raise what
    ``judge(table)`` returns on every rank (it must read the table alone); return the table."""
    table = gather_rows(comm, row, label)
    error = judge(table)
    if error is not None:
        raise error
    return table
