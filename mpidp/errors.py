"""mpidp's own exceptions: what failed, on which call, and what to do next."""

from __future__ import annotations

__all__ = ["CommunicationError", "mpi_failure"]


class CommunicationError(RuntimeError):
    """An MPI call made by mpidp failed; the message names the call and MPI's error."""


def mpi_failure(call: str, error: BaseException) -> CommunicationError:
    """The error to raise when MPI fails ``call`` (a description such as the watchdog's label).

    The usual cause of an MPI error inside a collective is ranks that disagree
    about the call (element count, dtype, op, root or order); MPI notices only
    some of these, on some ranks, so the message points to the check that
    compares every rank's call.
    """
    text = str(error).strip() or type(error).__name__
    return CommunicationError(
        f"mpidp: the MPI library failed in {call}: {text}. The ranks' calls probably differ "
        f"(element count, dtype, op, root or the order of collectives); run again with "
        f"MPIDP_DEBUG=1 to have every collective compared across ranks before it runs")
