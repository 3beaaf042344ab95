"""Point-to-point messages: send, recv and their nonblocking forms.

Messages to oneself are refused, as in torch.distributed: MPI_Send to one's own
rank blocks once the message outgrows the library's eager buffer.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from .. import _args
from .checks import _check_tensor
from .dtypes import _buffer
from .handle import Handle
from .pool import _base, _p2p_comm
from .staging import _chain, _stage

__all__ = ["send", "recv", "isend", "irecv"]


def _check_peer(name: str, peer, comm: MPI.Intracomm) -> None:
    _args.check_rank(name, peer, comm.Get_size())
    if peer == comm.Get_rank():
        raise ValueError(f"invalid {name} {peer}, {name} should be another rank than this "
                         f"process's own: mpidp refuses messages to oneself (MPI's send to self "
                         f"blocks once the message outgrows the library's eager buffer)")


def _check_tag(tag) -> None:
    _args.check_int("tag", tag, minimum=0)


def send(tensor: torch.Tensor, dest: int, tag: int = 0, *, comm=None) -> None:
    """Send ``tensor`` to rank ``dest`` (not this rank), blocking until the buffer may be reused."""
    isend(tensor, dest, tag, comm=comm).wait()


def isend(tensor: torch.Tensor, dest: int, tag: int = 0, *, comm=None) -> Handle:
    """Start sending ``tensor`` to rank ``dest``; the handle keeps ``tensor`` alive."""
    _check_tensor("tensor", tensor)
    _check_peer("dest", dest, _base(comm))
    _check_tag(tag)
    comm = _p2p_comm(comm)
    (staged,), _, _ = _stage((tensor,), ())
    return Handle(comm.Isend(_buffer(staged), dest, tag), (tensor, staged), tensor,
                  label=("send", tensor, "dest", dest, "tag", tag))


class _Receive(Handle):
    """A receive: its request fills a status, so the sender and the message size can be checked."""

    __slots__ = ()

    def _failed(self, error: MPI.Exception) -> BaseException:
        tensor, status = self._result, self._status
        self._release()
        return ValueError(_mismatch(tensor, status, "more"))

    def check_count(self) -> None:
        tensor = self._result
        count = self._status.Get_count(_buffer(tensor)[2])
        if count != tensor.numel():
            raise ValueError(_mismatch(tensor, self._status, count))


def _mismatch(tensor, status, count) -> str:
    return (f"recv: tensor has {tensor.numel()} elements of {tensor.dtype}, "
            f"rank {status.Get_source()} sent {count}; sizes must match")


def _irecv(tensor, source, tag, comm) -> tuple[Handle, MPI.Status]:
    _check_tensor("tensor", tensor, written=True)
    base = _base(comm)
    if source is not None:
        _check_peer("source", source, base)
    elif base.Get_size() == 1:
        raise ValueError("recv from any source (source=None) needs another rank, but comm has "
                         "1 rank and mpidp refuses messages to oneself")
    if tag is not None:
        _check_tag(tag)
    comm = _p2p_comm(comm)
    source = MPI.ANY_SOURCE if source is None else source
    tag = MPI.ANY_TAG if tag is None else tag
    _, (staged,), copy_back = _stage((), (tensor,))
    label = ("recv", tensor, "source", "any" if source == MPI.ANY_SOURCE else source)
    receive = _Receive(comm.Irecv(_buffer(staged), source, tag), (tensor, staged), tensor,
                       label=label, status=MPI.Status())
    receive._finish = _chain(receive.check_count, copy_back)
    return receive, receive._status


def recv(tensor: torch.Tensor, source: int | None = None, tag: int | None = None, *,
         comm=None) -> int:
    """Receive into ``tensor`` from ``source`` (None: any rank).

    Args:
        tensor: receives the message, which must have exactly its size.
        source: rank to receive from (not this rank), or None for any other.
        tag: message tag, or None for any.
        comm: None, a ``Pool`` or an mpi4py communicator.

    Returns:
        The rank the message came from.
    """
    handle, status = _irecv(tensor, source, tag, comm)
    handle.wait()
    return status.Get_source()


def irecv(tensor: torch.Tensor, source: int | None = None, tag: int | None = None, *,
          comm=None) -> Handle:
    """Start receiving into ``tensor``; ``wait()`` returns ``tensor`` and checks the size."""
    return _irecv(tensor, source, tag, comm)[0]
