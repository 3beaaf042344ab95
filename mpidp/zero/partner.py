"""A partner copy of the previous rank's ZeRO shard, for ``mpidp.Healer``.

Under User-Level Failure Mitigation a lost rank's optimizer shard would go with
it. With a partner copy, rank ``r`` also steps the pieces of rank ``r - 1``
(mod N) on an inner optimizer of its own, with the same whole gradients
(stage 1: every rank has them): its state is that rank's, element for element,
and keeping it up to date costs no message, only one more inner step over about
``1/N`` of the elements and that much memory. The copy steps rank ``r - 1``'s
pieces of the flat buffers in place: the allgather that follows writes that
rank's own values over them, so the parameters are the owners' as ever.

Stage 1 only: stage 2 leaves each rank its own gradient shard alone, so no
partner could step another's.
"""

from __future__ import annotations

import torch

from .. import communicators as _communicators
from ..comm.handle import collective

__all__ = ["HealingMixin", "LocalState", "Partner"]


class Partner:
    """The pieces of rank ``of`` of a ``ZeroRedundancyOptimizer``, stepped here too.

    Args:
        zero: the optimizer (stage 1), as laid out now.
        pieces: saved pieces ``(member, start, stop, state)`` to start the copy's
            state from (those of rank ``of`` at least), or None: no state yet.
    """

    def __init__(self, zero, pieces=None):
        self.of = (zero.rank - 1) % zero.world
        params, group_of = zero._params(), zero._group_of()
        self.optim = zero.optimizer_class(
            [dict(zero._hyper(group), params=[]) for group in zero.param_groups], **zero._defaults)
        self.pieces = []  # (member, start, stop, the piece: a view of the flat buffer)
        for bucket in zero._buckets:
            numels = [params[i].numel() for i in bucket.members]
            offsets = [sum(numels[:k]) for k in range(len(numels))]
            for k, start, stop, _ in bucket.shards.pieces(self.of, numels):
                member = bucket.members[k]
                piece = bucket.flat[offsets[k] + start:offsets[k] + stop]
                self.pieces.append((member, start, stop, piece))
                self.optim.param_groups[group_of[member]]["params"].append(piece)
        if pieces:
            self.load(zero, pieces)

    @torch.no_grad()
    def step(self, zero) -> None:
        """Step the copy as rank ``of`` steps its shard (local; inside ``zero.step()``, before
        the allgather)."""
        for outer, inner in zip(zero.param_groups, self.optim.param_groups):
            inner.update(zero._hyper(outer))
        params = zero._params()
        try:
            for member, start, stop, piece in self.pieces:
                grad = params[member].grad
                piece.grad = None if grad is None else grad.reshape(-1)[start:stop]
            self.optim.step()
        finally:
            for *_, piece in self.pieces:
                piece.grad = None

    def states(self) -> list[tuple[int, int, int, dict]]:
        """The copy's pieces with their state, as ``sharded_state_dict()``'s (local)."""
        return [(member, start, stop, dict(self.optim.state[piece]))
                for member, start, stop, piece in self.pieces
                if piece in self.optim.state and self.optim.state[piece]]

    def load(self, zero, pieces) -> None:
        """Take the copy's state from saved ``pieces`` (local)."""
        state, order = {}, [piece for group in self.optim.param_groups for piece in group["params"]]
        position = {id(piece): k for k, piece in enumerate(order)}
        for member, start, stop, piece in self.pieces:
            merged = zero._merge(pieces, member, start, stop)
            if merged is not None:
                state[position[id(piece)]] = merged
        groups, first = [], 0
        for inner in self.optim.param_groups:
            groups.append(dict(zero._hyper(inner), params=list(range(first, first + len(inner["params"])))))
            first += len(inner["params"])
        self.optim.load_state_dict({"state": state, "param_groups": groups})


class HealingMixin:
    """What ``mpidp.Healer`` needs of a ``ZeroRedundancyOptimizer`` (stage 1, over the world).

    A heal, in the Healer's order: ``_rebuild(world)`` (a new communicator over
    the survivors, from ``mpidp.communicators.rebuild_all``); every survivor
    takes back its own copy of the state at one agreed step
    (``_local_state()``'s); ``_heal_pieces(lost)`` on every survivor, allgathered;
    ``_regroup(pieces)``, which lays the optimizer out over the survivors and
    takes each new shard's state from those pieces.
    """

    def keep_partner_copy(self) -> None:
        """From now on also step rank ``r - 1``'s shard here (collective; see ``Partner``).

        The copy starts from that rank's state now (one message each way).

        Raises:
            ValueError: on every rank, for stage 2 (only the own gradient shard is kept).
        """
        if self.stage != 1:
            raise ValueError("a partner copy needs the whole gradients of stage=1; stage=2 "
                             "keeps only this rank's shard of them")
        mine = [(member, start, stop, {key: value.detach().cpu() if isinstance(value, torch.Tensor)
                                       else value for key, value in state.items()})
                for member, start, stop, state in self._piece_states()]
        theirs = collective(self._comm, "sendrecv",
                            (mine, (self.rank + 1) % self.world, 0, None,
                             (self.rank - 1) % self.world),
                            "ZeroRedundancyOptimizer.keep_partner_copy() (sendrecv)")
        self._partner = Partner(self, theirs)

    def _local_state(self) -> "LocalState":
        """This rank's own state, partner copy and hyperparameters, as a torch optimizer's
        ``state_dict``/``load_state_dict`` pair (local: a Healer's copy at each step)."""
        return LocalState(self)

    def _rebuild(self, world) -> None:
        """A new communicator over ``world`` (a heal's first step; ``_regroup`` lays out the rest)."""
        _communicators.release(self._comm)
        self._comm = _communicators.made(world.Dup(), f"ZeroRedundancyOptimizer {id(self):#x}",
                                         rebuild=self._rebuild)

    def _heal_pieces(self, lost) -> list:
        """This rank's pieces, and its partner copy's if that rank was lost (local)."""
        pieces = list(self._piece_states())
        if self._partner is not None and self._partner.of in lost:
            pieces += self._partner.states()
        return [(member, start, stop, {key: value.detach().cpu() if isinstance(value, torch.Tensor)
                                       else value for key, value in state.items()})
                for member, start, stop, state in pieces]

    def _regroup(self, pieces) -> None:
        """Lay the optimizer out over its new communicator; each shard's state from ``pieces``
        (every old shard's, the same on every rank; collective)."""
        groups = [self._hyper(group) for group in self.param_groups]
        self._partner = None  # the old layout's; made again below
        self.rank, self.world = self._comm.Get_rank(), self._comm.Get_size()
        self._buckets = []
        self._lay_out(list(range(len(self._params()))))
        self.optim = self.optimizer_class([dict(hyper, params=[]) for hyper in groups],
                                          **self._defaults)
        for bucket in self._buckets:
            self._add_pieces(bucket)
        self._load_pieces(pieces, groups)
        self._partner = Partner(self, pieces) if self.world > 1 else None


class LocalState:
    """``state_dict``/``load_state_dict`` of one rank's part of a ``ZeroRedundancyOptimizer``.

    Loading gives the inner optimizers tensors of the dict itself (as torch's
    ``load_state_dict`` does): copy the dict first if it must stay unchanged.
    """

    def __init__(self, zero):
        self.zero = zero

    def state_dict(self) -> dict:
        zero = self.zero
        return {"own": zero.optim.state_dict(),
                "partner": zero._partner.optim.state_dict() if zero._partner else None,
                "groups": [zero._hyper(group) for group in zero.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        zero = self.zero
        zero.optim.load_state_dict(state["own"])
        if zero._partner is not None:
            zero._partner.optim.load_state_dict(state["partner"])
        for outer, hyper in zip(zero.param_groups, state["groups"]):
            outer.update(hyper)  # the inner groups take them at the next step()
