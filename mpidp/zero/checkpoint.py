"""``ZeroRedundancyOptimizer``'s checkpoints: whole state dicts and sharded saves.

A whole state dict is torch's format, over every parameter: gathered on one
rank by ``consolidate_state_dict(to)``, loaded on every rank, each keeping
its shard. A sharded save is each rank's pieces with where they lie in their
parameters, one file per rank; any number of ranks can load it, since every
piece is cut and merged by element ranges. Every load ends in the same
decision on every rank (``mpidp.comm.agreement.agree``): a rank whose checks
failed never leaves the others loading alone.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from mpi4py import MPI

from ..comm.handle import collective
from .._args import is_int
from ..comm.agreement import agree
from .bucket import Bucket

__all__ = ["Checkpoint", "Sharded", "merge"]

_FORMAT = "mpidp.ZeroRedundancyOptimizer/1"
_LABEL = "ZeroRedundancyOptimizer.{}: error agreement"
_LOADING = "ZeroRedundancyOptimizer, loading the state: error agreement"
_FILE = re.compile(r"zero-rank(\d+)-of-(\d+)\.pt$")

Piece = tuple[int, int, int, dict]  # (parameter index, start, stop, its state)


class Sharded(Protocol):
    """What a ``ZeroRedundancyOptimizer``'s parts read of it: its layout now (a heal lays it
    out again, so the parts read it at each call and keep none of it)."""

    param_groups: list[dict]
    optim: torch.optim.Optimizer  # the inner optimizer over this rank's pieces
    rank: int
    world: int
    _comm: MPI.Intracomm
    _buckets: list[Bucket]
    _sharded_keys: frozenset[str]  # the state keys cut with the elements (elementwise.py)

    def _params(self) -> list[torch.Tensor]: ...

    @staticmethod
    def _hyper(group: dict) -> dict: ...

    def _sync_back(self) -> None: ...

    def _piece_states(self) -> list[Piece]: ...


def merge(pieces: Iterable[Piece], member: int, low: int, high: int,
          sharded_keys: frozenset[str]) -> dict | None:
    """The state of elements ``low:high`` of parameter ``member``, from saved pieces.

    Raises:
        ValueError: the pieces cover only part of ``low:high``.
    """
    found = sorted(((start, stop, state) for index, start, stop, state in pieces
                    if index == member and start < high and stop > low and state),
                   key=lambda piece: piece[:2])
    if not found:
        return None
    covered, merged = low, {}
    for start, stop, state in found:
        if start > covered:
            break
        covered = max(covered, stop)
    if covered < high:
        raise ValueError(f"the saved optimizer state of parameter {member} covers only part "
                         f"of elements {low}:{high} (up to {covered}); the checkpoint is "
                         f"incomplete")
    for key, value in found[0][2].items():
        if key not in sharded_keys:
            merged[key] = value.clone() if isinstance(value, torch.Tensor) else value
            continue
        parts = []
        for start, stop, state in found:
            a, b = max(start, low), min(stop, high)
            if a < b:
                parts.append(state[key].reshape(-1)[a - start:b - start])
        merged[key] = torch.cat(parts)
    return merged


class Checkpoint:
    """A ``ZeroRedundancyOptimizer``'s whole and sharded state dicts, saves and loads.

    The optimizer's methods of the same names call these. A load returns the
    pieces it loaded, for the optimizer's partner copy (``partner.py``) to follow.

    Args:
        zero: the optimizer, read at each call (``Sharded``).
    """

    def __init__(self, zero: Sharded):
        self._zero = zero
        self.consolidated: dict | None = None  # consolidate_state_dict()'s, on the rank gathered to

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` for ``state_dict()`` (collective)."""
        zero = self._zero
        if not is_int(to) or not 0 <= to < zero.world:
            raise ValueError(f"to must be a rank from 0 to {zero.world - 1}, got {to!r}")
        local = [(member, start, stop, {key: value.detach().cpu()
                                        if isinstance(value, torch.Tensor) else value
                                        for key, value in state.items()})
                 for member, start, stop, state in zero._piece_states()]
        gathered = collective(zero._comm, "gather", (local, to),
                              "ZeroRedundancyOptimizer.consolidate_state_dict() (gather)")
        self.consolidated = None
        if zero.rank != to:
            return
        pieces = [piece for part in gathered for piece in part]
        params = zero._params()
        state = {}
        for index, param in enumerate(params):
            merged = merge(pieces, index, 0, param.numel(), zero._sharded_keys)
            if merged is None:
                continue
            state[index] = {key: value.view(param.shape) if key in zero._sharded_keys else value
                            for key, value in merged.items()}
        groups, start = [], 0
        for group in zero.param_groups:
            groups.append(dict(zero._hyper(group), params=list(range(start, start + len(group["params"])))))
            start += len(group["params"])
        self.consolidated = {"state": state, "param_groups": groups}

    def state_dict(self) -> dict:
        """The whole state, in the inner optimizer's format, after ``consolidate_state_dict``.

        Raises:
            RuntimeError: on a rank that did not receive the consolidated state (as torch's).
        """
        zero = self._zero
        if self.consolidated is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict() on rank {zero.rank}: the optimizer state "
                f"has not been consolidated on this rank; call consolidate_state_dict(to=rank) "
                f"on every rank first (or save sharded with save_sharded())")
        return self.consolidated

    def load_pieces(self, pieces: list[Piece], groups: list[dict]) -> list[Piece]:
        """Load this rank's pieces' state from saved ``pieces`` (any layout), and ``groups``' hyperparameters."""
        zero = self._zero
        error = None
        try:
            if len(groups) != len(zero.param_groups):
                raise ValueError(f"the state dict has {len(groups)} param group(s), the optimizer "
                                 f"{len(zero.param_groups)}")
            inner_state, order = {}, []
            for bucket in zero._buckets:
                for member, start, stop, _, piece in bucket.pieces:
                    merged = merge(pieces, member, start, stop, zero._sharded_keys)
                    if merged is not None:
                        inner_state[id(piece)] = merged
            for group in zero.optim.param_groups:
                order.extend(group["params"])
            loaded = {"state": {k: inner_state[id(p)] for k, p in enumerate(order)
                                if id(p) in inner_state},
                      "param_groups": []}
            start = 0
            for group, inner in zip(groups, zero.optim.param_groups):
                count = len(inner["params"])
                loaded["param_groups"].append(dict(zero._hyper(group),
                                                   params=list(range(start, start + count))))
                start += count
        except (ValueError, KeyError, RuntimeError) as caught:
            error = caught
        agree(zero._comm, error, _LOADING)
        # The inner optimizer has checks of its own: if they fail on some rank,
        # every rank raises and keeps the state it had.
        previous = zero.optim.state_dict()
        try:
            zero.optim.load_state_dict(loaded)
        except Exception as caught:
            error = caught
        try:
            agree(zero._comm, error, _LOADING)
        except Exception:
            if error is None:
                zero.optim.load_state_dict(previous)
            raise
        for outer, group in zip(zero.param_groups, groups):
            outer.update(zero._hyper(group))
        zero._sync_back()
        return pieces

    def load_state_dict(self, state_dict: dict) -> list[Piece]:
        """Load a whole state dict (``state_dict()`` of this class or of a plain torch optimizer
        over the same parameters), given on every rank; each keeps its shard (collective)."""
        zero = self._zero
        error, pieces = None, []
        try:
            params = zero._params()
            counts = [len(group["params"]) for group in state_dict["param_groups"]]
            mine = [len(group["params"]) for group in zero.param_groups]
            if counts != mine:
                raise ValueError(f"the state dict's param groups hold {counts} parameters, the "
                                 f"optimizer's {mine}")
            ids = [i for group in state_dict["param_groups"] for i in group["params"]]
            for position, saved in enumerate(ids):
                if saved in state_dict["state"]:
                    param = params[position]
                    state = {key: value.reshape(-1) if key in zero._sharded_keys else value
                             for key, value in state_dict["state"][saved].items()}
                    pieces.append((position, 0, param.numel(), state))
        except (ValueError, KeyError, TypeError) as caught:
            error = caught
        agree(zero._comm, error, _LABEL.format("load_state_dict()"))
        return self.load_pieces(pieces, state_dict["param_groups"])

    def sharded_state_dict(self) -> dict:
        """This rank's part of the state, with where each piece lies in its parameter.

        Any number of ranks can load the set of all ranks' dicts with
        ``load_sharded_state_dict`` (local; see ``save_sharded``).
        """
        zero = self._zero
        return {"format": _FORMAT, "rank": zero.rank, "world": zero.world,
                "numels": [p.numel() for p in zero._params()],
                "param_groups": [zero._hyper(group) | {"count": len(group["params"])}
                                 for group in zero.param_groups],
                "pieces": [(member, start, stop, dict(state))
                           for member, start, stop, state in zero._piece_states()]}

    def load_sharded_state_dict(self, shards: Sequence[dict]) -> list[Piece]:
        """Load from every saved rank's ``sharded_state_dict()`` (any number of ranks; collective)."""
        zero = self._zero
        error = None
        try:
            if not shards:
                raise ValueError("shards is empty: pass every saved rank's sharded_state_dict()")
            numels = [p.numel() for p in zero._params()]
            for shard in shards:
                if not isinstance(shard, dict) or shard.get("format") != _FORMAT:
                    raise ValueError(f"not a ZeroRedundancyOptimizer sharded state dict (format "
                                     f"{shard.get('format') if isinstance(shard, dict) else shard!r})")
                if shard["numels"] != numels:
                    raise ValueError("the sharded state dict was saved for parameters of other "
                                     "sizes than this optimizer's")
            worlds = {shard["world"] for shard in shards}
            ranks = sorted(shard["rank"] for shard in shards)
            if len(worlds) != 1 or ranks != list(range(worlds.pop())):
                raise ValueError(f"the shards are not one save: ranks {ranks} of world(s) "
                                 f"{sorted({s['world'] for s in shards})}")
            groups = shards[0]["param_groups"]
            counts = [group["count"] for group in groups]
            if counts != [len(group["params"]) for group in zero.param_groups]:
                raise ValueError(f"the saved param groups hold {counts} parameters, the "
                                 f"optimizer's {[len(g['params']) for g in zero.param_groups]}")
        except (ValueError, KeyError, TypeError) as caught:
            error = caught
        agree(zero._comm, error, _LABEL.format("load_sharded_state_dict()"))
        pieces = [piece for shard in shards for piece in shard["pieces"]]
        return self.load_pieces(pieces, [{k: v for k, v in g.items() if k != "count"} for g in groups])

    def save_sharded(self, directory: str) -> None:
        """Write this rank's ``sharded_state_dict()`` to ``directory`` (collective).

        One file per rank, ``zero-rank{r:05d}-of-{N:05d}.pt`` (``zero-rank00001-of-00004.pt``
        is rank 1 of 4); files of a save at another number of ranks are removed
        first. ``load_sharded`` reads them back at any number of ranks. The
        directory must be shared by the ranks that will load it.
        """
        zero = self._zero
        error = None
        try:
            os.makedirs(directory, exist_ok=True)
            for old in glob.glob(os.path.join(directory, "zero-rank*-of-*.pt")):
                match = _FILE.search(old)
                if match and int(match.group(2)) != zero.world and zero.rank == 0:
                    os.remove(old)  # another world size's save would mix in at load
        except OSError as caught:
            error = caught
        # also the barrier: the old files are gone before any write
        agree(zero._comm, error, _LABEL.format("save_sharded()"))
        try:
            torch.save(self.sharded_state_dict(),
                       os.path.join(directory, f"zero-rank{zero.rank:05d}-of-{zero.world:05d}.pt"))
        except (OSError, RuntimeError) as caught:  # torch's writer raises RuntimeError too
            error = caught
        # and every file is written when any rank returns
        agree(zero._comm, error, _LABEL.format("save_sharded()"))

    def load_sharded(self, directory: str) -> list[Piece]:
        """Load what ``save_sharded`` wrote, at any number of ranks (collective)."""
        zero = self._zero
        error, shards = None, []
        try:
            files = sorted(glob.glob(os.path.join(directory, "zero-rank*-of-*.pt")))
            if not files:
                raise FileNotFoundError(f"no zero-rank*-of-*.pt file in {directory!r}")
            shards = [torch.load(path, mmap=True, weights_only=True) for path in files]
        except (OSError, RuntimeError) as caught:
            error = caught
        agree(zero._comm, error, _LABEL.format("load_sharded()"))
        return self.load_sharded_state_dict(shards)
