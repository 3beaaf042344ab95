"""A heal's state where every rank holds a whole replica: the one with the most steps gives it.

mpidp's DistributedDataParallel, torch's over ``"mpidp"`` and a module stepped by
``mpidp.horovod``'s DistributedOptimizer keep the model and optimizer alike on every rank.
A survivor whose step failed first takes back its copy of that step's start
(``mpidp.healing.copies``); the survivors then hold the state after some number of whole
steps, which may differ by one, and the lowest rank among those with the most steps
broadcasts its state to all (a joining spare holds none, and takes it).
"""

from __future__ import annotations

from mpi4py import MPI

from ..comm import agreement
from ..comm.handle import collective
from ..ddp.replica import broadcast_coalesced
from .copies import Copies


def _most_steps(counts: list[tuple[int, bool]]) -> int:
    """The rank whose state all take: the most whole steps, a survivor before a joining spare
    (the judge of each rank's ``(steps, survivor)``)."""
    return counts.index(max(counts))


def broadcast_state(world: MPI.Intracomm, copies: Copies, joining: bool = False) -> int:
    """Every rank takes the state of the one with the most whole steps, a survivor rather
    than a spare that joins with as many; returns that rank (collective over ``world``).

    With ZeRO, whose shards come from the survivors' pieces (``mpidp.healing.zero``), the
    optimizer's hyperparameters only.
    """
    c, zero = copies.checkpointer, copies.zero
    _, root = agreement.judged(world, (c.steps, not joining), _most_steps,
                               "Healer: how many steps has each?")
    parts = copies.parts()
    if zero is not None:
        parts.pop("optimizer")
    state = None
    if world.Get_rank() == root:
        state = {"position": copies.position(), "rng": None,
                 **{name: obj.state_dict() for name, obj in parts.items()}}
        if zero is not None:
            state["zero groups"] = [zero._hyper(g) for g in zero.param_groups]
    state = collective(world, "bcast", (state, root), "Healer: the state's broadcast")
    module = c._module()
    broadcast_coalesced([*module.parameters(), *module.buffers()], root, comm=world)
    if world.Get_rank() != root:
        for name, obj in parts.items():
            obj.load_state_dict(state[name])
        for group, hyper in zip(zero.param_groups if zero else (), state.get("zero groups", ())):
            group.update(hyper)
    copies.set_position(state["position"])
    return root


class Replica:
    """The state of a run whose ranks each hold a whole replica (see the module's docstring).

    Args:
        copies: this rank's step-start copies (``mpidp.healing.copies.Copies``).
    """

    label = "replica"

    def __init__(self, copies: Copies):
        self.copies = copies

    def step(self, world: MPI.Intracomm, lost: list[int], size: int, rank: int,
             joining: bool) -> tuple[str | None, int | None]:
        """Nothing to agree on before the rebuild: any survivor's state will do."""
        return None, None

    def take(self, world: MPI.Intracomm, steps: int | None, lost: list[int], rank: int,
             joining: bool) -> int:
        """Go back to this rank's step start if its step failed, then take the state of the
        rank with the most whole steps; returns that rank (collective over ``world``)."""
        copies = self.copies
        if copies.snapshot is not None:  # this rank's step failed: back to its start
            copies.restore(copies.snapshot)
            copies.snapshot = None
        return broadcast_state(world, copies, joining)
