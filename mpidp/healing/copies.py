"""The copies of a rank's state at the start of its last steps, which a heal goes back to.

A step that failed after ``optimizer.step()`` left the state half-done, so ``Healer.guard()``
copies it at each step's start (model, optimizer, scheduler, scaler, the Checkpointer's
``extra``, the generators, the step count and the sampler's position). One copy is kept; with
ZeRO or FSDP2, whose survivors go back to a step they all hold, two. Each copy reuses the
memory of the oldest one kept. All of it is local: no call here communicates.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import generators


def _copy(state, into=None):
    """``state`` with every tensor copied: into ``into``'s tensors where it has the same shape
    (no allocation: a step's copy reuses the last one's memory), else into new ones."""
    leaves, spec = tree_flatten(state)
    if into is not None:
        old, old_spec = tree_flatten(into)
        if old_spec == spec and all(
                not isinstance(t, torch.Tensor) or (isinstance(b, torch.Tensor) and b.shape == t.shape
                                                    and b.dtype == t.dtype and b.device == t.device)
                for t, b in zip(leaves, old)):
            return tree_unflatten([b.copy_(t) if isinstance(t, torch.Tensor) else t
                                   for t, b in zip(leaves, old)], spec)
    return tree_unflatten([t.detach().clone() if isinstance(t, torch.Tensor) else t
                           for t in leaves], spec)


class Copies:
    """This rank's state at the start of its last steps, oldest first (local, program's thread).

    Args:
        checkpointer: the run's ``mpidp.Checkpointer``, whose state is copied.
        zero: its ``ZeroRedundancyOptimizer`` where the run heals with one (its local shard
            is copied, not the whole optimizer), else None.
        fsdp: torch's FSDP2 model's ``mpidp.process_group.fsdp.Shards`` (its shards and
            partner copy are copied, not the model's state dict), else None; a heal that makes
            the model again puts the new one's here.

    Attributes:
        snapshot: the copy of the step running in ``guard()``, until it ends whole (None).
        kept: the last copies, oldest first, whose memory the next ones reuse.
    """

    def __init__(self, checkpointer, *, zero=None, fsdp=None):
        self.checkpointer = checkpointer
        self.zero = zero
        self.fsdp = fsdp
        self.keep = 1 if zero is None and fsdp is None else 2
        self.snapshot: dict | None = None
        self.kept: list[dict] = []

    def parts(self) -> dict:
        """The objects with a ``state_dict`` that a copy holds, by name (the model aside)."""
        checkpointer = self.checkpointer
        optimizer = checkpointer.optimizer if self.zero is None else self.zero._healing.local_state()
        if self.fsdp is not None:  # its shards are in the copy's "fsdp"
            optimizer = None
        parts = {"optimizer": optimizer, "scheduler": checkpointer.scheduler,
                 "scaler": checkpointer.scaler}
        parts.update({f"extra:{name}": obj for name, obj in checkpointer.extra.items()})
        return {name: obj for name, obj in parts.items() if obj is not None}

    def position(self) -> tuple:
        """Where the run stands: the step count, the epoch's batches taken, the sampler's place."""
        c = self.checkpointer
        return c.steps, c._epoch, c._base, c._batches, c.sampler.epoch, c.sampler.start

    def set_position(self, position: tuple) -> None:
        """Put the run where ``position`` (as ``position()`` gives it) says."""
        c = self.checkpointer
        c.steps, c._epoch, c._base, c._batches, epoch, start = position
        c.sampler.epoch, c.sampler.start = epoch, start

    def capture(self) -> dict:
        """This rank's state at the start of a step, copied (the step changes it in place)
        into the memory of the oldest copy kept."""
        last = self.kept[0] if len(self.kept) >= self.keep else {}
        if self.fsdp is not None:
            model = {"fsdp": self.fsdp.capture(self.checkpointer._comm.Get_size(),
                                               last.get("fsdp"))}
        else:
            model = {"model": _copy(self.checkpointer._module().state_dict(), last.get("model"))}
        copy = {**model, "rng": generators.states(), "position": self.position(),
                **{name: _copy(obj.state_dict(), last.get(name))
                   for name, obj in self.parts().items()}}
        self.kept = [*self.kept[len(self.kept) - self.keep + 1:], copy]
        return copy

    def restore(self, snapshot: dict) -> None:
        """Load ``snapshot`` into the run's objects, generators and position."""
        self.kept = []  # the optimizer may now hold these very tensors: copy afresh
        if "model" in snapshot:  # FSDP2's comes whole from every rank's (mpidp.healing.fsdp)
            self.checkpointer._module().load_state_dict(snapshot["model"])
        for name, obj in self.parts().items():
            obj.load_state_dict(snapshot[name])
        generators.restore(snapshot["rng"])
        self.set_position(snapshot["position"])

    def steps(self) -> list[int]:
        """The step count of each copy kept, oldest first."""
        return [copy["position"][0] for copy in self.kept]

    def of_step(self, steps: int) -> dict | None:
        """The copy kept of the start of step ``steps`` (None: none)."""
        return next((copy for copy in self.kept if copy["position"][0] == steps), None)
