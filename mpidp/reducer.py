"""The gradient reducer: autograd hooks feed buckets, buckets feed nonblocking allreduces.

One step, as in the DDP paper (section 4.2): after a synced forward, ``prepare``
arms the reducer; each parameter's post-accumulate-grad hook copies its
gradient (pre-divided by the world size, as torch DDP does) into its bucket
slot; when a bucket's last gradient arrives, buckets are handed strictly in
bucket order to the overlap strategy (``mpidp.overlap``), so every rank issues
the same collectives in the same order. Hooks also let the strategy progress
its requests, because MPI libraries progress nonblocking collectives only inside
MPI calls. At the end of the backward pass an autograd-engine callback waits
for everything and leaves the averaged gradients in ``param.grad``.

Every step also sums a small per-parameter "gradient arrived" map across ranks.
With ``find_unused_parameters=True`` it tells globally unused parameters (whose
``.grad`` is left alone) from locally unused ones; otherwise it detects a
parameter that got no gradient on some rank. Such a parameter's slot is filled
with zeros at the end of the backward so that every bucket is still launched
on every rank (no rank can hang), and the same error is raised on every rank
at the next forward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.utils._pytree import tree_flatten

from . import comm as _comm
from . import overlap as _overlap
from .buckets import Bucket, assign_buckets
from .kernels import unpack

__all__ = ["Reducer"]


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
        overlap: "auto", "inline", "thread" or "nonblocking" (see ``mpidp.overlap``).
        chunk_bytes: largest single allreduce; bigger buckets go in chunks.
        solo_bytes: gradients at least this big skip the buckets and are
            reduced in place (None: never).
    """

    def __init__(self, named_params, pool: _comm.Pool, control, *, bucket_cap_bytes: int,
                 first_bucket_bytes: int, find_unused_parameters: bool,
                 gradient_as_bucket_view: bool, predict_order: bool = True,
                 overlap: str = "auto", chunk_bytes: int = 4 << 20,
                 solo_bytes: int | None = None):
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.control = control
        self.world = pool.size
        self.strategy = _overlap.make(overlap, pool, chunk_bytes, self.params[0].device)
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self._caps = (bucket_cap_bytes, first_bucket_bytes)
        self._solo_bytes = solo_bytes
        self._build(self._assign())
        self._used = torch.zeros(len(self.params), dtype=torch.int32)
        self._used_flags = self._used.numpy()
        self._ready = bytearray(len(self.params))
        self._unused: list[int] = []
        self._sync = False
        self._started = False
        self._next_launch = 0
        self._error: RuntimeError | None = None
        # Gradient order prediction (the DDP paper's future work, torch's bucket
        # rebuild): record the order gradients arrive in during the first synced
        # backward, then lay the buckets out in rank 0's order, once.
        self._arrival: list[int] | None = [] if predict_order else None
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                       for i, p in enumerate(self.params)]

    def _assign(self, order: list[int] | None = None) -> list[list[int]]:
        return assign_buckets([p.numel() * p.element_size() for p in self.params],
                              [(p.dtype, p.device) for p in self.params], *self._caps, order=order,
                              solo_bytes=self._solo_bytes)

    def _is_solo(self, members: list[int]) -> bool:
        param = self.params[members[0]]
        return (len(members) == 1 and self._solo_bytes is not None
                and param.numel() * param.element_size() >= self._solo_bytes)

    def _build(self, layout: list[list[int]]) -> None:
        self.layout = layout
        self.buckets = [Bucket([self.params[i] for i in members], solo=self._is_solo(members))
                        for members in layout]
        self._slot: list[tuple[Bucket, torch.Tensor]] = [None] * len(self.params)
        for bucket, members in zip(self.buckets, layout):
            for index, view in zip(members, bucket.views):
                self._slot[index] = (bucket, view)

    def _rebuild_in_arrival_order(self) -> None:
        arrived = set(self._arrival)
        order = self._arrival + [i for i in reversed(range(len(self.params))) if i not in arrived]
        self._arrival = None
        shared = torch.tensor(order, dtype=torch.int64)
        _comm.broadcast(shared, 0, comm=self.control)
        layout = self._assign(shared.tolist())
        if layout == self.layout:
            return
        old_views = [view for _, view in self._slot]
        self._build(layout)
        if self.as_view:
            for param, old, (_, new) in zip(self.params, old_views, self._slot):
                if old is None or new is None:
                    continue
                if param.grad is not None and param.grad.data_ptr() == old.data_ptr():
                    new.copy_(old)
                    param.grad = new

    def close(self) -> None:
        """Detach the reducer from its parameters and stop its communication thread."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.strategy.close()

    def raise_pending_error(self) -> None:
        """Raise (once) the error the last synced backward found; same on every rank."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def prepare(self, outputs, sync: bool) -> None:
        """Arm the reducer after a forward pass whose outputs are ``outputs``.

        Args:
            outputs: the module's output (any nesting of tensors).
            sync: whether the coming backward pass reduces (False inside ``no_sync``).
        """
        self._sync = sync
        self._started = False
        if not sync:
            return
        for bucket in self.buckets:
            bucket.reset()
        self._ready = bytearray(len(self.params))
        self._next_launch = 0
        if not self.find_unused:
            self._used.zero_()
        tensors = [t for t in tree_flatten(outputs)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.find_unused:
            reached = reachable_parameters(tensors)
            self._unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
        for tensor in tensors:
            if tensor.grad_fn is not None:
                tensor.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad):
        self._begin_backward()

    def _begin_backward(self) -> None:
        if self._started:
            return
        self._started = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        for index in self._unused:
            self._mark_ready(index)

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        self._used_flags[index] = 1
        if not self._sync:
            return
        if self._arrival is not None:
            self._arrival.append(index)
        self._begin_backward()
        self._mark_ready(index, arrived=True)
        if self.as_view and not self._slot[index][0].solo:
            # Free a freshly allocated gradient now (after zero_grad(set_to_none=True)),
            # not at the end of backward: the bucket slice is the gradient from here on.
            param.grad = self._slot[index][1]
        self.strategy.poll()

    def _mark_ready(self, index: int, arrived: bool = False) -> None:
        if self._ready[index]:
            raise RuntimeError(f"parameter {self.names[index]!r} was marked ready twice in one "
                               f"backward pass; run one backward per forward of "
                               f"DistributedDataParallel")
        self._ready[index] = 1
        bucket, view = self._slot[index]
        grad = self.params[index].grad
        with torch.no_grad():
            if bucket.solo:
                self._prepare_solo(bucket, self.params[index], arrived)
            elif grad is None:
                view.zero_()
            elif grad.data_ptr() == view.data_ptr():
                if self.world > 1:
                    view.div_(self.world)
            else:
                torch.div(grad, self.world, out=view)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _prepare_solo(self, bucket: Bucket, param: torch.Tensor, arrived: bool) -> None:
        # A fresh contiguous gradient is reduced where it lies. Anything else (no
        # gradient, a non-contiguous one, or a stale .grad of a parameter that
        # did not take part) goes through a spare buffer and leaves .grad alone.
        grad = param.grad
        if arrived and grad is not None and grad.is_contiguous():
            bucket.buffer = grad.view(-1)
            bucket.divisor = self.world  # divided chunk by chunk by the strategy
            return
        if bucket.spare is None:
            bucket.spare = torch.empty(param.numel(), dtype=param.dtype, device=param.device)
        if grad is None:
            bucket.spare.zero_()
        else:
            torch.div(grad.reshape(-1), self.world, out=bucket.spare)
        bucket.buffer = bucket.spare
        bucket.divisor = 1

    def _launch_ready(self) -> None:
        # A bucket ready early waits for the ones before it: every rank must
        # issue the allreduces in the same order.
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            bucket = self.buckets[self._next_launch]
            self.strategy.start(bucket.buffer, bucket.divisor)
            self._next_launch += 1

    def _finalize(self) -> None:
        for index in range(len(self.params)):
            if not self._ready[index]:
                self._mark_ready(index)
        used = _comm.iallreduce(self._used, "sum", comm=self.control)
        self.strategy.finish()
        counts = used.wait().tolist()
        self._copy_back(counts)
        if not self.find_unused:
            self._error = self._missing_error(counts)
        self._used.zero_()
        self._sync = self._started = False
        if self._arrival is not None:
            self._rebuild_in_arrival_order()

    def _copy_back(self, counts: list[int]) -> None:
        for bucket, members in zip(self.buckets, self.layout):
            if bucket.solo:
                self._copy_back_solo(bucket, members[0], counts[members[0]])
                continue
            targets = []
            for index, view in zip(members, bucket.views):
                param = self.params[index]
                if self.find_unused and counts[index] == 0:
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
        # Drop the reference to this step's gradient, so zero_grad(set_to_none=True)
        # really frees it before the next backward allocates another.
        buffer, bucket.buffer = bucket.buffer, None
        if buffer is not bucket.spare or (self.find_unused and count == 0):
            return  # reduced in place, or unused everywhere
        if param.grad is None:
            param.grad = bucket.spare.view(param.shape).clone()
        else:
            unpack(bucket.spare, [param.grad])

    def _missing_error(self, counts: list[int]) -> RuntimeError | None:
        missing = [f"{self.names[i]} (missing on {self.world - c} of {self.world} ranks)"
                   for i, c in enumerate(counts) if c < self.world]
        if not missing:
            return None
        return RuntimeError(
            f"DistributedDataParallel: {len(missing)} parameter(s) received no gradient in the "
            f"last backward pass: {', '.join(missing)}. Pass find_unused_parameters=True to "
            f"DistributedDataParallel if parts of the model may not take part in the loss, or "
            f"set requires_grad=False on parameters that never do. This step reduced them "
            f"as zeros (or their earlier .grad) so that no rank hangs.")

