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

from typing import Protocol

import torch

from ..comm.handle import collective
from .checkpoint import Checkpoint, Piece, Sharded, merge

__all__ = ["Healable", "Healing", "LocalState", "Partner"]


class Healable(Sharded, Protocol):
    """What the healing part reads of a ``ZeroRedundancyOptimizer``, and the one thing it
    asks of it: ``_lay_out_again``, over the communicator a heal gave it."""

    optimizer_class: type
    stage: int
    _defaults: dict  # the inner optimizer's arguments

    def _group_of(self) -> list[int]: ...

    def _lay_out_again(self, groups: list[dict]) -> None: ...


class Partner:
    """The pieces of rank ``of`` of a ``ZeroRedundancyOptimizer``, stepped here too.

    Args:
        zero: the optimizer (stage 1), as laid out now.
        pieces: saved pieces ``(member, start, stop, state)`` to start the copy's
            state from (those of rank ``of`` at least), or None: no state yet.
    """

    def __init__(self, zero: Healable, pieces: list[Piece] | None = None):
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
    def step(self, zero: Healable) -> None:
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

    def states(self) -> list[Piece]:
        """The copy's pieces with their state, as ``sharded_state_dict()``'s (local)."""
        return [(member, start, stop, dict(self.optim.state[piece]))
                for member, start, stop, piece in self.pieces
                if piece in self.optim.state and self.optim.state[piece]]

    def load(self, zero: Healable, pieces: list[Piece]) -> None:
        """Take the copy's state from saved ``pieces`` (local)."""
        state, order = {}, [piece for group in self.optim.param_groups for piece in group["params"]]
        position = {id(piece): k for k, piece in enumerate(order)}
        for member, start, stop, piece in self.pieces:
            merged = merge(pieces, member, start, stop, zero._sharded_keys)
            if merged is not None:
                state[position[id(piece)]] = merged
        groups, first = [], 0
        for inner in self.optim.param_groups:
            groups.append(dict(zero._hyper(inner), params=list(range(first, first + len(inner["params"])))))
            first += len(inner["params"])
        self.optim.load_state_dict({"state": state, "param_groups": groups})


class Healing:
    """What ``mpidp.Healer`` needs of a ``ZeroRedundancyOptimizer`` (stage 1, over the world).

    A heal, in the Healer's order: the optimizer's ``_rebuild(world)`` (a new
    communicator over the survivors, from ``mpidp.communicators.rebuild_all``);
    every survivor takes back its own copy of the state at one agreed step
    (``local_state()``'s); ``heal_pieces(lost)`` on every survivor, allgathered;
    ``regroup(pieces)``, which lays the optimizer out over the survivors and
    takes each new shard's state from those pieces.

    Args:
        zero: the optimizer it belongs to, read at each call (``Healable``).
        checkpoint: that optimizer's checkpoint part, which loads the pieces at a regroup.
    """

    def __init__(self, zero: Healable, checkpoint: Checkpoint):
        self._zero = zero
        self._checkpoint = checkpoint
        self.partner: Partner | None = None  # keep_partner_copy()'s

    def keep_partner_copy(self) -> None:
        """Step rank ``r - 1``'s shard here too, from its state now (collective; see
        ``ZeroRedundancyOptimizer.keep_partner_copy``)."""
        zero = self._zero
        if zero.stage != 1:
            raise ValueError("a partner copy needs the whole gradients of stage=1; stage=2 "
                             "keeps only this rank's shard of them")
        mine = [(member, start, stop, {key: value.detach().cpu() if isinstance(value, torch.Tensor)
                                       else value for key, value in state.items()})
                for member, start, stop, state in zero._piece_states()]
        theirs = collective(zero._comm, "sendrecv",
                            (mine, (zero.rank + 1) % zero.world, 0, None,
                             (zero.rank - 1) % zero.world),
                            "ZeroRedundancyOptimizer.keep_partner_copy() (sendrecv)")
        self.partner = Partner(zero, theirs)

    def step(self) -> None:
        """Step the partner copy, if one is kept (local; in ``step()``, before the allgather)."""
        if self.partner is not None:
            self.partner.step(self._zero)

    def loaded(self, pieces: list[Piece]) -> None:
        """The optimizer loaded ``pieces``: the partner copy takes its state from them too."""
        if self.partner is not None:
            self.partner.load(self._zero, pieces)

    def param_group_added(self) -> None:
        """The new pieces start without state, as their owner's (local)."""
        if self.partner is not None:
            self.partner = Partner(self._zero, self.partner.states())

    def local_state(self) -> "LocalState":
        """This rank's own state, partner copy and hyperparameters, as a torch optimizer's
        ``state_dict``/``load_state_dict`` pair (local: a Healer's copy at each step)."""
        return LocalState(self._zero, self)

    def heal_pieces(self, lost) -> list[Piece]:
        """This rank's pieces, and its partner copy's if that rank was lost (local)."""
        pieces = list(self._zero._piece_states())
        if self.partner is not None and self.partner.of in lost:
            pieces += self.partner.states()
        return [(member, start, stop, {key: value.detach().cpu() if isinstance(value, torch.Tensor)
                                       else value for key, value in state.items()})
                for member, start, stop, state in pieces]

    def regroup(self, pieces: list[Piece]) -> None:
        """Lay the optimizer out over its new communicator; each shard's state from ``pieces``
        (every old shard's, the same on every rank; collective)."""
        zero = self._zero
        groups = [zero._hyper(group) for group in zero.param_groups]
        self.partner = None  # the old layout's; made again below
        zero._lay_out_again(groups)
        self._checkpoint.load_pieces(pieces, groups)
        self.partner = Partner(zero, pieces) if zero.world > 1 else None


class LocalState:
    """``state_dict``/``load_state_dict`` of one rank's part of a ``ZeroRedundancyOptimizer``.

    Loading gives the inner optimizers tensors of the dict itself (as torch's
    ``load_state_dict`` does): copy the dict first if it must stay unchanged.

    Args:
        zero: the optimizer.
        healing: its healing part, whose partner copy is saved and loaded too.
    """

    def __init__(self, zero: Healable, healing: Healing):
        self.zero = zero
        self.healing = healing

    def state_dict(self) -> dict:
        zero, partner = self.zero, self.healing.partner
        return {"own": zero.optim.state_dict(),
                "partner": partner.optim.state_dict() if partner else None,
                "groups": [zero._hyper(group) for group in zero.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        zero, partner = self.zero, self.healing.partner
        zero.optim.load_state_dict(state["own"])
        if partner is not None:
            partner.optim.load_state_dict(state["partner"])
        for outer, hyper in zip(zero.param_groups, state["groups"]):
            outer.update(hyper)  # the inner groups take them at the next step()
