"""``hvd.join()``: a rank out of data serves the others' collectives until every rank joins.

The joined rank answers each control message of the global process set (see
``negotiation``) with the matching collective: zeros to an allreduce or a
reducescatter (the identity of min, max or product to those), and the barrier.
Its inputs live on the CPU, or on ``device`` if given. ``Average`` still
divides by the size of the set, as Horovod does, so joined ranks count as
zeros. What Horovod refuses while a rank is joined (allgather, broadcast,
alltoall, the object collectives), and calls that differ between the active
ranks, fail on the active ranks only: the joined rank goes on waiting.
"""

from __future__ import annotations

import torch

from .. import _args
from .. import comm as _comm
from . import process_sets as _sets
from . import negotiation as _negotiation
from .reductions import process_set_of
from .scatter import launch_reducescatter

__all__ = ["join"]

_OPS = {code: op for op, code in _negotiation.OP_CODES.items()}


def _identity(shape, dtype: torch.dtype, op: str, device) -> torch.Tensor:
    if op == "sum":
        return torch.zeros(shape, dtype=dtype, device=device)
    if op == "prod":
        return torch.ones(shape, dtype=dtype, device=device)
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return torch.full(shape, info.max if op == "min" else info.min, dtype=dtype, device=device)


def _serve(message: _negotiation.Descriptor, process_set, device) -> None:
    comm = process_set.data
    kind = message.kind
    if kind == _negotiation.ALLREDUCE and _OPS[message.op] != "adasum":  # Adasum: refused
        _comm.iallreduce(_identity(message.shape, message.dtype, _OPS[message.op], device),
                         _OPS[message.op], comm=comm).wait()
    elif kind == _negotiation.REDUCESCATTER:
        zeros = torch.zeros(message.shape, dtype=message.dtype, device=device)
        for handle in launch_reducescatter(zeros, message.shape[0], process_set)[0]:
            handle.wait()
    elif kind == _negotiation.BARRIER:
        _comm.ibarrier(comm=comm).wait()
    # else the active ranks raise (requests.REFUSED_IN_JOIN) and start nothing


def join(device: int = -1) -> int:
    """Serve the other ranks' collectives until every rank has called ``join`` (collective).

    Args:
        device: the CUDA device for the inputs a joined rank contributes, or -1 for the CPU.

    Returns:
        The rank that joined last.

    The active ranks' collectives that a joined rank cannot serve (allgather, broadcast,
    alltoall, the object collectives) raise ``HorovodInternalError`` on the active ranks,
    as in Horovod; this rank goes on waiting.
    """
    _args.check_int("device", device, minimum=-1)
    process_set = process_set_of(_sets.global_process_set)
    where = torch.device("cpu") if device < 0 else torch.device("cuda", device)
    first = True
    while True:
        with process_set.lock:
            control = _negotiation.Control(process_set, _negotiation.control_message(
                process_set, _negotiation.JOIN, joined=True, new=first), _negotiation.JOIN)
        first = False
        message = control.message()
        if not message.active and not message.waiting:
            return max(message.new)
        if message.problem:  # a rank's arguments failed: the active ranks raise, this one waits
            _negotiation.dispute(process_set, message.kind, None)
            continue
        if message.exchange:  # the calls differ, or a rank waits for a name (names.py)
            with process_set.lock:
                verdict = _negotiation.exchange(process_set, message, message.kind, joined=True)
            if not verdict.agreed:
                continue
        _serve(message, process_set, where)
