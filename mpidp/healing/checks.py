"""What a heal cannot carry on with: the ``Healer``'s refusals, at its construction and at a heal.

Each function here is local: the Healer agrees on their verdicts across ranks
(``mpidp.comm.agreement``), so that every rank raises the same error or none does. What a
heal rebuilds, and what it refuses: docs/healing.md#what-a-heal-cannot-carry-on-with.
"""

from __future__ import annotations

import sys

import torch

from .. import communicators as _communicators
from .. import spares as _spares
from ..checkpoint import Checkpointer
from ..ddp.data_parallel import DistributedDataParallel
from ..process_group import fsdp as _fsdp
from ..process_group import healing as _torch_groups
from ..zero import ZeroRedundancyOptimizer


def unhealable(model, optimizer) -> list[str]:
    """What a heal cannot carry on with: communicators no owner rebuilds, and DDPs and ZeRO
    optimizers other than the Checkpointer's, whose states a heal would not make alike."""
    others = [f"{type(o).__name__} {id(o):#x}" for o in _communicators.rebuilders()
              if isinstance(o, (DistributedDataParallel, ZeroRedundancyOptimizer))
              and o is not model and o is not optimizer]
    torch_groups = _torch_groups.problem()
    return _communicators.unrebuildable() + others + ([torch_groups] if torch_groups else [])


def _horovod_trains(optimizer) -> bool:
    """Whether ``optimizer`` is ``mpidp.horovod``'s DistributedOptimizer over Horovod's whole
    world, which a heal carries on (``mpidp.horovod.healing``; imported only by a program's
    ``import mpidp.horovod``)."""
    horovod = sys.modules.get("mpidp.horovod.healing")
    return horovod is not None and horovod.follows(optimizer)


def check(checkpointer, active: bool, rebuild=None) -> None:
    """Raise TypeError or ValueError where ``Healer(checkpointer, rebuild=rebuild)`` cannot
    be made; where this job can heal (``active``), also what cannot follow a heal (local)."""
    if not isinstance(checkpointer, Checkpointer):
        raise TypeError(f"checkpointer must be an mpidp.Checkpointer, got "
                        f"{type(checkpointer).__name__}")
    fsdp = _fsdp.is_fsdp(checkpointer.model)
    if rebuild is not None and (not callable(rebuild) or not fsdp):
        raise TypeError(f"rebuild must be a callable, given with a model of torch's FSDP2 "
                        f"(fully_shard) only, got {type(rebuild).__name__} with a "
                        f"{type(checkpointer.model).__name__}")
    if checkpointer.sampler is None:
        raise ValueError("Healer needs the Checkpointer's sampler and batch_size, to "
                         "deal the batches (and re-split them after a lost rank)")
    if not active:
        return
    model = checkpointer.model
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        problem = _torch_groups.ddp_problem(model)
        if problem:
            raise ValueError(f"Healer: {problem}")
    elif fsdp:
        _check_fsdp(model, checkpointer.optimizer, rebuild)
    elif not isinstance(model, DistributedDataParallel):
        if not _horovod_trains(checkpointer.optimizer):
            raise TypeError(f"Healer heals mpidp.DistributedDataParallel, torch's over "
                            f"\"mpidp\", or a module stepped by mpidp.horovod's "
                            f"DistributedOptimizer over the whole world, got "
                            f"{type(model).__name__} (FSDP cannot carry a lost rank's shards)")
    elif not model._over_world:
        raise ValueError("Healer: the DistributedDataParallel trains over a communicator "
                         "of its own; only one over the world (comm=None) follows a heal")
    zero = checkpointer.optimizer
    if isinstance(zero, ZeroRedundancyOptimizer) and not zero._over_world:
        raise ValueError(f"Healer: the ZeroRedundancyOptimizer must be stage=1 over the "
                         f"world (comm=None) to follow a heal, got stage={zero.stage}"
                         f"{'' if zero.stage == 2 else ' over a communicator of its own'}: "
                         f"a lost rank's shard is rebuilt from the copy its partner rank "
                         f"keeps by stepping it too, which needs the whole gradients")
    stuck = unhealable(model, zero)
    if stuck:
        raise ValueError(f"Healer: these cannot follow a heal after a lost rank: {stuck} "
                         f"(what a heal rebuilds: "
                         f"docs/healing.md#what-a-heal-cannot-carry-on-with)")


def _check_fsdp(model, optimizer, rebuild) -> None:
    if rebuild is None:
        raise ValueError("Healer: torch's FSDP2 needs rebuild=, a callable that makes the "
                         "model, optimizer and scheduler again over the survivors (FSDP2 "
                         "cannot shard a module again over another group), got None")
    if _spares.launched():
        raise ValueError("Healer: torch's FSDP2 does not follow a heal with spare ranks "
                         "yet (mpidp.stand_by(spares=K) with K > 0); launch without spares")
    problem = _fsdp.problem(model, optimizer)
    if problem:
        raise ValueError(f"Healer: {problem}")
