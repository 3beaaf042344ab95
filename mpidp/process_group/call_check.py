"""The backend's call check: every rank's fingerprint of an operation, allreduced beside it.

A torch.distributed call of the backend ``"mpidp"`` that differs across ranks (another
size, dtype, op or root) would give a wrong result or hang; its fingerprint
(``mpidp.comm.checks``) is allreduced with MAX right after the operation starts, so every
rank learns what differs and raises the same ``CallMismatch``. Rules cited by number are
docs/concurrency.md's.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from .. import comm as _comm
from ..comm import checks as _checks
from ..comm import handle as _handle
from ..comm.operation import Operation

__all__ = ["CallCheck", "CallMismatch"]


class CallMismatch(ValueError):
    """Ranks made a collective call that differs (raised alike on every rank)."""


class CallCheck(Operation):
    """The fingerprint of an operation, allreduced with MAX beside it: an engine operation.

    Started on the calling thread right after the operation, on the same pool, so every
    rank starts both in the same order (rule 2); an operation that raised on this rank
    before it started (its arguments) took no pool member and starts no check. It
    completes as soon as every rank has started it, whatever the operation does, so a
    Work tests it first. Then ``error()`` is the same on every rank: None, or the
    ValueError that names what differs. An Iallreduce of 10 int64
    (``mpidp.comm.handle.issue``), tested with the operation's own in one ``MPI_Testall``
    (``mpidp.process_group.work.checked_wait``); its cost is in bench/check_cost.py
    (MPIDP_CHECK_CALLS=0 drops it). ``spoils(what)``: the group's, where the operation
    started beside the check (it spoils the group's communicators on a mismatch).
    """

    __slots__ = ("call", "reduced", "_own", "_spoils")

    def __init__(self, call: str, tensor: torch.Tensor, op: str | None, root: int, pool,
                 spoils=None):
        self.call = call
        self._spoils = spoils  # told what differs where the operation started beside the check
        self._own = _checks._fingerprint_bytes(call, tensor.numel(), tensor.dtype, op, root)
        self.reduced = np.frombuffer(bytearray(self._own), np.int64)
        label = (call + " (its call check)", tensor)  # formatted only in a report
        comm = _comm._collective_comm(pool)
        request, ticket = _handle.issue_recorded(
            comm, "Allreduce", (MPI.IN_PLACE, [self.reduced, MPI.INT64_T], MPI.MAX), label,
            ("call check", 10, "int64", (), call))
        # no watchdog scope: the operation's own label says it all
        super().__init__(request, self.reduced, self.reduced, label=label, scope=None,
                         ticket=ticket)

    @property
    def handle(self) -> CallCheck:
        """The operation a Work tests and waits on: the check itself."""
        return self

    def error(self) -> CallMismatch | None:
        problem = _checks.fingerprint_problem(self.reduced, self._own)
        if problem is not None and self._spoils is not None:
            self._spoils(f"{self.call}: {problem}")
        return None if problem is None else CallMismatch(f"{self.call}: {problem}")
