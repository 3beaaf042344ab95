"""``Handle``: a pending nonblocking operation, and ``_start``, which runs one blocking or not."""

from __future__ import annotations

from mpi4py import MPI

from .. import errors as _errors
from .. import watchdog as _watchdog

__all__ = ["Handle"]

# Handles whose MPI request is in flight; holding them here keeps their tensors
# alive even if the caller drops the handle without waiting.
_in_flight: set = set()


class Handle:
    """A pending nonblocking operation that owns its tensors until it completes.

    ``wait()`` blocks and returns the result (the output tensor; see each
    ``i``-function); ``is_completed()`` tests without blocking (and drives MPI
    progress).
    """

    __slots__ = ("_request", "_tensors", "_finish", "_result", "_label", "_scope", "__weakref__")

    def __init__(self, request, tensors, result, finish=None, label=None):
        self._request = request
        self._tensors = tensors
        self._result = result
        self._finish = finish
        self._label = label  # what wait() waits in, for stall reports (mpidp.watchdog)
        self._scope = _watchdog.context()
        _in_flight.add(self)

    def wait(self):
        """Block until the operation completes; return its result."""
        if self._request is not None:
            slot = _watchdog.begin(self._label, self._scope, True)
            try:
                self._settle(self._request.Wait)
            finally:
                slot.current = None
        return self._result

    def is_completed(self) -> bool:
        """Return True once the operation has completed, without blocking."""
        return self._request is None or self._settle(self._request.Test)

    def _settle(self, call) -> bool:
        try:
            done = call()
        except MPI.Exception as error:
            label = self._label
            self._release()
            raise _errors.mpi_failure(_watchdog._label_text(label), error) from error
        except BaseException:
            self._release()
            raise
        if done is False:
            return False
        finish = self._finish
        self._release()
        if finish is not None:
            finish()
        return True

    def _release(self):
        self._request = self._finish = self._tensors = None
        _in_flight.discard(self)


def _start(comm: MPI.Intracomm, name: str, args, keep, result, finish, nonblocking: bool,
           label=None):
    """Run MPI collective ``name`` (blocking) or its ``I``-form, returning tensor or Handle.

    ``label`` names the call in stall reports (``mpidp.watchdog``), built only then.
    """
    if nonblocking:
        try:
            request = getattr(comm, "I" + name.lower())(*args)
        except MPI.Exception as error:
            raise _errors.mpi_failure(_watchdog._label_text(label), error) from error
        return Handle(request, keep, result, finish, label)
    slot = _watchdog.begin(label)
    try:
        getattr(comm, name)(*args)
    except MPI.Exception as error:
        raise _errors.mpi_failure(_watchdog._label_text(label), error) from error
    finally:
        slot.current = None
    if finish is not None:
        finish()
    return result
