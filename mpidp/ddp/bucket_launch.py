"""Handing ready buckets to communication, in bucket order, and waiting for them.

``BucketLauncher`` is the part of a ``mpidp.ddp.reducer.Reducer`` between a full
bucket and its reduced values: buckets go out strictly in bucket order (a
bucket ready early waits for the ones before it, so every rank issues the
same collectives in the same order), each to the reducer's launch (the overlap
strategy, ``mpidp.ddp.overlap``) or to the registered comm hook, with its bytes
and collectives counted for ``DistributedDataParallel.stats()`` and a profiler
range when one is recording; ``drain`` waits for all of them at the end of
the backward. A reduction that raises on one rank aborts the job, because
the other ranks already wait in its collectives (``fatal_on_error``).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable

import torch

from .. import errors as _errors
from .. import exits
from .. import watchdog as _watchdog
from . import overlap as _overlap
from .buckets import Bucket
from ..comm import chunking as _chunking
from ..hooks.basics import GradBucket
from .layout import BucketLayout
from .step import Step

__all__ = ["TIMEOUT_SOURCE", "BucketLauncher"]

TIMEOUT_SOURCE = "DistributedDataParallel(timeout=)"  # where a stall report says the timeout came from


def _bucket_label(step: int, index: int, count: int, size: int) -> str:
    """How a stall report names a bucket's allreduce of ``size`` bytes (built only for a report)."""
    amount = f"{size / 2**20:.1f} MB" if size >= 2**20 // 10 else f"{size / 1024:.1f} KB"
    return f"DDP step {step} bucket {index}/{count} ({amount})"


class BucketLauncher:
    """Launches the ready buckets of a step in bucket order, counts them, and drains them.

    Args:
        layout: the reducer's buckets (read at each launch: a rebuild replaces them).
        strategy: the overlap strategy (its chunk size, and ``finish`` in ``drain``).
        launch: ``launch(bucket)`` starts a bucket's reduction when no comm hook is
            registered (the reducer's, which a subclass may change).
        world: the number of ranks.
        timeout: seconds each bucket's collectives may wait before the stall watchdog
            reports them (0: never; None: the process-wide timeout).
    """

    def __init__(self, layout: BucketLayout, strategy: _overlap._Strategy, *,
                 launch: Callable[[Bucket], None], world: int, timeout: float | None):
        self.layout = layout
        self.strategy = strategy
        self.launch = launch
        self.world = world
        self.timeout = timeout
        self.comm_hook = None  # (state, hook) of DistributedDataParallel.register_comm_hook
        self.record = True  # the statistics and the profiler ranges (DDP.record_stats)
        self._futures: list = []  # (bucket, the hook's future) of the running step
        # This step's, for stats(): when the first bucket started, its bytes and collectives
        self._first_start: float | None = None
        self._bytes = self._collectives = 0
        # The seconds this step's bucket starts took on the calling thread: under "inline"
        # and with a comm hook they wait for the other ranks (mpidp.ddp.stragglers counts it).
        self._launch_s = 0.0

    def launch_ready(self, step: Step, number: int) -> None:
        """Start the buckets of ``step`` (the ``number``-th) that are full, in bucket order."""
        buckets = self.layout.buckets
        for position in step.order.startable():
            bucket = buckets[position]
            began = time.perf_counter()
            with _watchdog.Scope(_bucket_label, number, position + 1, len(buckets),
                                 bucket.buffer.nbytes, timeout=self.timeout, source=TIMEOUT_SOURCE):
                self._start(bucket)
            self._launch_s += time.perf_counter() - began

    def take_launch_s(self) -> float:
        """The seconds the bucket starts took since the last call (local)."""
        launched, self._launch_s = self._launch_s, 0.0
        return launched

    def take_counts(self) -> tuple[float | None, int, int]:
        """This step's (first start's ``perf_counter``, bytes, collectives); starts the next."""
        counts = (self._first_start, self._bytes, self._collectives)
        self._first_start, self._bytes, self._collectives = None, 0, 0
        return counts

    def _start(self, bucket: Bucket) -> None:
        if not self.record:
            self._reduce(bucket)
            return
        buffer = bucket.buffer
        size = buffer.numel() * buffer.element_size()
        if self._first_start is None:
            self._first_start = time.perf_counter()
        self._bytes += size
        if not torch._C._autograd._profiler_enabled():  # a range costs ~10 us even unobserved
            self._collectives += self._reduce(bucket)
            return
        hook = self.comm_hook
        label = (f"mpidp.DDP bucket {self.layout.position[id(bucket)]} {size / 2**20:.2f} MiB "
                 f"{getattr(hook[1], '__name__', 'hook') if hook else 'allreduce'}")
        with torch.profiler.record_function(label):
            self._collectives += self._reduce(bucket)

    def _reduce(self, bucket: Bucket) -> int:
        """Hand a bucket to the strategy, or to the hook; returns the collectives (chunks or 1)."""
        hook = self.comm_hook
        buffer = bucket.buffer
        if hook is None:
            self.launch(bucket)
            per_chunk = _chunking.chunk_numel(self.strategy.chunk_bytes, buffer.element_size())
            return max(1, -(-buffer.numel() // per_chunk))  # as chunking.pieces cuts it
        layout = self.layout
        position = layout.position[id(bucket)]
        members = layout.members[position]
        gradients = (bucket.views if not bucket.solo
                     else [buffer.view(layout.params[members[0]].shape)])
        grad_bucket = GradBucket(position, buffer, gradients, [layout.params[i] for i in members],
                                 position == len(layout.buckets) - 1)
        future = hook[1](hook[0], grad_bucket)
        if not isinstance(future, torch._C.Future):
            raise TypeError(f"a comm hook must return a torch.futures.Future, "
                            f"{getattr(hook[1], '__name__', hook[1])!r} returned "
                            f"{type(future).__name__}")
        # One bucket's hook at a time: a hook that chains collectives in its
        # future's callbacks (torch's PowerSGD does) would otherwise issue
        # them from another thread interleaved with the next bucket's, in an
        # order that differs between ranks.
        future.wait()
        self._futures.append((bucket, future))
        return 1

    @contextlib.contextmanager
    def fatal_on_error(self, number: int):
        """Abort the job when step ``number``'s own reduction raises (more than one rank).

        Raising is not enough: the other ranks are waiting in the bucket
        collectives this rank was issuing (under "thread" the thread also skips
        every later bucket), and whether the failed call had issued its own
        cannot be known, so no later collective can line the ranks up again.
        Seen before this rule, one rank's reduction raising once and caught:
        the other ranks hung under every strategy, or (under "thread", when
        they went on too) one step's buckets met the next step's and the
        models silently diverged (tests/mpi/reduction_fails_on_one_rank.py).

        A lost rank (``mpidp.errors.lost_rank``, ULFM only) is raised instead: every
        survivor's collectives with it fail too, and ``mpidp.Healer`` revokes them all.
        """
        try:
            yield
        except Exception as error:
            if self.world == 1 or _errors.lost_rank(error):
                raise
            why = (f"DistributedDataParallel: the gradient reduction of step {number} "
                   f"failed on this rank while the other ranks wait in its collectives; "
                   f"aborting the MPI job. Traceback:")
            exits._abort([f"{type(error).__name__}: {error}", why,
                          "".join(traceback.format_exception(error))], 1)

    def drain(self, number: int) -> None:
        """Wait for every reduction of step ``number``: the strategy's, and the hook's futures."""
        with self.fatal_on_error(number):
            self.strategy.finish()
        futures, self._futures = self._futures, []
        for bucket, future in futures:
            value = future.wait()
            if isinstance(value, (list, tuple)):  # as torch's reducer accepts
                value = value[0]
            if value.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(value.reshape(-1))
