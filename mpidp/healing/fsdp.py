"""A heal's state with torch's FSDP2: the model made again, its shards from the copies.

FSDP2 cannot shard a module again over another group, and its shards have no replica. So each
rank keeps, beside its own shards, a partner copy of the previous rank's
(``mpidp.process_group.fsdp.Shards``, exchanged at each step's start in ``Healer.guard()``);
the survivors go back to the newest step of which every one holds its own shards and the next
rank of each lost one that rank's partner copy; the pieces make the whole state of that step,
which is loaded into the model, optimizer and scheduler that ``rebuild`` makes over the
survivors (docs/healing-frameworks.md).
"""

from __future__ import annotations

from mpi4py import MPI

from ..comm import agreement
from ..process_group import fsdp as _fsdp
from .copies import Copies


def _fsdp_common_step(facts: list, lost: list[int], size: int) -> tuple[str | None, int | None]:
    """(why the FSDP2 survivors cannot go on, or None; the step they go back to), from each
    survivor's ``(its old rank, steps it holds its own shards of, steps it holds the previous
    rank's of)`` and the lost ranks' numbers in the old world of ``size`` ranks."""
    neighbours = [rank for rank in lost if (rank + 1) % size in lost]
    if neighbours:
        return (f"ranks {neighbours} and the next of each were lost together: their FSDP2 "
                f"shards had no other copy"), None
    common = set.intersection(*(set(own) for _, own, _ in facts))
    partners = {rank: set(theirs) for rank, _, theirs in facts}
    for rank in lost:
        common &= partners[(rank + 1) % size]
    if not common:
        return (f"no step of which every survivor holds its own FSDP2 shards and the partner "
                f"copies of lost ranks {lost}"), None
    return None, max(common)


def _rebuilt_problem(made, scheduler) -> str | None:
    """What is wrong with ``rebuild()``'s ``made`` (None: nothing; local)."""
    if not isinstance(made, tuple) or len(made) != 3:
        return f"got {type(made).__name__} {made!r:.80}"
    model, optimizer, new_scheduler = made
    if not _fsdp.is_fsdp(model):
        return f"its model is a {type(model).__name__}, not torch's FSDP2 (fully_shard)"
    if (new_scheduler is None) != (scheduler is None):
        return (f"its scheduler must be None exactly where the Checkpointer's is, got "
                f"{type(new_scheduler).__name__} for {type(scheduler).__name__}")
    if new_scheduler is not None and getattr(new_scheduler, "optimizer", None) is not optimizer:
        return "its scheduler must schedule the optimizer it returns"
    return _fsdp.problem(model, optimizer)


class FsdpShards:
    """The state of a run whose model is torch's FSDP2 (see the module's docstring).

    Args:
        copies: this rank's step-start copies, made with ``fsdp=`` the model's ``Shards``.
        rebuild: the Healer's ``rebuild``: makes ``(model, optimizer, scheduler)`` again over
            the default group of the moment.
    """

    label = "FSDP2"

    def __init__(self, copies: Copies, rebuild):
        self.copies = copies
        self.rebuild = rebuild

    def step(self, world: MPI.Intracomm, lost: list[int], size: int, rank: int,
             joining: bool) -> tuple[str | None, int | None]:
        """The newest step of which every survivor holds its own shards and the next rank of
        each lost one that rank's partner copy, or why there is none (collective over
        ``world``; ``lost``: the lost ranks' numbers in the old world of ``size`` ranks,
        ``rank`` this rank's there)."""
        own = self.copies.steps()
        theirs = [copy["position"][0] for copy in self.copies.kept
                  if copy["fsdp"]["theirs"] is not None]
        _, verdict = agreement.judged(world, (rank, own, theirs),
                                      lambda facts: _fsdp_common_step(facts, lost, size),
                                      "Healer: which FSDP2 shards does each survivor hold?")
        return verdict

    def take(self, world: MPI.Intracomm, steps: int, lost: list[int], rank: int,
             joining: bool) -> None:
        """Make the FSDP2 model and optimizer again with ``rebuild`` and load into them the
        whole state of ``steps``, from the survivors' shards and the lost ranks' partner
        copies (collective); the rest of that step's state from this rank's own copy."""
        copies = self.copies
        c = copies.checkpointer
        snapshot = copies.of_step(steps)
        copies.snapshot = None
        shards = snapshot["fsdp"]
        size = shards["size"]
        mine = [(rank, shards["mine"].cpu())]
        if (rank - 1) % size in lost:
            mine.append(((rank - 1) % size, shards["theirs"].cpu()))
        pieces = agreement.watched_allgather(world, mine, "Healer: the FSDP2 shards' states")
        model_state, optimizer_state = _fsdp.whole_state(
            shards, dict(piece for part in pieces for piece in part))
        made, error = None, None
        try:
            made = self.rebuild()
            problem = _rebuilt_problem(made, c.scheduler)
            if problem:
                raise ValueError(f"Healer: rebuild() must return (model, optimizer, scheduler) "
                                 f"over the survivors: {problem}")
        except Exception as caught:  # noqa: BLE001 (every survivor raises the first one's)
            error = caught
        agreement.agree(world, error, "Healer: did rebuild() make the FSDP2 model on every rank?")
        model, optimizer, scheduler = made
        _fsdp.load(model, optimizer, model_state, optimizer_state)
        c.model, c.optimizer, c.scheduler = model, optimizer, scheduler
        copies.fsdp = _fsdp.Shards(model, optimizer)
        copies.restore(snapshot)  # the scheduler, generators, position... into the new ones
        return None
