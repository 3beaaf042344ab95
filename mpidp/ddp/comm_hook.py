"""How a DistributedDataParallel's buckets are communicated: its comm hook and its statistics.

``register_comm_hook`` replaces the buckets' allreduce with the user's hook
(torch's contract; mpidp's hooks are in ``mpidp.hooks``), checked alike on
every rank; ``stats()`` and ``record_stats`` report what the last synced
steps communicated (``mpidp.ddp.bucket_launch`` counts it).

``CommHookMixin`` is that part of ``DistributedDataParallel``. It has no
constructor; the DDP provides ``module``, ``control``, ``reducer``,
``_comm_hook``, ``_sink`` and ``_connect()``.
"""

from __future__ import annotations

from mpi4py import MPI

from .. import _args
from ..comm.agreement import decide

__all__ = ["CommHookMixin"]


class CommHookMixin:
    """``register_comm_hook``, ``record_stats`` and ``stats()`` (a mixin of the DDP)."""

    def register_comm_hook(self, state: object, hook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` instead of the allreduce (collective).

        torch's contract: ``hook`` returns a ``torch.futures.Future`` whose
        value is the bucket's averaged flat tensor; it is called once per
        bucket, in bucket order, with ``bucket`` a ``mpidp.hooks.GradBucket``
        holding the local sum of the gradients (not yet divided: the hook
        averages). Register once, on every rank, before the first synced
        backward. mpidp's hooks are in ``mpidp.hooks``; torch's
        (``torch.distributed.algorithms.ddp_comm_hooks``) work with a process
        group of the "mpidp" backend as ``state``. Sparse gradients keep being
        gathered without the hook.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        if self.reducer is None:
            self._connect(MPI.COMM_WORLD, next(self.module.parameters()).device)
        problem = None
        if self._comm_hook is not None:
            problem = "register_comm_hook can only be called once (as in torch)"
        elif self._options["reproducible"]:
            problem = ("a comm hook cannot reduce the buckets of a DistributedDataParallel"
                       "(reproducible=True), which sums them in micro-batch order")
        elif self._sink is not None:
            problem = ("a comm hook cannot reduce the buckets of a stage-2 "
                       "ZeroRedundancyOptimizer, which reduce-scatters them")
        elif self.reducer.stats or (self.reducer._step is not None
                                    and self.reducer._step.state != "armed"):
            problem = ("register_comm_hook must be called before the first backward (as torch "
                       "requires): buckets were already reduced another way")
        name = f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"
        decide(self.control, (name, problem), _judge_hooks, "register_comm_hook's check")
        self._comm_hook = (state, hook)
        self.reducer.comm_hook = self._comm_hook

    @property
    def record_stats(self) -> bool:
        """Whether ``stats()`` records and each bucket gets a profiler range (default True)."""
        return getattr(self, "_record_stats", True)

    @record_stats.setter
    def record_stats(self, value: bool) -> None:
        _args.check_bool("record_stats", value)
        self._record_stats = value
        if self.reducer is not None:
            self.reducer.record = value

    def stats(self) -> list[dict]:
        """What the last synced steps (up to 100) communicated, oldest first.

        Each step: ``step`` (its number), ``bytes`` (of the buckets reduced),
        ``collectives`` (bucket collectives, counting chunks, or hook calls,
        plus the bookkeeping allreduce), ``reduction_s`` (from the first bucket
        handed to communication to the last reduction done), ``wait_s``
        (how long the end of the backward pass waited for communication) and
        ``lateness_ms`` (per rank, how many ms after the earliest rank it
        reached the end of this step's backward, the same list on every rank;
        None until the next synced step carries it, and where any rank joined
        or failed, or ``MPIDP_STRAGGLER_MS=0``; ``mpidp.ddp.stragglers``).
        Recorded unless ``record_stats`` is False: a few clock reads and a
        profiler range per bucket (bench/hooks_bench.py measures the cost).
        """
        return [] if self.reducer is None else [dict(entry) for entry in self.reducer.stats]

    def stragglers(self) -> dict[int, float]:
        """The ranks named as stragglers now: rank -> its median lateness in ms.

        A rank is named when its ``lateness_ms`` exceeded ``MPIDP_STRAGGLER_MS``
        at more than half of the last ``MPIDP_STRAGGLER_STEPS`` measured steps,
        and stays named until it is late at half of them or fewer; rank 0 logs a
        warning (logger ``mpidp.stragglers``) once per such episode. The same on
        every rank; local (no communication).
        """
        tracker = None if self.reducer is None else self.reducer.stragglers
        return {} if tracker is None else dict(tracker.named)


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
