"""mpidp's own exceptions: what failed, on which call, and what to do next."""

from __future__ import annotations

__all__ = ["CommunicationError", "RankLostError", "mpi_failure", "lost_rank"]


class CommunicationError(RuntimeError):
    """An MPI call made by mpidp failed; the message names the call and MPI's error."""


class RankLostError(CommunicationError):
    """A rank of the job was lost (ULFM's ``MPI_ERR_PROC_FAILED``, or a communicator revoked
    after one was): ``mpidp.Healer`` goes on without it; otherwise the job ends."""


def _failure_classes() -> set[int]:
    """The MPI error classes that mean a lost rank (none where the library has no ULFM)."""
    from mpi4py import MPI  # noqa: PLC0415 (MPI raised the error: it is imported already)

    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    # Without ULFM, mpi4py gives these names MPI_ERR_UNKNOWN's value (MPICH 5.0): no match.
    return {getattr(MPI, name) for name in names if hasattr(MPI, name)} - {MPI.ERR_UNKNOWN}


def _mpi_class(error: BaseException) -> int | None:
    get = getattr(error, "Get_error_class", None)
    try:
        return get() if callable(get) else None
    except Exception:  # noqa: BLE001 (a class-less error is simply not a lost rank)
        return None


def lost_rank(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from or during, says a rank was lost.

    It does when it is a ``RankLostError`` or an MPI error of a failure class, and also when
    it is an MPI error of another class while a member of mpidp's world is known to have
    failed (ULFM's ``MPI_Comm_get_failed``): a call on a communicator that lost a member
    does not always fail with a failure class. Open MPI 5.0.11's ``MPI_Barrier`` in the
    shared-memory reduction's fence returned ``MPI_ERR_OTHER`` on the killed rank's
    neighbour, with the failure already known (tests/test_healing.py kills a rank there).
    """
    seen, from_mpi = set(), False
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error_class = _mpi_class(error)
        if isinstance(error, RankLostError) or error_class in _failure_classes():
            return True
        from_mpi = from_mpi or error_class is not None
        error = error.__cause__ or error.__context__
    return from_mpi and _world_lost_a_member()


_survivors: list = []  # the world after a heal, told by mpidp.runtime.set_world


def judge_losses_over(comm) -> None:
    """Judge later errors by the failed members of ``comm``, the survivors of a heal
    (``mpidp.runtime.set_world`` only; before any heal, ``MPI_COMM_WORLD``)."""
    _survivors[:] = [comm]


def _world_lost_a_member() -> bool:
    """Whether this rank knows of a failed member of mpidp's world (ULFM only).

    The world, not ``MPI_COMM_WORLD``: after a heal, the ranks already lost are no
    longer members, so a later error is judged by new losses alone.
    """
    if not _failure_classes():
        return False
    from mpi4py import MPI  # noqa: PLC0415

    try:
        failed = (_survivors[0] if _survivors else MPI.COMM_WORLD).Get_failed()
    except Exception:  # noqa: BLE001 (no failed group to read: nothing known lost)
        return False
    try:
        return failed.Get_size() > 0
    finally:
        failed.Free()


def _lost_ranks() -> str:
    """The ranks of ``MPI_COMM_WORLD`` this rank knows have failed, as text (ULFM only)."""
    from mpi4py import MPI  # noqa: PLC0415

    try:
        world = MPI.COMM_WORLD
        failed = world.Get_failed()
        ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), world.Get_group())
        failed.Free()
    except Exception:  # noqa: BLE001 (the names are a courtesy; the error stands without them)
        return "the library did not say which"
    return f"rank(s) {sorted(ranks)} of MPI_COMM_WORLD" if ranks else "not yet known which"


def mpi_failure(call: str, error: BaseException) -> CommunicationError:
    """The error to raise when MPI fails ``call`` (a description such as the watchdog's label).

    A lost rank (ULFM) becomes a ``RankLostError`` naming it. Otherwise, the
    usual cause of an MPI error inside a collective is ranks that disagree
    about the call (element count, dtype, op, root or order); MPI notices only
    some of these, on some ranks, so the message points to the check that
    compares every rank's call.
    """
    text = str(error).strip() or type(error).__name__
    if lost_rank(error):
        return RankLostError(
            f"mpidp: a rank of the job was lost during {call} ({text}; lost: {_lost_ranks()}). "
            f"mpidp.Healer goes on without it where the MPI library has ULFM "
            f"(docs/healing.md); otherwise resume from the last checkpoint")
    return CommunicationError(
        f"mpidp: the MPI library failed in {call}: {text}. The ranks' calls probably differ "
        f"(element count, dtype, op, root or the order of collectives); run again with "
        f"MPIDP_DEBUG=1 to have every collective compared across ranks before it runs")
