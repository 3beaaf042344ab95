"""``hvd.DistributedOptimizer``: gradients averaged over the ranks, started during backward.

Horovod's semantics: each parameter's gradient hook counts down
``backward_passes_per_step``; when it reaches 0 the gradient is ready to be
reduced. ``step()`` calls ``synchronize()`` first, which starts what has not
started (a parameter without a gradient gets zeros), waits for everything and
writes the results into ``p.grad``; ``with optimizer.skip_synchronize():``
lets a script that called ``synchronize()`` itself (to clip gradients, say)
step without a second one. Accumulated gradients are summed over the passes,
then averaged over the ranks, as in Horovod.

**Order.** Horovod's coordinator negotiates which gradients every rank has
ready. mpidp decides from facts every rank shares instead, with mpidp DDP's
bucket scheduler: the gradients are grouped into buckets in a fixed order
(``mpidp.ddp.layout.BucketLayout``: reverse registration order, which the
backward pass roughly follows, up to ``HOROVOD_FUSION_THRESHOLD`` bytes, default
mpidp DDP's 25 MiB after a 1 MiB first bucket; or the ``groups`` given), checked
alike on every rank of the set, and bucket ``b`` starts only once all of its
gradients are ready and every bucket before it has started
(``mpidp.ddp.buckets.LaunchOrder``). So every rank starts the same allreduces in
the same order, whatever order its hooks fire in.

**Speed.** A bucket's gradients go into its flat buffer in one call
(``mpidp.ddp.packing``) and come back in one (``mpidp.kernels.unpack``). A bucket
is still negotiated like any hvd allreduce (so ``hvd.join`` serves it), but where
no rank has joined its CPU data are reduced at once the way mpidp DDP reduces its
buckets (``mpidp.ddp.overlap``'s inline strategy): the fused buffers live in a
window of the node's shared memory (``mpidp.comm.shm``) where the set's ranks
share nodes, and a buffer outside it (one large gradient) goes through MPI chunk
by chunk.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import warnings
from numbers import Real

import torch

from .. import _args
from ..comm import agreement as _agreement
from ..ddp import overlap as _overlap
from ..ddp import packing as _packing
from ..ddp.buckets import Bucket, LaunchOrder
from ..ddp.layout import BucketLayout
from ..comm import chunking as _chunking
from ..kernels import unpack
from . import adasum as _adasum
from . import healing as _healing
from . import process_sets as _sets
from . import requests as _requests
from . import settings as _settings
from .compression import Compression
from .collectives import sparse_allreduce_async
from .reductions import (Adasum, Average, Sum, bucket_allreduce_async_, grouped_allreduce_async_,
                         resolve_op)

__all__ = ["DistributedOptimizer"]


def _names(optimizer, named_parameters) -> dict:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"allreduce.noname.{k}" for k, p in enumerate(params)}
    named = list(named_parameters)
    if not all(isinstance(item, tuple) and len(item) == 2 for item in named):
        raise ValueError("named_parameters must be a list of (name, parameter) tuples, "
                         "such as model.named_parameters()")
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(duplicates)}")
    by_id = {id(p): name for name, p in named}
    unnamed = [k for k, p in enumerate(params) if id(p) not in by_id]
    if unnamed:
        raise ValueError(f"named_parameters was given, but the optimizer's parameters number(s) "
                         f"{unnamed} (in param_groups order) are not in it")
    return {p: by_id[id(p)] for p in params}


def _check_groups(groups, params: list) -> list[list[int]] | None:
    """Buckets from ``groups`` (an int: that many equal groups; a list of parameter lists)."""
    if groups is None or groups == 0:
        return None
    order = list(reversed(range(len(params))))
    if _args.is_int(groups):
        if groups < 0:
            raise ValueError(f"groups must be None, an int >= 0 or a list of parameter lists, "
                             f"got {groups}")
        count = min(groups, len(order))
        return [order[k * len(order) // count:(k + 1) * len(order) // count]
                for k in range(count)]
    index = {id(p): k for k, p in enumerate(params)}
    buckets, seen = [], set()
    for group in groups:
        members = [index.get(id(p)) for p in group]
        if None in members or seen.intersection(members) or len(set(members)) != len(members):
            raise ValueError("groups must be lists of the optimizer's parameters that need "
                             "gradients, each in one group at most")
        seen.update(members)
        buckets.append(sorted(members, reverse=True))
    buckets.extend([k] for k in order if k not in seen)
    first = {k: position for position, k in enumerate(order)}
    return sorted(buckets, key=lambda members: first[members[0]])


def _digest(rows: list) -> str:
    """A short digest of ``rows``, the same in every process (``hash`` of a str is not)."""
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


def _first_difference(tables: list[list[tuple]]) -> ValueError | None:
    """The error naming the first parameter (in bucket order) whose bucket, dtype or size is
    not the same on every rank; None where only names or devices differ. Each table holds a
    rank's ``(name, bucket, dtype, numel)`` rows."""
    for k in range(max(len(table) for table in tables)):
        rows = [table[k][1:] if k < len(table) else None for table in tables]
        if all(row == rows[0] for row in rows):
            continue
        described = [f"{table[k][0]}: {table[k][2]}, {table[k][3]} elements, bucket "
                     f"{table[k][1]}" if k < len(table) else "no such parameter"
                     for table in tables]
        return ValueError(
            f"hvd.DistributedOptimizer: every rank of the process set must bucket the same "
            f"parameters alike (the same parameters in the same order, with the same dtypes "
            f"and sizes, the same groups and HOROVOD_FUSION_THRESHOLD); parameter {k} in "
            f"bucket order differs: {_agreement.by_rank(described)}")
    return None


class _DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer: its ``param_groups``, ``state`` and methods are the wrapped one's."""

    def __init__(self, optimizer, names, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set):
        # No Optimizer.__init__: the wrapped optimizer keeps its groups and state.
        self._optimizer = optimizer
        self._names, self._compression = names, compression
        self._passes, self._op = backward_passes_per_step, op
        self._predivide, self._sparse_as_dense = gradient_predivide_factor, sparse_as_dense
        self._process_set, self._groups = process_set, groups
        self._lock = threading.Lock()
        self._hooks = []
        self._should_synchronize, self._synchronized = True, False
        self._layout()
        _healing.track(self)  # laid out again over the survivors of a heal

    # the wrapped optimizer's attributes
    param_groups = property(lambda self: self._optimizer.param_groups,
                            lambda self, value: setattr(self._optimizer, "param_groups", value))
    state = property(lambda self: self._optimizer.state,
                     lambda self, value: setattr(self._optimizer, "state", value))
    defaults = property(lambda self: self._optimizer.defaults,
                        lambda self, value: setattr(self._optimizer, "defaults", value))

    def __getattr__(self, name):
        if name == "_optimizer":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def __repr__(self) -> str:
        return f"hvd.DistributedOptimizer({self._optimizer!r})"

    def _layout(self) -> None:
        for hook in self._hooks:
            hook.remove()
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        # HOROVOD_FUSION_THRESHOLD=0 (no fusion): a cap of 1 byte puts each gradient alone
        cap = max(_settings.fusion_threshold(_chunking.DEFAULTS.bucket_cap), 1)
        sizes = _chunking.Sizes.of(bucket_cap_mb=cap / _chunking.MB)
        included = self._process_set.included()
        self._params = params
        self._strategy = (_overlap.InlineStrategy(self._process_set.data, sizes.chunk)
                          if included else None)
        layout = BucketLayout(params, range(len(params)), cap_bytes=sizes.bucket_cap,
                              first_cap_bytes=sizes.first_bucket, solo_bytes=None,
                              make_bucket=self._bucket, as_view=False,
                              control=self._process_set.control, strategy=self._strategy,
                              node=None)
        members = _check_groups(self._groups, params) or layout.assign()
        for indices in members:
            if len({(params[k].dtype, params[k].device) for k in indices}) > 1:
                raise ValueError("a group of parameters must share one dtype and device, got "
                                 + ", ".join(f"{self._names[params[k]]}: {params[k].dtype} on "
                                             f"{params[k].device}" for k in indices))
        layout.build(members)
        self._buckets = layout
        self._bucket_of = {id(params[k]): b for b, indices in enumerate(members) for k in indices}
        if included:
            self._share(self._agree_on_layout())
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in params]
        self._reset()

    def _bucket(self, members: list[int], solo: bool) -> Bucket:
        """The bucket of parameters ``members`` (the layout's ``make_bucket``): a parameter
        alone in its bucket is reduced in its own ``.grad``, without a flat buffer."""
        return Bucket([self._params[k] for k in members], solo=len(members) == 1)

    def _agree_on_layout(self) -> bool:
        """Check that every rank of the set bucketed its parameters alike (collective over the
        set); return whether their CPU fused buffers are alike too (one window holds them).

        Every rank must reduce the same buckets: ranks that differ (another model, other
        ``groups`` or ``HOROVOD_FUSION_THRESHOLD``) would reduce mismatched buffers.
        CPU buffers may still differ where a rank keeps its parameters on a GPU; they
        then stay private and go through MPI.

        Raises:
            ValueError: on every rank of the set, naming the first parameter that differs.
        """
        layout = self._buckets
        params = [layout.params[k] for indices in layout.members for k in indices]
        rows = [(b, str(layout.params[k].dtype), layout.params[k].numel())
                for b, indices in enumerate(layout.members) for k in indices]
        cpu = [(str(bucket.buffer.dtype), bucket.buffer.numel()) for bucket in layout.buckets
               if not bucket.solo and bucket.buffer.device.type == "cpu"]
        summaries = _agreement.decide_alike(
            self._process_set.comm, (_digest(rows), _digest(cpu)),
            lambda: [(self._names[p], *row) for p, row in zip(params, rows)],
            _first_difference, "hvd.DistributedOptimizer layout")
        return bool(cpu) and all(theirs == summaries[0][1] for _, theirs in summaries)

    def _share(self, alike: bool) -> None:
        """Put the CPU fused buffers in one shared mapping of the set's node (collective over the set).

        ``alike``: every rank of the set has the same CPU buffers (``_agree_on_layout``,
        over the whole set, not the node: ``allocate()`` is collective across nodes too,
        so every rank of the set takes the same way on from here). Where they differ
        or no mapping could be made, the buffers stay private and go through MPI.
        """
        node = self._process_set.shared_node() if alike else None
        if node is not None:
            self._buckets.share(node)

    def _reset(self) -> None:
        self._delay = {id(p): self._passes for p in self._params}
        self._order = LaunchOrder(self._buckets.members)
        self._handles: dict[int, tuple] = {}
        self._sparse: list[tuple] = []  # (parameter, result of sparse_allreduce_async)
        self._densified: list[torch.Tensor] = []  # sparse gradients reduced as dense
        self._hooked = False  # a hook ran since the last synchronize

    def _count(self, param: torch.Tensor) -> bool:
        """Count one backward pass of ``param`` (under the lock); whether its gradient is ready."""
        key = id(param)
        self._hooked = True
        if self._delay[key] <= 0:
            raise RuntimeError(
                f"the gradient of {self._names[param]} was computed more than "
                f"backward_passes_per_step ({self._passes}) times before step(); raise "
                f"backward_passes_per_step to accumulate gradients locally")
        self._delay[key] -= 1
        return self._delay[key] == 0

    def _hook(self, param: torch.Tensor) -> None:
        with self._lock:
            if self._count(param) and self._order.arrived(self._bucket_of[id(param)]):
                for b in self._order.startable():
                    self._start(b)

    @property
    def _parameter_names(self) -> dict:
        """Each parameter's name (Horovod's attribute): from ``named_parameters`` or generated."""
        return self._names

    def _gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The dense gradient to reduce; None for a sparse one reduced as sparse (``_start``)."""
        if param.grad is None:  # unused here; another rank may have one
            param.grad = torch.zeros_like(param)
        elif param.grad.is_sparse:
            if not self._sparse_as_dense:
                return None
            self._densified.append(param)  # sparse again once reduced, as in Horovod
            param.grad = param.grad.to_dense()
        return param.grad

    def _members(self, b: int) -> list[torch.Tensor]:
        return [self._params[k] for k in self._buckets.members[b]]

    def _start(self, b: int) -> None:
        if not self._process_set.included():
            return
        bucket, members = self._buckets.buckets[b], self._members(b)
        grads = [self._gradient(p) for p in members]
        for param, grad in zip(members, grads):
            if grad is None:  # as Horovod: an allgather of its indices and values
                self._sparse.append((param, sparse_allreduce_async(
                    param.grad, self._names[param], self._op, self._process_set)))
        if bucket.solo:
            if grads[0] is None:
                return
            tensor = grads[0]
        else:
            _packing.pack(bucket, [(k, grad) for k, grad in enumerate(grads) if grad is not None])
            for view, grad in zip(bucket.views, grads):
                if grad is None:
                    view.zero_()
            tensor = bucket.buffer
        compressed, context = self._compression.compress(tensor)
        scales = (1 / self._predivide, self._predivide) if self._op == Average else (1.0, 1.0)
        handle = bucket_allreduce_async_(compressed, self._strategy, self._names[members[0]],
                                         self._op, scales[0], scales[1], self._process_set)
        self._handles[b] = (handle, context)

    def _copy_back(self, b: int, result: torch.Tensor) -> None:
        """Write bucket ``b``'s reduced values (``result``, flat) into its dense gradients."""
        members = self._members(b)
        if self._buckets.buckets[b].solo:
            if result is not members[0].grad:
                members[0].grad.copy_(result.view_as(members[0].grad))
            return
        grads = [p.grad for p in members]
        if not any(grad.is_sparse for grad in grads):
            unpack(result, grads)
            return
        for grad, piece in zip(grads, result.split([p.numel() for p in members])):
            if not grad.is_sparse:  # reduced by itself (_start)
                unpack(piece, [grad])

    def synchronize(self) -> None:
        """Start the reductions not started yet, wait for all, and write the results into ``p.grad``."""
        with self._lock:
            for b in self._order.startable(all_left=True):
                self._start(b)
            try:
                for b, (handle, context) in self._handles.items():
                    self._copy_back(b, self._compression.decompress(_requests.synchronize(handle),
                                                                    context))
                for param, result in self._sparse:
                    param.grad = result()
                for param in self._densified:
                    param.grad = param.grad.to_sparse()
            finally:
                self._reset()
            self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within it, ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize (unless within ``skip_synchronize``), then step the wrapped optimizer."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): the gradients are reduced twice. "
                              "Step inside `with optimizer.skip_synchronize():`", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._optimizer.step(closure) if closure is not None else self._optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; refused while reductions of them are pending."""
        if self._hooked:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(): the pending "
                               "reductions would write into the zeroed gradients")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the wrapped optimizer; its parameters get hooks and buckets too."""
        if self._hooked:
            raise RuntimeError("add_param_group while gradient reductions are pending: call "
                               "step() or synchronize() first")
        self._optimizer.add_param_group(param_group)
        for k, p in enumerate(param_group["params"] if isinstance(
                param_group["params"], (list, tuple)) else [param_group["params"]]):
            self._names.setdefault(p, f"allreduce.noname.group{len(self.param_groups)}.{k}")
        self._layout()

    def state_dict(self):
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._optimizer.load_state_dict(state_dict)


class _AdasumOptimizer(_DistributedOptimizer):
    """``op=hvd.Adasum``: Horovod's delta optimizer. The wrapped optimizer steps on this
    rank's own gradients; what it changed in each parameter (the delta) is combined over
    the ranks by adaptive summation (``adasum``, each parameter with its own
    coefficients, bucket by bucket) and added to the parameter as it was before the step.

    Horovod steps each parameter inside the backward pass as its gradient is ready;
    here the whole step runs in ``synchronize()`` (what ``step()`` calls), after the
    backward pass: the same result for optimizers whose update of a parameter depends
    on that parameter alone (SGD, Adam and the like), with no overlap of the exchange
    and the backward pass.
    """

    def _hook(self, param: torch.Tensor) -> None:
        with self._lock:
            self._count(param)  # backward_passes_per_step's check; nothing starts

    def _share(self, alike: bool) -> None:
        """No shared fused buffers: the deltas go through grouped_allreduce (every rank alike)."""

    def synchronize(self) -> None:
        """Step the wrapped optimizer on this rank's gradients and combine the deltas."""
        with self._lock:
            try:
                if not self._process_set.included():  # as the other ops: this rank's own step
                    self._optimizer.step()
                    return
                with torch.no_grad():
                    before = {id(p): p.detach().clone() for p in self._params}
                    self._optimizer.step()
                    for b in range(len(self._buckets.members)):
                        members = self._members(b)
                        olds = [before[id(p)] for p in members]
                        packed = [self._compression.compress(p.detach() - old)
                                  for p, old in zip(members, olds)]
                        reduced = _requests.synchronize(grouped_allreduce_async_(
                            [delta for delta, _ in packed], op=Adasum,
                            name=f"adasum.{self._names[members[0]]}",
                            process_set=self._process_set))
                        for p, old, delta, (_, context) in zip(members, olds, reduced, packed):
                            p.copy_(old.add_(self._compression.decompress(delta, context)))
            finally:
                self._reset()
            self._synchronized = True

    def step(self, closure=None):
        """Synchronize (unless within ``skip_synchronize``): the step is taken there."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): with op=hvd.Adasum the step is "
                              "taken twice. Step inside `with optimizer.skip_synchronize():`",
                              stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return loss


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,  # noqa: N802 (Horovod's name)
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=_sets.global_process_set):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over the ranks.

    Args:
        optimizer: a torch optimizer, built over the model's parameters on every rank alike.
        named_parameters: ``model.named_parameters()``, to name the reductions (optional).
        compression: ``hvd.Compression.none``, ``fp16`` or ``bf16`` (or a ``Compressor``).
        backward_passes_per_step: backward passes accumulated locally per ``step()``.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum`` (Horovod's delta
            optimizer: the wrapped optimizer's changes are combined by adaptive summation;
            a power of 2 ranks).
        gradient_predivide_factor: with ``Average``, divide by it before the sum and by
            size / it after.
        num_groups: deprecated spelling of ``groups=int``.
        groups: an int (that many equal groups of parameters, each one message) or a list
            of lists of parameters, each reduced as one message.
        sparse_as_dense: reduce sparse gradients as dense ones (they are sparse again
            after); otherwise as Horovod does, by ``sparse_allreduce_async``.
        process_set: the ranks to average over (default: all).

    Returns:
        An optimizer (a ``torch.optim.Optimizer``) that wraps ``optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is a DistributedOptimizer already; wrap the torch optimizer once")
    op = resolve_op(op, None)
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"op must be hvd.Average, hvd.Sum or hvd.Adasum for DistributedOptimizer, "
                         f"got {op!r}")
    _args.check_int("backward_passes_per_step", backward_passes_per_step, minimum=1)
    if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, Real) \
            or gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be a number > 0, "
                         f"got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1 and op != Average:
        raise ValueError(f"gradient_predivide_factor must be 1 unless op=hvd.Average, "
                         f"got {gradient_predivide_factor} with op=hvd.Sum")
    _args.check_bool("sparse_as_dense", sparse_as_dense)
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"compression must be hvd.Compression.none, .fp16, .bf16 or a "
                        f"Compressor, got {compression!r}")
    if num_groups and groups is not None:
        raise ValueError("give groups or the deprecated num_groups, not both")
    if not isinstance(process_set, _sets.ProcessSet) or process_set.process_set_id is None:
        raise ValueError(f"process_set must be a registered hvd.ProcessSet, got {process_set!r}")
    if op == Adasum and process_set.included():
        _adasum.check_size(process_set.data.Get_size())
    wrapper = _AdasumOptimizer if op == Adasum else _DistributedOptimizer
    return wrapper(optimizer, _names(optimizer, named_parameters), compression,
                                 backward_passes_per_step, op, gradient_predivide_factor,
                                 groups if groups is not None else num_groups,
                                 sparse_as_dense, process_set)
