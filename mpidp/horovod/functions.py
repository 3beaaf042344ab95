"""Making every rank start alike: ``broadcast_parameters`` and ``broadcast_optimizer_state``."""

from __future__ import annotations

import torch

from .. import optimizer as _optimizer
from . import process_sets as _sets
from . import requests as _requests
from .collectives import broadcast_async_, object_call

__all__ = ["broadcast_parameters", "broadcast_optimizer_state"]


def broadcast_parameters(params, root_rank: int, process_set=_sets.global_process_set) -> None:
    """Copy rank ``root_rank``'s parameters or buffers into every rank's, in place.

    Args:
        params: a ``state_dict()`` (broadcast in sorted key order, as Horovod does), or a
            list or iterator of tensors or of ``(name, tensor)`` pairs (``named_parameters()``).
        root_rank: the rank whose values every rank takes.
        process_set: the ranks to broadcast to (default: all).
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (str, bytes, torch.Tensor)) or not hasattr(params, "__iter__"):
        raise ValueError(f"params must be a state_dict or a list of parameters or of "
                         f"(name, parameter) pairs, got {type(params).__name__}")
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = [broadcast_async_(p, root_rank, name, process_set) for name, p in items
               if isinstance(p, torch.Tensor)]
    for handle in handles:
        _requests.synchronize(handle)


def broadcast_optimizer_state(optimizer, root_rank: int, model=None,
                              process_set=_sets.global_process_set) -> None:
    """Make every rank's optimizer state and hyperparameters rank ``root_rank``'s.

    ``mpidp.broadcast_optimizer_state`` does the work: the root's ``state_dict()``
    travels and the other ranks load it, empty state or full. As in Horovod, where
    this rank's state is empty, each parameter that requires a gradient and has none
    gets a zero one first (Horovod then steps the optimizer to create its state; here
    it is created by the first real step, which keeps the parameters and the step
    counts as one process has them).

    Args:
        optimizer: a torch optimizer or an ``hvd.DistributedOptimizer``.
        root_rank: the rank whose state every rank takes.
        model: accepted for Horovod's signature; not needed here.
        process_set: the ranks to broadcast to (default: all).
    """
    from .optimizer import _DistributedOptimizer
    if isinstance(optimizer, _DistributedOptimizer):
        optimizer = optimizer._optimizer
    if isinstance(optimizer, torch.optim.Optimizer) and not optimizer.state:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    object_call("broadcast_optimizer_state", process_set,
                lambda comm, root: _optimizer.broadcast_optimizer_state(optimizer, root, comm=comm),
                root=root_rank)
