"""The gradient reducer: autograd hooks feed buckets, buckets feed allreduces.

One synced forward, at most one reduction (the DDP paper, section 4.2, and
torch's rule). ``prepare`` opens a ``_Step`` for the forward; the step owns
everything that belongs to that reduction, from the forward to the end of its
backward pass, so nothing of one step can leak into the next:

- the first parameter gradient of a backward pass starts the step (a backward
  that reaches no parameter, such as the ``autograd.grad`` of a gradient
  penalty, leaves it waiting);
- each parameter's post-accumulate-grad hook copies its gradient (pre-divided
  by the world size, as torch DDP does) into its bucket slot, and full buckets
  go, strictly in bucket order, to the overlap strategy (``mpidp.overlap``), so
  every rank issues the same collectives in the same order;
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
at the next forward.

A backward that raised part-way leaves its step running. The next
grad-enabled forward finishes it first ("abandons" it): the buckets not yet
launched go out as zeros, and the map carries the failure, so the ranks whose
backward went well raise a clear error from their ``backward()`` instead of
stepping with half-reduced gradients, and every rank is ready for the next
step with its communicators lined up.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import dataclasses
import functools
import itertools
import time
import traceback
from collections.abc import Sequence

import torch

from . import comm as _comm
from . import overlap as _overlap
from . import runtime
from . import shm as _shm
from . import sparse as _sparse
from . import watchdog as _watchdog
from .buckets import Bucket, Shards, assign_buckets
from .hooks import GradBucket
from .kernels import unpack

__all__ = ["Reducer", "ShardedReducer", "find_tensors", "reachable_parameters"]

_ARMED, _RUNNING, _DONE = "armed", "running", "done"
_TIMEOUT_SOURCE = "DistributedDataParallel(timeout=)"
STATS_KEPT = 100


def _bucket_label(step: int, index: int, count: int, buffer: torch.Tensor) -> str:
    """How a stall report names a bucket's allreduce (built only for a report)."""
    size = buffer.numel() * buffer.element_size()
    amount = f"{size / 2**20:.1f} MB" if size >= 2**20 // 10 else f"{size / 1024:.1f} KB"
    return f"DDP step {step} bucket {index}/{count} ({amount})"


def find_tensors(obj) -> list[torch.Tensor]:
    """Return the tensors in a model output, searched as torch's DDP does.

    Tensors, and lists, tuples (named or not), dicts and dataclasses of them,
    nested to any depth.
    """
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return list(itertools.chain.from_iterable(map(find_tensors, obj)))
    if isinstance(obj, dict):
        return list(itertools.chain.from_iterable(map(find_tensors, obj.values())))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return list(itertools.chain.from_iterable(
            find_tensors(getattr(obj, field.name)) for field in dataclasses.fields(obj)))
    return []


def reachable_parameters(outputs: Sequence[torch.Tensor]) -> set[int]:
    """Return the ids of the leaf tensors that the autograd graph of ``outputs`` reaches."""
    found, seen = set(), set()
    stack = []
    for tensor in outputs:
        if tensor.grad_fn is None:
            found.add(id(tensor))
        else:
            stack.append(tensor.grad_fn)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return found


class _Step:
    """The reduction of one synced forward, from ``prepare`` to the end of its backward."""

    __slots__ = ("state", "ready", "pending", "next_launch", "task", "unused", "fired", "counted")

    def __init__(self, count: int, layout: list[list[int]], unused: list[int]):
        self.state = _ARMED
        self.ready = bytearray(count)
        self.pending = [len(members) for members in layout]
        self.next_launch = 0  # the next bucket to hand to the strategy
        # The graph task whose end-of-backward callback is queued and has not run
        # yet (-1: none). If it never runs, that backward raised.
        self.task = -1
        self.unused = unused  # marked ready as soon as the step starts
        self.fired = [0] * count  # post-accumulate-grad hook calls (static_graph)
        self.counted = False  # whether this step has its number (see Reducer._count)


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
        overlap: a strategy name of ``mpidp.overlap`` ("auto" resolved already or not).
        chunk_bytes: largest single allreduce; bigger buckets go in chunks.
        solo_bytes: gradients at least this big skip the buckets and are
            reduced in place (None: never).
        sparse: indices of parameters whose gradients are sparse (never bucketed).
        static_graph: learn in the first step how often each parameter's
            gradient is accumulated per backward (reentrant checkpointing may
            do it several times) and which are unused, then rely on it.
        timeout: seconds each collective of a step may wait before the stall
            watchdog reports it (0: never); None: the process-wide timeout.
    """

    def __init__(self, named_params, pool: _comm.Pool, control, *, bucket_cap_bytes: int,
                 first_bucket_bytes: int, find_unused_parameters: bool,
                 gradient_as_bucket_view: bool, predict_order: bool = True,
                 overlap: str = "auto", chunk_bytes: int = 4 << 20,
                 solo_bytes: int | None = None, sparse: Sequence[int] = (),
                 static_graph: bool = False, timeout: float | None = None,
                 shared: "_shm.Node | None" = None):
        self.names = [name for name, _ in named_params]
        self.timeout = timeout
        self.params = [param for _, param in named_params]
        self.control = control
        self.world = pool.size
        self.strategy = _overlap.make(overlap, pool, chunk_bytes, self.params[0].device)
        self._divisor = self.world  # what gradients are divided by (join(): the active ranks)
        self.comm_hook = None  # (state, hook) of DistributedDataParallel.register_comm_hook
        self._futures: list = []  # (bucket, the hook's future) of the running step
        # Per synced step, the last STATS_KEPT: see DistributedDataParallel.stats().
        self.stats: collections.deque = collections.deque(maxlen=STATS_KEPT)
        self.record = True  # the statistics and the profiler ranges (DDP.record_stats)
        self._first_start: float | None = None
        self._step_bytes = self._step_collectives = 0
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.sparse = sorted(sparse)
        self._dense = [i for i in range(len(self.params)) if i not in set(self.sparse)]
        self._caps = (bucket_cap_bytes, first_bucket_bytes)
        self._solo_bytes = solo_bytes
        self._layout_key = [(param.dtype, param.device) for param in self.params]
        # Shared memory: the CPU buckets live in one mapping the node's ranks share,
        # made anew with each layout (collective, as building one is): see mpidp.shm.
        self._node = shared
        self.window: _shm.Window | None = None
        self._build(self._assign())
        n = len(self.params)
        # counts per parameter, then [failed, step number, its square, joined]
        self._used = torch.zeros(n + 4, dtype=torch.int64)
        self._used_flags = self._used.numpy()
        self._step: _Step | None = None
        self._steps = 0  # this rank's step number, compared across ranks at every step
        self._forward_counted = False
        self._expected: list[int] | None = None  # static_graph: hook calls per backward
        self._error: RuntimeError | None = None
        # Gradient order prediction (the DDP paper's future work, torch's bucket
        # rebuild): record the order gradients arrive in during the first synced
        # backward that succeeds on every rank, then lay the buckets out in rank
        # 0's order, once.
        self._arrival: list[int] | None = [] if predict_order else None
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                       for i, p in enumerate(self.params)]

    # -- layout -----------------------------------------------------------------------

    def _assign(self, order: list[int] | None = None) -> list[list[int]]:
        dense = self._dense
        position = {index: k for k, index in enumerate(dense)}
        if order is not None:
            order = [position[i] for i in order if i in position]
        local = assign_buckets([self.params[i].numel() * self.params[i].element_size() for i in dense],
                               [(self.params[i].dtype, self.params[i].device) for i in dense],
                               *self._caps, order=order, solo_bytes=self._solo_bytes)
        return [[dense[k] for k in members] for members in local]

    def _is_solo(self, members: list[int]) -> bool:
        param = self.params[members[0]]
        return (len(members) == 1 and self._solo_bytes is not None
                and param.numel() * param.element_size() >= self._solo_bytes)

    def _bucket(self, members: list[int]) -> Bucket:
        return Bucket([self.params[i] for i in members], solo=self._is_solo(members))

    def _build(self, layout: list[list[int]]) -> None:
        self.layout = layout
        self.buckets = [self._bucket(members) for members in layout]
        self._position = {id(bucket): k for k, bucket in enumerate(self.buckets)}
        # (bucket, position in it) of each parameter; None: sparse, never bucketed
        self._slot: list[tuple[Bucket, int] | None] = [None] * len(self.params)
        for bucket, members in zip(self.buckets, layout):
            for k, index in enumerate(members):
                self._slot[index] = (bucket, k)
        if self._node is not None:
            self._adopt_window()

    def _slots(self):
        return ((slot if slot is not None else (None, None)) for slot in self._slot)

    def _rebuild_in_arrival_order(self) -> None:
        arrived = set(self._arrival)
        order = self._arrival + [i for i in reversed(range(len(self.params))) if i not in arrived]
        self._arrival = None
        shared = torch.tensor(order, dtype=torch.int64)
        _comm.broadcast(shared, 0, comm=self.control)
        layout = self._assign(shared.tolist())
        if layout == self.layout:
            return
        old_views = [bucket.views[k] if bucket is not None else None for bucket, k in self._slots()]
        self._build(layout)
        if self.as_view:
            for param, old, (bucket, k) in zip(self.params, old_views, self._slots()):
                new = bucket.views[k] if bucket is not None else None
                if old is None or new is None:
                    continue
                if param.grad is not None and param.grad.data_ptr() == old.data_ptr():
                    new.copy_(old)
                    param.grad = new

    def _adopt_window(self) -> None:
        """Move the CPU buckets into one shared mapping (collective, with each layout).

        Every rank has the same layout here, so the same buckets and sizes. A
        gradient that is a bucket view follows its bucket. If any rank cannot
        allocate, every rank keeps its buckets and reduces with MPI from now on.
        The previous layout's mapping goes with the last tensor on it.
        """
        node = self._node
        buckets = [b for b in self.buckets if not b.solo and b.buffer is not None
                   and b.buffer.device.type == "cpu"]
        if not buckets:
            return
        offsets, total = [], 0
        for bucket in buckets:
            offsets.append(total)
            total += -(-bucket.buffer.numel() * bucket.buffer.element_size() // 64) * 64
        window = node.allocate(total)
        if window is None:
            self._node = self.window = self.strategy.window = None
            warnings.warn(f"mpidp: no shared-memory window of {total} bytes could be allocated "
                          f"(is /dev/shm full?); gradients are reduced through MPI",
                          RuntimeWarning, stacklevel=2)
            return
        old_views = [bucket.views[k] if bucket is not None else None for bucket, k in self._slots()]
        for bucket, offset in zip(buckets, offsets):
            moved = window.tensor(offset, bucket.buffer.numel(), bucket.buffer.dtype)
            moved.copy_(bucket.buffer)
            bucket.bind(moved)
        if self.as_view:
            for param, old, (bucket, k) in zip(self.params, old_views, self._slots()):
                if old is not None and param.grad is not None and param.grad.data_ptr() == old.data_ptr():
                    param.grad = bucket.views[k]
        self.window = self.strategy.window = window

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
        step = self._step = _Step(len(self.params), self.layout, [])
        step.state = _RUNNING
        self._count(step)
        self._finish(step, failed=False, joined=True)

    def settle(self) -> None:
        """Finish a step whose backward raised part-way (collective when there is one).

        Called before anything collective of the next forward: the other ranks
        may still be waiting in that step's collectives.
        """
        step = self._step
        if step is None or step.state == _DONE:
            return
        if step.state == _ARMED:
            if step.task == -1:
                return  # no backward went through this forward's outputs yet
            # A backward through the outputs raised before any parameter's
            # gradient: other ranks may have started this step, so take part.
            step.state = _RUNNING
            self._count(step)
        self._finish(step, failed=True)

    def _count(self, step: _Step) -> None:
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
        step = self._step = _Step(len(self.params), self.layout, unused)
        step.counted, self._forward_counted = self._forward_counted, False
        # The outputs' hooks run first in the backward that goes through them,
        # so the end-of-backward callback joins that (outer) backward, even when
        # the parameters' gradients come from reentrant backward calls inside it.
        hook = functools.partial(self._on_output_grad, step)
        for tensor in tensors:
            if tensor.grad_fn is not None:
                tensor.register_hook(hook)

    # -- hooks ------------------------------------------------------------------------

    def _on_output_grad(self, step: _Step, grad) -> None:
        task = torch._C._current_graph_task_id()
        if step is self._step and step.state != _DONE and step.task != task:
            self._queue_end(step, task)

    def _queue_end(self, step: _Step, task: int) -> None:
        step.task = task
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(self._end_of_backward, step, task))

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        self._used_flags[index] = 1
        step = self._step
        if step is None or step.state == _DONE:
            return  # inside no_sync, or a further backward after this forward's reduction
        if step.state == _ARMED:
            self._begin(step)
        step.fired[index] += 1
        if self.static_graph:
            if self._expected is None or step.fired[index] < self._expected[index]:
                return  # first step: learn the counts; later: wait for the last accumulation
        if self._arrival is not None and step.fired[index] == 1:
            self._arrival.append(index)
        if param.grad is not None and param.grad.is_sparse and self._slot[index] is not None:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {self.names[index]!r} received a sparse "
                f"gradient, but only nn.Embedding/nn.EmbeddingBag(sparse=True) parameters are "
                f"expected to; mpidp reduces those by gathering indices and values")
        self._mark_ready(step, index, arrived=True)
        slot = self._slot[index]
        if self.as_view and slot is not None and not slot[0].solo:
            # Free a freshly allocated gradient now (after zero_grad(set_to_none=True)),
            # not at the end of backward: the bucket slice is the gradient from here on.
            param.grad = slot[0].views[slot[1]]
        self.strategy.poll()

    def _begin(self, step: _Step) -> None:
        step.state = _RUNNING
        self._count(step)
        if step.task == -1:  # the outputs' hooks did not queue it (outputs not found)
            self._queue_end(step, torch._C._current_graph_task_id())
        for index in step.unused:
            self._mark_ready(step, index)

    def _mark_ready(self, step: _Step, index: int, arrived: bool = False,
                    zero: bool = False) -> None:
        if step.ready[index]:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {self.names[index]!r} was marked ready "
                f"twice in one backward pass: its gradient was accumulated again after it was "
                f"reduced (a module used twice under reentrant activation checkpointing, or a "
                f"parameter that find_unused_parameters took for unused). Pass "
                f"static_graph=True if the graph is the same at every step.")
        step.ready[index] = 1
        slot = self._slot[index]
        if slot is None:
            return  # sparse: gathered at the end of the backward
        bucket, k = slot
        view = bucket.views[k]
        grad = None if zero else self.params[index].grad
        with torch.no_grad():
            if bucket.solo:
                self._prepare_solo(bucket, self.params[index], grad, arrived)
            elif grad is None:
                view.zero_()
            elif grad.data_ptr() == view.data_ptr():
                if self._scale > 1:
                    view.div_(self._scale)
            else:
                torch.div(grad, self._scale, out=view)
        position = self._position[id(bucket)]
        step.pending[position] -= 1
        if step.pending[position] == 0:
            self._launch_ready(step)

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
            torch.div(grad.reshape(-1), self._scale, out=bucket.spare)
        bucket.buffer = bucket.spare
        bucket.divisor = 1

    def _launch_ready(self, step: _Step) -> None:
        # A bucket ready early waits for the ones before it: every rank must
        # issue the allreduces in the same order.
        while step.next_launch < len(self.buckets) and step.pending[step.next_launch] == 0:
            bucket = self.buckets[step.next_launch]
            step.next_launch += 1
            with _watchdog.Scope(_bucket_label, self._steps, step.next_launch, len(self.buckets),
                                 bucket.buffer, timeout=self.timeout, source=_TIMEOUT_SOURCE):
                self._start(bucket)

    @property
    def _scale(self) -> int:
        # torch's contract: a comm hook receives the local sum and averages itself
        return 1 if self.comm_hook is not None else self._divisor

    def _start(self, bucket: Bucket) -> None:
        if not self.record:
            self._reduce(bucket)
            return
        buffer = bucket.buffer
        size = buffer.numel() * buffer.element_size()
        if self._first_start is None:
            self._first_start = time.perf_counter()
        self._step_bytes += size
        if not torch._C._autograd._profiler_enabled():  # a range costs ~10 us even unobserved
            self._step_collectives += self._reduce(bucket)
            return
        hook = self.comm_hook
        label = (f"mpidp.DDP bucket {self._position[id(bucket)]} {size / 2**20:.2f} MiB "
                 f"{getattr(hook[1], '__name__', 'hook') if hook else 'allreduce'}")
        with torch.profiler.record_function(label):
            self._step_collectives += self._reduce(bucket)

    def _reduce(self, bucket: Bucket) -> int:
        """Hand a bucket to the strategy, or to the hook; returns the collectives (chunks or 1)."""
        hook = self.comm_hook
        buffer = bucket.buffer
        if hook is None:
            self._launch(bucket)
            return max(1, -(-(buffer.numel() * buffer.element_size()) // self.strategy.chunk_bytes))
        position = self._position[id(bucket)]
        members = self.layout[position]
        gradients = (bucket.views if not bucket.solo
                     else [buffer.view(self.params[members[0]].shape)])
        grad_bucket = GradBucket(position, buffer, gradients, [self.params[i] for i in members],
                                 position == len(self.buckets) - 1)
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

    def _launch(self, bucket: Bucket) -> None:
        with self._fatal_on_error():
            self.strategy.start(bucket.buffer, bucket.divisor)

    @contextlib.contextmanager
    def _fatal_on_error(self):
        """Abort the job when the strategy's own reduction raises (more than one rank).

        Raising is not enough: the other ranks are waiting in the bucket
        collectives this rank was issuing (under "thread" the thread also skips
        every later bucket), and whether the failed call had issued its own
        cannot be known, so no later collective can line the ranks up again.
        Seen before this rule, one rank's reduction raising once and caught:
        the other ranks hung under every strategy, or (under "thread", when
        they went on too) one step's buckets met the next step's and the
        models silently diverged (tests/mpi/reduction_fails_on_one_rank.py).
        """
        try:
            yield
        except Exception as error:
            if self.world == 1:
                raise
            why = (f"DistributedDataParallel: the gradient reduction of step {self._steps} "
                   f"failed on this rank while the other ranks wait in its collectives; "
                   f"aborting the MPI job. Traceback:")
            runtime._abort([f"{type(error).__name__}: {error}", why,
                            "".join(traceback.format_exception(error))], 1)

    def _drain(self) -> None:
        """Wait for every reduction of the step: the strategy's, and the hook's futures."""
        with self._fatal_on_error():
            self.strategy.finish()
        futures, self._futures = self._futures, []
        for bucket, future in futures:
            value = future.wait()
            if isinstance(value, (list, tuple)):  # as torch's reducer accepts
                value = value[0]
            if value.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(value.reshape(-1))

    # -- end of a step ----------------------------------------------------------------

    def _end_of_backward(self, step: _Step, task: int) -> None:
        if step.task == task:
            step.task = -1
        if step is self._step and step.state == _RUNNING:
            self._finish(step, failed=False)
        # _ARMED: this backward reached no parameter; the step waits for the next one.

    def _finish(self, step: _Step, failed: bool, joined: bool = False) -> None:
        """Launch what is left, wait for everything, then agree across ranks on the outcome."""
        step.state = _DONE
        n = len(self.params)
        entered = time.perf_counter()
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
            self._used_flags[n:] = (int(failed), self._steps, self._steps ** 2, int(joined))
            with _watchdog.Scope("DDP step {} bookkeeping allreduce", self._steps,
                                 timeout=self.timeout, source=_TIMEOUT_SOURCE):
                used = _comm.iallreduce(self._used, "sum", comm=self.control)
            try:
                self._drain()
            finally:
                counts = used.wait().tolist()
                self._used.zero_()
        done = time.perf_counter()
        first, self._first_start = self._first_start, None
        reduced, self._step_bytes = self._step_bytes, 0
        collectives, self._step_collectives = self._step_collectives, 0
        failed_ranks, total, squares, joined_ranks = counts[n:]
        if failed_ranks or squares * self.world != total * total:
            for bucket in self.buckets:
                if bucket.solo:
                    bucket.buffer = None  # drop this step's gradient
            self._arrival = [] if self._arrival is not None else None
            self._disagreement(failed, failed_ranks)
            return
        if self.record:
            self.stats.append(dict(step=self._steps, bytes=reduced, collectives=collectives + 1,
                                   reduction_s=done - (first if first is not None else entered),
                                   wait_s=done - entered, joined=bool(joined)))
        self._reduce_sparse(counts, joined)
        if not joined:
            self._copy_back(counts)
            if self.static_graph and self._expected is None:
                self._expected = list(step.fired)
            if not self.find_unused and not self.static_graph:
                self._error = self._missing_error(counts, self.world - joined_ranks)
        if self._arrival is not None:
            self._rebuild_in_arrival_order()

    def _disagreement(self, failed: bool, failed_ranks: int) -> None:
        """A rank's backward failed, or the ranks are at different steps: say so on every rank."""
        # Every rank saw the same sums, so every rank takes part in this gather.
        reports = self.control.allgather((failed, self._steps))
        self._steps = max(number for _, number in reports)  # line up for the next step
        bad = [rank for rank, (did_fail, _) in enumerate(reports) if did_fail]
        numbers = {rank: number for rank, (_, number) in enumerate(reports)}
        if len(set(numbers.values())) > 1:
            raise RuntimeError(
                f"DistributedDataParallel: the ranks are not at the same synced backward pass "
                f"(steps by rank: {numbers}): a rank skipped a step (its forward, or its "
                f"backward before reaching this module, raised and the exception was caught), "
                f"or ran a grad-enabled forward in training mode alone (evaluate on one rank "
                f"under torch.no_grad() or in eval mode). The gradients of this step mix "
                f"different steps and must not be used. The step numbers are lined up again, "
                f"but the ranks' loops are not: end the epoch on every rank, or restart.")
        if failed:
            return  # this rank's own exception was raised by its backward already
        raise RuntimeError(
            f"DistributedDataParallel: the backward pass raised on rank(s) {bad} before their "
            f"gradients were reduced, so the gradients of this step are not averaged over "
            f"all ranks and must not be used: call optimizer.zero_grad() and go on with the "
            f"next step on every rank (catch this error where those ranks catch theirs).")

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
        for bucket, members in zip(self.buckets, self.layout):
            if bucket.solo:
                self._copy_back_solo(bucket, members[0], counts[members[0]])
                continue
            targets = []
            for index, view in zip(members, bucket.views):
                param = self.params[index]
                if (self.find_unused or self.static_graph) and counts[index] == 0:
                    targets.append(None)  # unused on every rank: .grad stays as the user left it
                elif self.as_view:
                    if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                        param.grad = view
                    targets.append(None)
                else:
                    if param.grad is None:
                        param.grad = torch.empty_like(view)
                    targets.append(param.grad)
            if all(t is not None for t in targets):
                unpack(bucket.buffer, targets)
            else:
                for target, view in zip(targets, bucket.views):
                    if target is not None:
                        unpack(view.reshape(-1), [target])

    def _copy_back_solo(self, bucket: Bucket, index: int, count: int) -> None:
        param = self.params[index]
        # Drop the reference to this step's spare use, so the next step starts clean.
        buffer, bucket.buffer = bucket.buffer, None
        if buffer is not bucket.spare or ((self.find_unused or self.static_graph) and count == 0):
            return  # reduced in place, or unused everywhere
        if param.grad is None:
            param.grad = bucket.spare.view(param.shape).clone()
        else:
            unpack(bucket.spare, [param.grad])

    def _missing_error(self, counts: list[int], active: int) -> RuntimeError | None:
        missing = [f"{self.names[i]} (missing on {active - c} of {active} ranks)"
                   for i, c in enumerate(counts[:len(self.params)]) if c < active]
        if not missing:
            return None
        return RuntimeError(
            f"DistributedDataParallel: {len(missing)} parameter(s) received no gradient in the "
            f"last backward pass: {', '.join(missing)}. Pass find_unused_parameters=True to "
            f"DistributedDataParallel if parts of the model may not take part in the loss, or "
            f"set requires_grad=False on parameters that never do. This step reduced them "
            f"as zeros (or their earlier .grad) so that no rank hangs.")


class ShardedReducer(Reducer):
    """ZeRO stage 2: each bucket is reduce-scattered into its owners' gradient shards.

    The buckets have no buffer of their own. A bucket takes a flat buffer from
    a free list when its first gradient arrives; each gradient is copied in
    (divided by the world size, as always) and its ``.grad`` is released at
    once; the buffer goes back to the list as soon as the bucket's
    reduce-scatter has returned (the "inline" strategy) or at the end of the
    backward pass (the others). So the full-size gradients alive at any time are
    those of the buckets being filled, not the model's. The bucket layout is
    fixed (reverse registration order, no rebuild) because the optimizer's
    shards follow it: rank ``r`` owns the ``r``-th block of every chunk of every
    bucket (``mpidp.buckets.Shards``).

    After a synced backward every ``param.grad`` is None; ``sink`` (the
    ``ZeroRedundancyOptimizer``) holds this rank's averaged shard:
    ``sink.grad_target(k)`` gives the flat tensor that bucket ``k``'s shard is
    written to, and ``sink.reduced(used)`` is told, per parameter,
    which parameters have a gradient (False: unused on every rank), once the
    ranks agree that the step is good.

    Args:
        sink: the receiver of the shards (see above).
        Otherwise those of ``Reducer``; ``gradient_as_bucket_view`` and
        ``predict_order`` are forced off, and sparse gradients are refused by
        the caller. ``solo_bytes`` gives big gradients a bucket of their own,
        reduce-scattered where they lie when their size divides by the world.
    """

    def __init__(self, named_params, pool, control, *, sink, **options):
        self.sink = sink
        self._spares: list[torch.Tensor] = []
        self._bound: dict[int, tuple[Bucket, torch.Tensor]] = {}
        options.update(gradient_as_bucket_view=False, predict_order=False)
        super().__init__(named_params, pool, control, **options)

    def _bucket(self, members: list[int]) -> Bucket:
        params = [self.params[i] for i in members]
        chunk = max(1, self.strategy.chunk_bytes // params[0].element_size())
        numel = sum(p.numel() for p in params)
        bucket = Bucket(params, shards=Shards(numel, self.world, chunk))
        bucket.key = (params[0].dtype, params[0].device)
        # A gradient alone in its bucket (solo_bytes puts big ones there) needs no
        # padding when its size divides by the world: it is reduce-scattered
        # where it lies, with no copy and no second buffer.
        bucket.direct = len(params) == 1 and numel % self.world == 0
        return bucket

    def _bind(self, bucket: Bucket) -> None:
        dtype, device = bucket.key
        need = bucket.shards.padded
        for k, spare in enumerate(self._spares):
            if spare.dtype == dtype and spare.device == device and spare.numel() >= need:
                base = self._spares.pop(k)
                break
        else:
            base = torch.empty(need, dtype=dtype, device=device)
        bucket.bind(base)
        self._bound[id(bucket)] = (bucket, base)

    def _release(self, bucket: Bucket) -> None:
        bucket, base = self._bound.pop(id(bucket))
        bucket.unbind()
        if base is not None:  # None: the gradient itself, freed with it
            self._spares.append(base)

    def _mark_ready(self, step: _Step, index: int, arrived: bool = False,
                    zero: bool = False) -> None:
        slot = self._slot[index]
        if slot is not None and slot[0].buffer is None and not step.ready[index]:
            grad = self.params[index].grad
            if (slot[0].direct and arrived and not zero and grad is not None
                    and grad.is_contiguous()):
                slot[0].bind(grad.view(-1))  # Reducer._mark_ready divides it in place
                self._bound[id(slot[0])] = (slot[0], None)
            else:
                self._bind(slot[0])
        super()._mark_ready(step, index, arrived, zero)
        if arrived:
            self.params[index].grad = None  # its share is in the bucket now

    def _launch(self, bucket: Bucket) -> None:
        target = self.sink.grad_target(self._position[id(bucket)])
        shards = bucket.shards
        pairs = [(bucket.buffer[start:stop], target[position:position + (stop - start) // self.world])
                 for (start, stop), (_, _, position) in zip(shards.chunks, shards.blocks(0))]
        with self._fatal_on_error():
            self.strategy.start(bucket.buffer, 1, pairs)
        if isinstance(self.strategy, _overlap.Blocking):
            self._release(bucket)  # reduced already: the buffer can serve the next bucket

    def _finish(self, step: _Step, failed: bool, joined: bool = False) -> None:
        try:
            super()._finish(step, failed, joined)
        finally:
            for bucket, _ in list(self._bound.values()):
                self._release(bucket)

    def _copy_back(self, counts: list[int]) -> None:
        # As in Reducer._copy_back: only a parameter unused on every rank (known
        # with find_unused_parameters or static_graph) is left without a gradient.
        known = self.find_unused or self.static_graph
        self.sink.reduced([count > 0 or not known for count in counts[:len(self.params)]])
