"""A heal's state with ZeRO: the optimizer's shards from the survivors and the partner copies.

ZeRO (stage 1, over the world) has no whole replica of the optimizer: a shard lives on its rank
and, as a partner copy, on the next one (``mpidp.zero.partner``, started here, collectively).
So the survivors go back to one step whose state each holds a copy of: the oldest any of them
stands at (a survivor whose step failed went back to its start). They differ by at most one
step, and each keeps two copies (``mpidp.healing.copies``). Their own shards and the lost
ranks' partner copies are then gathered and laid out again over the survivors.
"""

from __future__ import annotations

from mpi4py import MPI

from .. import spares as _spares
from ..comm import agreement
from ..zero import ZeroRedundancyOptimizer
from .copies import Copies
from .replica import broadcast_state


def _common_step(facts: list, lost: list[int], size: int) -> tuple[str | None, int]:
    """(why the ZeRO survivors cannot go on, or None; the step they go back to), from each
    survivor's ``(step it stands at, steps it holds copies of)`` (None: a joining spare) and
    the lost ranks' numbers in the old world of ``size`` ranks (the same on every rank)."""
    facts = [fact for fact in facts if fact is not None]
    steps = min(at for at, _ in facts)
    if any(at != steps and steps not in kept for at, kept in facts):
        return (f"the survivors stand at steps {sorted({at for at, _ in facts})} and some "
                f"hold no copy of step {steps}"), steps
    neighbours = [rank for rank in lost if (rank + 1) % size in lost]
    if neighbours:
        return (f"ranks {neighbours} and the next of each were lost together: their "
                f"ZeroRedundancyOptimizer shards had no other copy"), steps
    return None, steps


class ZeroShards:
    """The state of a run whose optimizer is a ``ZeroRedundancyOptimizer`` (see the module's
    docstring). The constructor starts the partner copies (collective over its world).

    Args:
        copies: this rank's step-start copies, made with ``zero=optimizer``.
        optimizer: the Checkpointer's ``ZeroRedundancyOptimizer``, stage 1 over the world.
    """

    label = "ZeRO"

    def __init__(self, copies: Copies, optimizer: ZeroRedundancyOptimizer):
        self.copies = copies
        self.optimizer = optimizer
        optimizer.keep_partner_copy()

    def step(self, world: MPI.Intracomm, lost: list[int], size: int, rank: int,
             joining: bool) -> tuple[str | None, int]:
        """The step every survivor can go back to, or why there is none (collective over
        ``world``; ``lost``: the lost ranks' numbers in the old world of ``size`` ranks).
        A joining spare holds no copy and says so (None)."""
        copies = self.copies
        mine = copies.snapshot["position"][0] if copies.snapshot is not None else \
            copies.checkpointer.steps
        _, verdict = agreement.judged(world, None if joining else (mine, copies.steps()),
                                      lambda facts: _common_step(facts, lost, size),
                                      "Healer: which steps can each survivor go back to?")
        return verdict

    def take(self, world: MPI.Intracomm, steps: int, lost: list[int], rank: int,
             joining: bool) -> None:
        """Go back to ``steps``, then lay the ZeRO shards out over the survivors (collective).

        With spares, a survivor's model, position and hyperparameters go to all first: a
        joining spare has none of them, and its pieces (of a one-rank layout) are not given.
        """
        copies = self.copies
        snapshot, copies.snapshot = copies.snapshot, None
        if snapshot is None or snapshot["position"][0] != steps:
            # None: this rank's last step was whole and it stands at ``steps`` already
            snapshot = copies.of_step(steps)
        if snapshot is not None and not joining:
            copies.restore(snapshot)
        if _spares.launched():
            broadcast_state(world, copies, joining)
        healing = self.optimizer._healing
        mine = [] if joining else healing.heal_pieces(lost)
        pieces = agreement.watched_allgather(world, mine, "Healer: the ZeRO shards' states")
        healing.regroup([piece for part in pieces for piece in part])
        return None
