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


class _Receive:
    """A receive request that fills a status, so the message size can be checked."""

    __slots__ = ("request", "status", "tensor")

    def __init__(self, request, tensor):
        self.request = request
        self.status = MPI.Status()
        self.tensor = tensor

    def Wait(self):
        return self._run(self.request.Wait)

    def Test(self):
        return self._run(self.request.Test)

    def _run(self, call):
        try:
            return call(self.status)
        except MPI.Exception as err:
            raise ValueError(self._mismatch("more")) from err

    def check_count(self):
        count = self.status.Get_count(_buffer(self.tensor)[2])
        if count != self.tensor.numel():
            raise ValueError(self._mismatch(count))

    def _mismatch(self, count):
        return (f"recv: tensor has {self.tensor.numel()} elements of {self.tensor.dtype}, "
                f"rank {self.status.Get_source()} sent {count}; sizes must match")


def _irecv(tensor, source, tag, comm) -> tuple[Handle, _Receive]:
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
    receive = _Receive(comm.Irecv(_buffer(staged), source, tag), tensor)
    label = ("recv", tensor, "source", "any" if source == MPI.ANY_SOURCE else source)
    finish = _chain(receive.check_count, copy_back)
    return Handle(receive, (tensor, staged), tensor, finish, label), receive


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
    handle, receive = _irecv(tensor, source, tag, comm)
    handle.wait()
    return receive.status.Get_source()


def irecv(tensor: torch.Tensor, source: int | None = None, tag: int | None = None, *,
          comm=None) -> Handle:
    """Start receiving into ``tensor``; ``wait()`` returns ``tensor`` and checks the size."""
    return _irecv(tensor, source, tag, comm)[0]
