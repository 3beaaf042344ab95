"""The gradient reducer: autograd hooks feed buckets, buckets feed allreduces.

One synced forward, at most one reduction (the DDP paper, section 4.2, and
torch's rule). ``prepare`` opens a ``Step`` for the forward; the step owns
everything that belongs to that reduction, from the forward to the end of its
backward pass, so nothing of one step can leak into the next:

- the first parameter gradient of a backward pass starts the step (a backward
  that reaches no parameter, such as the ``autograd.grad`` of a gradient
  penalty, leaves it waiting);
- each parameter's post-accumulate-grad hook puts its gradient into its bucket
  slot, divided by the world size before the sum as torch DDP does: copied at
  once, or with the bucket's others in one call when the last one arrives
  (``mpidp.ddp.packing``); full buckets go, strictly in bucket order, to the
  overlap strategy (``mpidp.ddp.overlap``), so every rank issues the same
  collectives in the same order;
- an autograd-engine callback at the end of that backward waits for everything
  and leaves the averaged gradients in ``param.grad``; the step is then done,
  and any further backward through the same outputs accumulates locally,
  without communication, as in torch.

Every step also sums a small per-parameter "gradient arrived" map across
ranks, with three more numbers: whether the rank's backward failed, and the
step's sequence number and its square (the ranks are at the same step exactly
when the sum of squares is the square of the sum over the world size). With
``find_unused_parameters=True`` the map tells globally unused parameters (whose
``.grad`` is left alone) from locally unused ones; otherwise it detects a
parameter that got no gradient on some rank. Such a parameter's slot is filled
with zeros at the end of the backward so that every bucket is still launched
on every rank (no rank can hang), and the same error is raised on every rank
at the next forward. The same sum carries each rank's wait at the end of the
step before, from which every rank learns how late each rank arrives
(``mpidp.ddp.stragglers``).

A backward that raised part-way leaves its step running. The next
grad-enabled forward finishes it first ("abandons" it): the buckets not yet
launched go out as zeros, and the map carries the failure, so the ranks whose
backward went well raise a clear error from their ``backward()`` instead of
stepping with half-reduced gradients, and every rank is ready for the next
step with its communicators lined up.

This module holds the protocol (the hooks, the step's life and the
bookkeeping). The reducer holds two parts, each owning its state: its
``layout`` (``mpidp.ddp.layout.BucketLayout``: the buckets and each parameter's
slot) and its ``launcher`` (``mpidp.ddp.bucket_launch.BucketLauncher``: the
in-order launch, its counts, and the wait for it). Beside it are
``mpidp.ddp.step`` (a step's state and the output search), ``mpidp.ddp.outcome``
(the copy back into ``.grad`` and the errors the ranks agree on) and
``mpidp.ddp.sharded`` (ZeRO stage 2's ``ShardedReducer``, also reachable here).
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from collections.abc import Sequence

import torch

from .. import comm as _comm
from . import compiled as _compiled
from . import outcome as _outcome
from . import overlap as _overlap
from . import packing as _packing
from .. import preemption as _preemption
from ..comm import shm as _shm
from . import sparse as _sparse
from .. import watchdog as _watchdog
from .buckets import Bucket
from ..comm import chunking as _chunking
from .bucket_launch import TIMEOUT_SOURCE, BucketLauncher
from .layout import BucketLayout
from .stragglers import Stragglers
from .step import ARMED, DONE, RUNNING, Step, find_tensors, reachable_parameters

__all__ = ["Reducer", "find_tensors", "reachable_parameters"]

STATS_KEPT = 100


class Reducer:
    """Averages the gradients of ``params`` across the ranks of ``pool`` during backward.

    Args:
        named_params: (name, parameter) pairs, each requiring grad, no duplicates.
        pool: the communicators that carry bucket allreduces; its size is the world size.
        control: a communicator of the same ranks for the reducer's small
            collectives (never used by the strategy's thread).
        bucket_cap_bytes: bucket capacity.
        first_bucket_bytes: capacity of the first bucket of each dtype.
        find_unused_parameters: search the graph after each synced forward.
        gradient_as_bucket_view: leave ``.grad`` as a view into the bucket.
        predict_order: rebuild the buckets once, in rank 0's observed gradient order.
        overlap: a strategy name of ``mpidp.ddp.overlap`` ("auto" resolved already or not).
        chunk_bytes: largest single allreduce; bigger buckets go in chunks
            (None: ``mpidp.comm.chunking.chunk_bytes()``, from ``MPIDP_CHUNK_MB``).
        solo_bytes: gradients at least this big skip the buckets and are
            reduced in place (None: never).
        sparse: indices of parameters whose gradients are sparse (never bucketed).
        static_graph: learn in the first step how often each parameter's
            gradient is accumulated per backward (reentrant checkpointing may
            do it several times) and which are unused, then rely on it.
        timeout: seconds each collective of a step may wait before the stall
            watchdog reports it (0: never); None: the process-wide timeout.
        stragglers: ``(threshold_ms, steps, share)`` of ``mpidp.ddp.stragglers`` (threshold 0:
            lateness is neither measured nor carried); equal on every rank.
    """

    def __init__(self, named_params, pool: _comm.Pool, control, *, bucket_cap_bytes: int,
                 first_bucket_bytes: int, find_unused_parameters: bool,
                 gradient_as_bucket_view: bool, predict_order: bool = True,
                 overlap: str = "auto", chunk_bytes: int | None = None,
                 solo_bytes: int | None = None, sparse: Sequence[int] = (),
                 static_graph: bool = False, timeout: float | None = None,
                 shared: "_shm.Node | None" = None,
                 stragglers: tuple[float, int, float] = (0, 1, 0.0)):
        self.names = [name for name, _ in named_params]
        self.timeout = timeout
        self.params = [param for _, param in named_params]
        self.control = control
        self.world = pool.size
        if chunk_bytes is None:
            chunk_bytes = _chunking.chunk_bytes()
        self.strategy = _overlap.make(overlap, pool, chunk_bytes, self.params[0].device)
        self._divisor = self.world  # what gradients are divided by (join(): the active ranks)
        # Per synced step, the last STATS_KEPT: see DistributedDataParallel.stats().
        self.stats: collections.deque = collections.deque(maxlen=STATS_KEPT)
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.sparse = sorted(sparse)
        self._layout_key = [(param.dtype, param.device) for param in self.params]
        # Shared memory: the CPU buckets live in one mapping the node's ranks share,
        # made anew with each layout (collective, as building one is): see mpidp.comm.shm.
        self.layout = BucketLayout(
            self.params, [i for i in range(len(self.params)) if i not in set(self.sparse)],
            cap_bytes=bucket_cap_bytes, first_cap_bytes=first_bucket_bytes,
            solo_bytes=solo_bytes, make_bucket=self._bucket, as_view=gradient_as_bucket_view,
            control=control, strategy=self.strategy, node=shared)
        self.layout.build(self.layout.assign())
        self.launcher = BucketLauncher(self.layout, self.strategy, launch=self._launch,
                                       world=self.world, timeout=timeout)
        n = len(self.params)
        # counts per parameter, then [failed, step number, its square, joined, stop
        # requested], then one slot per rank for its last wait and one for the step's time
        # (stragglers)
        threshold_ms, steps, share = stragglers
        self.stragglers = (Stragglers(control.Get_rank(), self.world, threshold_ms, steps, share)
                           if threshold_ms > 0 else None)
        extra = self.world + Stragglers.SLOTS_BEYOND_RANKS if self.stragglers else 0
        self._used = torch.zeros(n + 5 + extra, dtype=torch.int64)
        self._used_flags = self._used.numpy()
        # Preemption rides on the bookkeeping (mpidp.preemption): how many ranks had
        # a stop requested when the last one was summed, and how many were summed.
        self.stop_votes = 0
        self.bookkeeping_count = 0
        self._step: Step | None = None
        self._steps = 0  # this rank's step number, compared across ranks at every step
        self._forward_counted = False
        self._expected: list[int] | None = None  # static_graph: hook calls per backward
        self._error: RuntimeError | None = None
        # Gradient order prediction (the DDP paper's future work, torch's bucket
        # rebuild): record the order gradients arrive in during the first synced
        # backward that succeeds on every rank, then lay the buckets out in rank
        # 0's order, once.
        self._arrival: list[int] | None = [] if predict_order else None
        key = _compiled.register(self)  # compiled autograd traces the hooks (ddp/compiled.py)
        self._hooks = [p.register_post_accumulate_grad_hook(
            functools.partial(_compiled.grad_hook, self._on_grad, key, i))
            for i, p in enumerate(self.params)]

    # -- public -----------------------------------------------------------------------

    def close(self) -> None:
        """Detach the reducer from its parameters and stop its communication thread (local)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.strategy.close()

    def raise_pending_error(self) -> None:
        """Raise (once) the error the last synced backward found; same on every rank."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def check_parameters(self) -> None:
        """Raise if a parameter changed dtype or device since the buckets were built (local)."""
        for name, param, (dtype, device) in zip(self.names, self.params, self._layout_key):
            if param.dtype != dtype or param.device != device:
                raise RuntimeError(
                    f"DistributedDataParallel: parameter {name!r} is now {param.dtype} on "
                    f"{param.device}, but its gradient bucket was built for {dtype} on {device}; "
                    f"the module was converted after DistributedDataParallel wrapped it. "
                    f"Convert through the wrapper (ddp.to(...), ddp.double(), ...), which "
                    f"rebuilds the buckets on every rank, or wrap the converted module.")

    def set_divisor(self, divisor: int) -> None:
        """Divide the coming steps' gradients by ``divisor`` (default: the world size)."""
        self._divisor = divisor

    def shadow(self) -> None:
        """Stand in, with zeros, for a synced step of the other ranks (collective; join()).

        Issues exactly the collectives of a real step, in the same order: every
        bucket, then the per-step bookkeeping (which tells the others that this
        rank has joined, so its zeros are not taken for missing gradients),
        then the sparse gathers and the order rebuild where a step does them.
        """
        self.settle()
        step = self._step = Step(len(self.params), self.layout.members, [])
        step.state = RUNNING
        self._count(step)
        self._finish(step, failed=False, joined=True)

    def settle(self) -> None:
        """Finish a step whose backward raised part-way (collective when there is one).

        Called before anything collective of the next forward: the other ranks
        may still be waiting in that step's collectives.
        """
        step = self._step
        if step is None or step.state == DONE:
            return
        if step.state == ARMED:
            if step.task == -1:
                return  # no backward went through this forward's outputs yet
            # A backward through the outputs raised before any parameter's
            # gradient: other ranks may have started this step, so take part.
            step.state = RUNNING
            self._count(step)
        self._finish(step, failed=True)

    def _count(self, step: Step) -> None:
        if not step.counted:
            step.counted = True
            self._steps += 1

    def count_forward(self) -> None:
        """Number the coming synced forward in training mode (call before the module runs).

        A step gets its number here, so that a forward or a backward that
        raised on some ranks still counts there, and the ranks that skipped it
        are found at the next step; or, outside training mode, when it starts,
        so that evaluation through the wrapper on one rank counts nothing.
        """
        self._steps += 1
        self._forward_counted = True

    def prepare(self, outputs, sync: bool) -> None:
        """Arm the reducer after a forward pass whose outputs are ``outputs``.

        Args:
            outputs: the module's output (tensors in any nesting ``find_tensors`` searches).
            sync: whether the coming backward pass reduces (False inside ``no_sync``).
        """
        self.settle()
        if not sync:
            self._step = None  # gradients accumulate locally
            return
        if not self.find_unused:
            self._used.zero_()
        tensors = [t for t in find_tensors(outputs) if t.requires_grad]
        unused: list[int] = []
        if self._expected is not None:
            unused = [i for i, count in enumerate(self._expected) if count == 0]
        elif self.find_unused and not self.static_graph:
            reached = reachable_parameters(tensors)
            unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
        step = self._step = Step(len(self.params), self.layout.members, unused)
        step.counted, self._forward_counted = self._forward_counted, False
        # The outputs' hooks run first in the backward that goes through them,
        # so the end-of-backward callback joins that (outer) backward, even when
        # the parameters' gradients come from reentrant backward calls inside it.
        hook = functools.partial(self._on_output_grad, step)
        for tensor in tensors:
            if tensor.grad_fn is not None:
                tensor.register_hook(hook)

    # -- hooks ------------------------------------------------------------------------

    def _on_output_grad(self, step: Step, grad) -> None:
        if torch.compiler.is_compiling():
            return  # traced by compiled autograd: each gradient's hook reduces it
        task = torch._C._current_graph_task_id()
        if step is self._step and step.state != DONE and step.task != task:
            self._queue_end(step, task)

    def _queue_end(self, step: Step, task: int) -> None:
        compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")  # never imported here
        if compiled_autograd is not None and (compiled_autograd.compiled_autograd_enabled
                                              or compiled_autograd.in_compiled_autograd_region):
            raise RuntimeError(  # a hook that dynamo could not trace runs eagerly in there
                "mpidp.DistributedDataParallel: compiled autograd ran a gradient hook outside "
                "its graph, and an eager step needs an end-of-backward callback, which compiled "
                "autograd allows only in one full graph (docs/ddp.md, \"Compiled autograd\")")
        step.task = task
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(self._end_of_backward, step, task))

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        self._used_flags[index] = 1
        step = self._step
        if step is None or step.state == DONE:
            return  # inside no_sync, or a further backward after this forward's reduction
        if step.state == ARMED:
            self._begin(step)
        step.fired[index] += 1
        if self.static_graph:
            if self._expected is None or step.fired[index] < self._expected[index]:
                return  # first step: learn the counts; later: wait for the last accumulation
        if self._arrival is not None and step.fired[index] == 1:
            self._arrival.append(index)
        slot = self.layout.slot[index]
        if param.grad is not None and param.grad.is_sparse and slot is not None:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {self.names[index]!r} received a sparse "
                f"gradient, but only nn.Embedding/nn.EmbeddingBag(sparse=True) parameters are "
                f"expected to; mpidp reduces those by gathering indices and values")
        self._mark_ready(step, index, arrived=True)
        if self.as_view and slot is not None and not slot[0].solo:
            # Free a freshly allocated gradient now (after zero_grad(set_to_none=True)),
            # not at the end of backward: the bucket slice is the gradient from here on.
            param.grad = slot[0].views[slot[1]]
        self.strategy.poll()

    def _begin(self, step: Step) -> None:
        step.state = RUNNING
        self._count(step)
        if step.task == -1:  # the outputs' hooks did not queue it (outputs not found)
            self._queue_end(step, torch._C._current_graph_task_id())
        for index in step.unused:
            self._mark_ready(step, index)

    def _mark_ready(self, step: Step, index: int, arrived: bool = False,
                    zero: bool = False) -> None:
        if step.ready[index]:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {self.names[index]!r} was marked ready "
                f"twice in one backward pass: its gradient was accumulated again after it was "
                f"reduced (a module used twice under reentrant activation checkpointing, or a "
                f"parameter that find_unused_parameters took for unused). Pass "
                f"static_graph=True if the graph is the same at every step.")
        step.ready[index] = 1
        slot = self.layout.slot[index]
        if slot is None:
            return  # sparse: gathered at the end of the backward
        bucket, k = slot
        view = bucket.views[k]
        grad = None if zero else self.params[index].grad
        position = self.layout.position[id(bucket)]
        each = bucket.packing == _packing.EACH  # else copied, then divided by the strategy
        with torch.no_grad():
            if bucket.solo:
                self._prepare_solo(bucket, self.params[index], grad, arrived)
            elif grad is None:
                view.zero_()
            elif grad.data_ptr() == view.data_ptr():
                if each:
                    _chunking.divide(view, self._scale)
            elif each:
                _chunking.divided(grad, self._scale, out=view)
            else:
                step.copies[position].append((k, grad))
        if step.order.arrived(position):
            if not bucket.solo:
                _packing.pack(bucket, step.copies[position])
                step.copies[position].clear()  # no gradient outlives its step here
                bucket.divisor = 1 if each else self._scale
            self._launch_ready(step)

    def _launch_ready(self, step: Step) -> None:
        self.launcher.launch_ready(step, self._steps)

    def _bucket(self, members: list[int], solo: bool) -> Bucket:
        """The bucket of parameters ``members`` (the layout's ``make_bucket``)."""
        return Bucket([self.params[i] for i in members], solo=solo)

    def _launch(self, bucket: Bucket) -> None:
        """Start a full bucket's reduction (the launcher's ``launch``, without a comm hook)."""
        with self.launcher.fatal_on_error(self._steps):
            self.strategy.start(bucket.buffer, bucket.divisor)

    def _prepare_solo(self, bucket: Bucket, param: torch.Tensor, grad, arrived: bool) -> None:
        # A fresh contiguous gradient is reduced where it lies. Anything else (no
        # gradient, a non-contiguous one, or a stale .grad of a parameter that
        # did not take part) goes through a spare buffer and leaves .grad alone.
        if arrived and grad is not None and grad.is_contiguous():
            bucket.buffer = grad.view(-1)
            bucket.divisor = self._scale  # divided chunk by chunk by the strategy
            return
        if bucket.spare is None:
            bucket.spare = torch.empty(param.numel(), dtype=param.dtype, device=param.device)
        if grad is None:
            bucket.spare.zero_()
        else:
            _chunking.divided(grad.reshape(-1), self._scale, out=bucket.spare)
        bucket.buffer = bucket.spare
        bucket.divisor = 1

    @property
    def _scale(self) -> int:
        # torch's contract: a comm hook receives the local sum and averages itself
        return 1 if self.launcher.comm_hook is not None else self._divisor

    # -- end of a step ----------------------------------------------------------------

    def _end_of_backward(self, step: Step, task: int) -> None:
        if step.task == task:
            step.task = -1
        if step is self._step and step.state == RUNNING:
            self._finish(step, failed=False)
        # ARMED: this backward reached no parameter; the step waits for the next one.

    def _finish(self, step: Step, failed: bool, joined: bool = False) -> None:
        """Launch what is left, wait for everything, then agree across ranks on the outcome."""
        step.state = DONE
        n = len(self.params)
        entered = time.perf_counter()
        launched = self.launcher.take_launch_s()  # the starts before this wait
        try:
            if self.static_graph and self._expected is None and not (failed or joined):
                # first static step: nothing was marked in the hooks
                for index in range(n):
                    if step.fired[index] and not step.ready[index]:
                        self._mark_ready(step, index, arrived=True)
            for index in range(n):
                if not step.ready[index]:
                    self._mark_ready(step, index, zero=failed or joined)
        finally:
            if joined:
                self._used_flags[:n] = 0
            self._used_flags[n:n + 5] = (int(failed), self._steps, self._steps ** 2,
                                         int(joined), int(_preemption.requested()))
            if self.stragglers is not None:
                self.stragglers.fill(self._used_flags[n + 5:])
            with _watchdog.Scope("DDP step {} bookkeeping allreduce", self._steps,
                                 timeout=self.timeout, source=TIMEOUT_SOURCE):
                used = _comm.iallreduce(self._used, "sum", comm=self.control)
            try:
                self.launcher.drain(self._steps)
            finally:
                summed = used.wait()
                counts = summed[:n + 5].tolist()
                waits = summed[n + 5:].numpy().copy() if self.stragglers else None
                self._used.zero_()
        done = time.perf_counter()
        self.launcher.take_launch_s()  # the starts inside this wait are counted in it
        first, reduced, collectives = self.launcher.take_counts()
        failed_ranks, total, squares, joined_ranks, self.stop_votes = counts[n:n + 5]
        self.bookkeeping_count += 1
        agreed = not failed_ranks and squares * self.world == total * total
        # this rank's wait for the others: its blocking bucket starts, then this end
        waited = launched + done - entered
        self._note_lateness(waits, waited if agreed and not joined_ranks else None)
        if not agreed:
            for bucket in self.layout.buckets:
                if bucket.solo:
                    bucket.buffer = None  # drop this step's gradient
            self._arrival = [] if self._arrival is not None else None
            self._steps, error = _outcome.disagreement(self.control, failed, self._steps)
            if error is not None:
                raise error
            return
        if self.launcher.record:
            self.stats.append(dict(step=self._steps, bytes=reduced, collectives=collectives + 1,
                                   reduction_s=done - (first if first is not None else entered),
                                   wait_s=done - entered, joined=bool(joined),
                                   lateness_ms=None))
        self._reduce_sparse(counts, joined)
        if not joined:
            self._copy_back(counts)
            if self.static_graph and self._expected is None:
                self._expected = list(step.fired)
            if not self.find_unused and not self.static_graph:
                self._error = _outcome.missing_error(self.names, counts,
                                                         self.world - joined_ranks)
        if self._arrival is not None:
            arrival, self._arrival = self._arrival, None
            self.layout.rebuild(arrival)

    def _note_lateness(self, summed, wait_s: float | None) -> None:
        """Take the ranks' waits at the last step from this step's sum; keep this step's."""
        if self.stragglers is None:
            return
        measured = self.stragglers.read(summed)
        self.stragglers.waited(self._steps, wait_s)
        if measured is not None and self.stats and self.stats[-1]["step"] == measured[0]:
            self.stats[-1]["lateness_ms"] = measured[1].tolist()

    def _reduce_sparse(self, counts: list[int], joined: bool) -> None:
        for index in self.sparse:
            if self.find_unused and counts[index] == 0:
                continue
            param = self.params[index]
            average = _sparse.allreduce_average(None if joined else param.grad, param,
                                                comm=self.control, divisor=self._divisor)
            if not joined:
                param.grad = average

    def _copy_back(self, counts: list[int]) -> None:
        _outcome.copy_back(self.params, self.layout.buckets, self.layout.members, counts,
                           known_unused=self.find_unused or self.static_graph,
                           as_view=self.as_view)
