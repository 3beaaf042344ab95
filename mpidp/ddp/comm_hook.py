"""How a DistributedDataParallel's buckets are communicated: its comm hook and whether it records.

``register_comm_hook`` replaces the buckets' allreduce with the user's hook
(torch's contract; mpidp's hooks are in ``mpidp.hooks``), checked alike on
every rank; ``record_stats`` says whether the steps' statistics and profiler
ranges are recorded (``mpidp.ddp.bucket_launch`` counts them). ``CommHooks``
is the part of a DDP that holds both and gives them to each reducer it makes.
"""

from __future__ import annotations

from typing import Protocol

import torch
from mpi4py import MPI

from .. import _args, runtime
from ..comm.agreement import decide
from .reducer import Reducer

__all__ = ["CommHooks", "Hooked"]


class Hooked(Protocol):
    """What ``CommHooks`` reads of its DistributedDataParallel."""

    module: torch.nn.Module
    control: MPI.Intracomm | None
    reducer: Reducer | None
    _sink: object | None  # the stage-2 ZeroRedundancyOptimizer, or None
    _options: dict

    def _connect(self, base: MPI.Intracomm, device: torch.device) -> None: ...


class CommHooks:
    """A DDP's comm hook and its ``record_stats``, given to each reducer it makes.

    Args:
        owner: the DistributedDataParallel (``Hooked``).
        record: ``record_stats`` to start with.
    """

    def __init__(self, owner: Hooked, record: bool = True):
        self._owner = owner
        self.hook: tuple | None = None  # (state, hook) of register_comm_hook
        self.record = record

    def equip(self, reducer: Reducer) -> None:
        """Give a new reducer the hook and the recording switch (local)."""
        reducer.launcher.comm_hook = self.hook
        reducer.launcher.record = self.record

    def register(self, state: object, hook) -> None:
        """``DistributedDataParallel.register_comm_hook`` (collective)."""
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        ddp = self._owner
        if ddp.reducer is None:
            ddp._connect(runtime.world(), next(ddp.module.parameters()).device)
        reducer, problem = ddp.reducer, None
        if self.hook is not None:
            problem = "register_comm_hook can only be called once (as in torch)"
        elif ddp._options["reproducible"]:
            problem = ("a comm hook cannot reduce the buckets of a DistributedDataParallel"
                       "(reproducible=True), which sums them in micro-batch order")
        elif ddp._sink is not None:
            problem = ("a comm hook cannot reduce the buckets of a stage-2 "
                       "ZeroRedundancyOptimizer, which reduce-scatters them")
        elif reducer.stats or (reducer._step is not None and reducer._step.state != "armed"):
            problem = ("register_comm_hook must be called before the first backward (as torch "
                       "requires): buckets were already reduced another way")
        name = f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"
        decide(ddp.control, (name, problem), _judge_hooks, "register_comm_hook's check")
        self.hook = (state, hook)
        self.equip(reducer)

    def set_record(self, value: bool) -> None:
        """``DistributedDataParallel.record_stats = value`` (local)."""
        _args.check_bool("record_stats", value)
        self.record = value
        if self._owner.reducer is not None:
            self.equip(self._owner.reducer)


def _judge_hooks(reports: list) -> Exception | None:
    """Every rank's (hook name, problem): the first problem, or hooks that differ."""
    names = {rank: name for rank, (name, _) in enumerate(reports)}
    problems = [problem for _, problem in reports if problem is not None]
    if problems:
        return RuntimeError(f"DistributedDataParallel.register_comm_hook: {problems[0]}")
    if len(set(names.values())) > 1:
        return ValueError(f"DistributedDataParallel.register_comm_hook: the ranks register "
                          f"different hooks ({names}); every rank must register the same")
    return None
