"""torch's FSDP2 (``fully_shard``) over ``"mpidp"`` under a heal: partner copies of the shards.

FSDP2 leaves each rank the only copy of its shard of every parameter and of the
optimizer state kept for it, so a lost rank's would go with it. Where a
``mpidp.Healer`` can heal, ``Shards`` keeps them twice, as ZeRO stage 1 does
(``mpidp.zero.partner``): at the start of every step (``Healer.guard()``) each
rank copies its own shards, and sends them to the next rank (mod N), which keeps
them as the partner copy of its previous rank. One message each way per step,
of about 1/N of the model and optimizer state; the Healer keeps the copies of
the last two step starts.

FSDP2's sharding is fixed when ``fully_shard`` runs (its parameter groups, its
mesh and process group, each parameter's padded shard), and torch has no call
that shards a module again over another group. So a heal does what a resume at
the new size does: the survivors put together the whole state of the step they
go back to (their own shards and the lost ranks' partner copies), the program's
``rebuild`` makes a new model and optimizer over the new default group, and
torch's ``set_model_state_dict`` and ``set_optimizer_state_dict`` load the
whole state into them (``full_state_dict=True``: each rank keeps its new shard).

What can follow (``problem``): every parameter a ``DTensor`` sharded along dim 0
(``Shard(0)``, FSDP2's default) over a 1-D mesh whose group is the default group of
``"mpidp"`` (``fully_shard`` without ``mesh`` makes that one), and an optimizer that
steps the model's parameters and nothing else.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import comm as _comm
from . import healing as _groups

__all__ = ["Shards", "is_fsdp", "is_sharded", "problem", "whole_state", "full_state", "mismatch",
           "load"]

_TAG = 7  # the partner copy's messages on the Healer's communicator
_c10d = dist.distributed_c10d


def is_fsdp(model) -> bool:
    """Whether ``model`` is torch's FSDP2 module (without importing FSDP where nobody did)."""
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def is_sharded(model) -> bool:
    """Whether ``model`` holds DTensor parameters (FSDP2's shards, its root sharded or only
    inner modules): its ``state_dict()`` is then this rank's part alone (local)."""
    import sys

    if is_fsdp(model):
        return True
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and any(isinstance(p, tensor.DTensor) for p in model.parameters())


def problem(model, optimizer) -> str | None:
    """Why ``model`` (FSDP2) and ``optimizer`` cannot follow a heal; None: they can (local)."""
    from torch.distributed.tensor import DTensor, Shard

    default = _c10d._world.default_pg if dist.is_initialized() else None
    params = dict(model.named_parameters())
    for name, param in params.items():
        if not isinstance(param, DTensor):
            return f"FSDP2's parameter {name} is a {type(param).__name__}, not a DTensor"
        mesh = param.device_mesh
        if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
            return (f"FSDP2's parameter {name} must be sharded along dim 0 over a 1-D mesh "
                    f"(Shard(0)) to follow a heal, got placements {tuple(param.placements)} "
                    f"over a mesh of shape {tuple(mesh.shape)}")
        group = mesh.get_group()
        if group is not default or not _groups._is_ours(group):
            return (f"FSDP2 follows a heal over the default group of \"mpidp\" only (fully_shard "
                    f"without mesh=), got parameter {name} over {group!r}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
    stepped = [id(p) for group in optimizer.param_groups for p in group["params"]]
    if sorted(stepped) != sorted(id(p) for p in params.values()):
        return ("the optimizer must step the FSDP2 model's parameters, each once, and no "
                "other tensor: a lost rank's shards are rebuilt by parameter name")
    return None


def _rows(rows: int, size: int, rank: int) -> int:
    """Rank ``rank``'s rows of ``rows`` cut in ``size`` (torch.chunk's rule, as FSDP2 cuts)."""
    each = -(-rows // size)
    return max(0, min(each, rows - rank * each))


class Shards:
    """This rank's FSDP2 shards of ``model`` and ``optimizer``, copied at a step's start, and
    the previous rank's, received.

    A copy (``capture``) is a dict: ``layout`` (each sharded tensor's parameter name, its
    optimizer state key or None, whole shape and dtype), ``mine`` (this rank's shards,
    bytes end to end), ``theirs`` (rank r - 1's, after ``exchange``; None before or at one
    rank), ``size`` (the ranks they were cut for), and what every rank holds whole: the
    buffers, the optimizer state that is not sharded (Adam's ``step``) and its groups.
    """

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self._free: torch.Tensor | None = None  # a dropped copy's ``theirs``, to receive into

    def _tensors(self):
        """(name, state key or None, DTensor) of every sharded tensor, in one order."""
        from torch.distributed.tensor import DTensor

        for name, param in self.model.named_parameters():
            yield name, None, param
            state = self.optimizer.state.get(param, {})
            for key in sorted(state):
                if isinstance(state[key], DTensor):
                    yield name, key, state[key]

    @torch.no_grad()
    def capture(self, size: int, last: dict | None = None) -> dict:
        """This rank's shards and whole parts now, copied (into ``last``'s memory where it
        fits; local)."""
        from torch.distributed.tensor import DTensor

        tensors = list(self._tensors())
        layout = [(name, key, tuple(t.shape), t.dtype) for name, key, t in tensors]
        parts = [t.to_local().reshape(-1).view(torch.uint8) for *_, t in tensors]
        total = sum(part.numel() for part in parts)
        mine = last["mine"] if last is not None and last["mine"].numel() == total else None
        mine = torch.cat(parts, out=mine) if mine is not None else torch.cat(parts)
        self._free = None if last is None else last["theirs"]
        name_of = {id(p): name for name, p in self.model.named_parameters()}
        whole = {name_of[id(p)]: {key: value.detach().clone() if isinstance(value, torch.Tensor)
                                  else copy.deepcopy(value)
                                  for key, value in state.items() if not isinstance(value, DTensor)}
                 for p, state in self.optimizer.state.items()}
        groups = [dict({key: copy.deepcopy(value) for key, value in group.items()
                        if key != "params"}, params=[name_of[id(p)] for p in group["params"]])
                  for group in self.optimizer.param_groups]
        buffers = {name: value.detach().clone() for name, value in self.model.state_dict().items()
                   if not isinstance(value, DTensor)}
        return dict(layout=layout, mine=mine, theirs=None, size=size, whole=whole, groups=groups,
                    buffers=buffers)

    def exchange(self, comm: MPI.Intracomm, copy_: dict) -> None:
        """Send ``copy_``'s shards to the next rank, receive the previous rank's into it
        (collective over ``comm``: every rank at once, one message each way)."""
        size, rank = comm.Get_size(), comm.Get_rank()
        if size == 1:
            return
        before = (rank - 1) % size
        count = _bytes(copy_["layout"], size, before)
        theirs, self._free = self._free, None
        if theirs is None or theirs.numel() != count:
            theirs = torch.empty(count, dtype=torch.uint8, device=copy_["mine"].device)
        receive = _comm.irecv(theirs, before, _TAG, comm=comm)
        send = _comm.isend(copy_["mine"], (rank + 1) % size, _TAG, comm=comm)
        receive.wait()
        send.wait()
        copy_["theirs"] = theirs


def _bytes(layout, size: int, rank: int) -> int:
    return sum(_rows(shape[0], size, rank) * math.prod(shape[1:]) * dtype.itemsize
               if shape else 0 for _, _, shape, dtype in layout)


def _cut(layout, flat: torch.Tensor, size: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s shards, out of its bytes ``flat`` end to end (``Shards.capture``)."""
    pieces, at = [], 0
    for _, _, shape, dtype in layout:
        rows = _rows(shape[0], size, rank)
        count = rows * math.prod(shape[1:]) * dtype.itemsize
        pieces.append(flat[at:at + count].view(dtype).reshape(rows, *shape[1:]))
        at += count
    return pieces


def whole_state(copy_: dict, flats: dict[int, torch.Tensor]) -> tuple[dict, dict]:
    """The whole model and optimizer state dicts (torch's full state dict form, keyed by
    parameter name), from ``copy_`` (this rank's copy of that step) and every old rank's
    shards ``flats`` (old rank -> bytes; local)."""
    layout, size = copy_["layout"], copy_["size"]
    shards = [_cut(layout, flats[rank].cpu(), size, rank) for rank in range(size)]
    model = dict(copy_["buffers"])
    state = {name: dict(values) for name, values in copy_["whole"].items()}
    for k, (name, key, _, _) in enumerate(layout):
        tensor = torch.cat([pieces[k] for pieces in shards])
        if key is None:
            model[name] = tensor
        else:
            state.setdefault(name, {})[key] = tensor
    return model, {"state": state, "param_groups": copy.deepcopy(copy_["groups"])}


def full_state(model, optimizer) -> tuple[dict, dict | None]:
    """The whole model and optimizer states (torch's full state dict form, keyed by parameter
    name, in CPU memory) on rank 0, empty dicts on the others; None for no ``optimizer``
    (collective over the model's group: torch's gathers, one parameter at a time)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

    on_rank0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=on_rank0)
    if optimizer is None:
        return model_state, None
    return model_state, get_optimizer_state_dict(model, optimizer, options=on_rank0)


def mismatch(model, optimizer, model_state: dict, optimizer_state: dict | None) -> str | None:
    """Why the whole states (``full_state``'s) cannot load into ``model`` and ``optimizer``
    (names, shapes, dtypes, parameter groups); None: they can (local). Checked before
    ``load``, whose collective calls a rank failing alone would leave the others waiting in."""
    from torch.distributed.tensor import DTensor

    want = {name: (tuple(value.shape), value.dtype) for name, value in model.state_dict().items()
            if isinstance(value, torch.Tensor)}
    for name, value in model_state.items():
        if isinstance(value, DTensor):
            return (f"its {name} is a DTensor (one rank's shard: saved as rank 0's "
                    f"state_dict()), not the whole tensor")
    got = {name: (tuple(value.shape), value.dtype) for name, value in model_state.items()
           if isinstance(value, torch.Tensor)}
    if sorted(got) != sorted(want):
        return (f"the model's tensors are not the saved ones: saved only "
                f"{sorted(set(got) - set(want))}, the model's only {sorted(set(want) - set(got))}")
    for name, (shape, dtype) in want.items():
        if got[name] != (shape, dtype):
            return (f"its {name} is {list(got[name][0])} {got[name][1]}, the model's "
                    f"{list(shape)} {dtype}")
    if optimizer is None:
        return None
    params = dict(model.named_parameters())
    name_of = {id(p): name for name, p in params.items()}
    groups = [[name_of.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
    if [list(group["params"]) for group in optimizer_state["param_groups"]] != groups:
        return ("the optimizer's parameter groups do not step the parameters the saved "
                "optimizer's did, group for group")
    for name, state in optimizer_state["state"].items():
        for key, value in state.items():
            shape = params[name].shape
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != shape:
                return (f"its optimizer state {key} of {name} is {list(value.shape)}, the "
                        f"parameter {list(shape)}")
    return None


def load(model, optimizer, model_state: dict, optimizer_state: dict | None) -> None:
    """Load the whole states into a new FSDP2 ``model`` and its ``optimizer`` (collective over
    the default group: torch's calls; ``optimizer`` None: the model alone).

    Every rank passes the whole states (``full_state_dict=True``), as every rank holds
    them here (a heal's survivors, a resume's readers), so nothing is broadcast.

    torch's ``set_optimizer_state_dict`` first steps an optimizer that has no state yet
    with zero gradients and a zero learning rate, to make its state: a parameter that had
    none before the heal (no step taken yet) is given none again, as a fresh optimizer
    has none, so that Adam's first step after the heal is its first step.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=whole)
    if optimizer is None:
        return
    # strict=False: a parameter without optimizer state (no gradient yet) is torch's error
    set_optimizer_state_dict(model, optimizer, optimizer_state,
                             options=StateDictOptions(full_state_dict=True, strict=False))
    for name, param in model.named_parameters():
        if name not in optimizer_state["state"]:
            optimizer.state.pop(param, None)
