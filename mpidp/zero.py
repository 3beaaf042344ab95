"""ZeRO over MPI: sharded optimizer states (stage 1) and gradients (stage 2).

``ZeroRedundancyOptimizer`` has torch's interface: give it the parameters, a
``torch.optim`` class and that class's arguments, and use it as that
optimizer. Each rank keeps the optimizer state of about ``1/N`` of the
parameters' elements, steps that part, and the ranks then allgather the
updated parameters (stage 1, ZeRO's P_os). With ``stage=2`` (DeepSpeed's
name) the ``mpidp.DistributedDataParallel`` that reduces these parameters
reduce-scatters each gradient bucket instead of allreducing it, so each rank
also keeps only its part of the gradients (ZeRO's P_os+g); see
``mpidp.reducer.ShardedReducer``.

How the elements are divided (``mpidp.buckets.Shards``): the parameters are
laid end to end in flat buffers ("buckets", by dtype; in stage 2 the DDP's own
gradient buckets), each padded to a multiple of the world size and cut into
chunks; rank ``r`` owns the ``r``-th block of every chunk. So a rank's share is
the same within a few elements for any model, even one of a single huge
tensor, and a tensor may be split between ranks. The parameters become views
into those flat buffers (torch's ``parameters_as_bucket_view``), so the
allgather writes the updated values where the model reads them, with no copy.

Splitting a tensor is exact only for an optimizer whose update of an element
depends on that element alone (SGD, Adam, AdamW, Adagrad, RMSprop, ...): each
class is tried on a small tensor, whole and in two pieces, when the optimizer
is built, and a class whose results differ (LBFGS, Adafactor, ...) is refused.
"""

from __future__ import annotations

import array
import glob
import os
import re
import weakref
from collections.abc import Iterable, Sequence

import torch
from mpi4py import MPI

from . import comm as _comm
from . import watchdog as _watchdog
from .buckets import Shards, assign_buckets

__all__ = ["ZeroRedundancyOptimizer"]

_MB = 1024 * 1024
_FORMAT = "mpidp.ZeroRedundancyOptimizer/1"
_FILE = re.compile(r"zero-rank(\d+)-of-(\d+)\.pt$")


def _agree(comm: MPI.Intracomm, error: BaseException | None) -> None:
    """Raise on every rank if ``error`` is set on any: the lowest failing rank's, with its type.

    One 4-byte allreduce when no rank failed (``step()`` pays it every
    iteration: measured 6-7 us at 2 ranks on the 2-core CI machine, against
    ~800 us for the step of a 517-parameter Adam); the errors travel only
    when one did. The type that travels is the nearest built-in one (a class
    of the user's may not unpickle elsewhere), and the message names the
    original type where they differ.
    """
    failed = array.array("i", [error is not None])
    slot = _watchdog.begin("ZeroRedundancyOptimizer's error agreement (allreduce)")
    try:
        comm.Allreduce(MPI.IN_PLACE, [failed, MPI.INT], MPI.MAX)
    finally:
        slot.current = None
    if not failed[0]:
        return
    report = None
    if error is not None:
        kind = next(k for k in type(error).__mro__ if k.__module__ == "builtins")
        prefix = "" if kind is type(error) else f"{type(error).__name__}: "
        report = (kind, prefix + str(error))
    reports = comm.allgather(report)
    failed_ranks = [rank for rank, entry in enumerate(reports) if entry is not None]
    kind, message = reports[failed_ranks[0]]
    if len(failed_ranks) < len(reports):
        message += f" (found on rank(s) {failed_ranks})"
    try:
        agreed = kind(message)
    except Exception:  # a built-in type that wants more arguments (UnicodeDecodeError...)
        agreed = RuntimeError(f"{kind.__name__}: {message}")
    raise agreed from error


def _elementwise_keys(optimizer_class: type, defaults: dict, dtype: torch.dtype,
                      device: torch.device) -> frozenset[str]:
    """Check that ``optimizer_class`` updates a tensor's pieces as it updates the whole.

    Returns:
        The state keys that hold one value per element (``exp_avg``...); the
        others (``step``...) are one value per tensor.

    Raises:
        ValueError: the class cannot step a piece on its own, or its result differs.
    """
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    generator = torch.Generator().manual_seed(1234)
    shape, cut = (4, 6), 7
    start = torch.randn(shape, generator=generator, dtype=torch.float64)
    grads = [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(3)]
    if not dtype.is_floating_point:
        dtype = torch.float32
    whole = start.to(dtype=dtype, device=device)
    parts = [whole.reshape(-1)[:cut].clone(), whole.reshape(-1)[cut:].clone()]
    whole = whole.clone()
    try:
        one, two = optimizer_class([whole], **defaults), optimizer_class(parts, **defaults)
    except (TypeError, ValueError) as error:
        arguments = ", ".join(f"{key}={value!r}" for key, value in defaults.items())
        raise type(error)(f"{name}({arguments}) raised {type(error).__name__}: {error}") from None
    try:
        for grad in grads:
            grad = grad.to(dtype=dtype, device=device)
            whole.grad = grad.clone()
            parts[0].grad, parts[1].grad = grad.reshape(-1)[:cut].clone(), grad.reshape(-1)[cut:].clone()
            one.step()
            two.step()
    except Exception as error:
        raise ValueError(
            f"optimizer_class {name} cannot step a piece of a tensor on its own, as "
            f"ZeroRedundancyOptimizer does (trying it raised {type(error).__name__}: {error}); "
            f"it needs an optimizer with per-parameter state and an elementwise update, such "
            f"as torch.optim.SGD, Adam or AdamW") from None
    joined = torch.cat(parts).to(torch.float64)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    if not torch.allclose(joined, whole.reshape(-1).to(torch.float64), rtol=tolerance, atol=tolerance):
        difference = (joined - whole.reshape(-1).to(torch.float64)).abs().max().item()
        raise ValueError(
            f"optimizer_class {name} does not update each element on its own: stepping a "
            f"tensor in two pieces gave results up to {difference:.3g} away from stepping it "
            f"whole, so sharding it by elements (ZeroRedundancyOptimizer) would change the "
            f"training; use an optimizer with per-parameter state and an elementwise update "
            f"(SGD, Adam, AdamW, Adagrad, RMSprop, ...)")
    if any(not any(key is part for part in parts) for key in two.state):
        raise ValueError(
            f"optimizer_class {name} keeps state under keys other than its parameters, so "
            f"ZeroRedundancyOptimizer cannot tell which rank's shard it belongs to; it needs an "
            f"optimizer with per-parameter state (optimizer.state[param])")
    state = two.state.get(parts[0], {})
    return frozenset(key for key, value in state.items()
                     if isinstance(value, torch.Tensor) and value.shape == parts[0].shape)


class _Bucket:
    """Parameters laid end to end in one flat buffer, and this rank's pieces of it."""

    def __init__(self, members: list[int], params: Sequence[torch.Tensor], shards: Shards,
                 rank: int, sharded: bool):
        self.members = members  # indices into the optimizer's parameter list
        self.shards = shards
        self.sharded = sharded  # gradients come reduce-scattered from the DDP (stage 2)
        self.grad: torch.Tensor | None = None  # stage 2: this rank's gradient shard
        self.clean = True  # grad holds nothing to accumulate onto
        self.scratch: torch.Tensor | None = None
        first = params[0]
        self.flat = torch.zeros(shards.padded, dtype=first.dtype, device=first.device)
        self.views, offset = [], 0
        with torch.no_grad():
            for param in params:
                view = self.flat[offset:offset + param.numel()].view(param.shape)
                view.copy_(param)
                param.data = view
                self.views.append(view)
                offset += param.numel()
        offsets = [sum(p.numel() for p in params[:k]) for k in range(len(params))]
        # (member, start, stop, position in the shard, the piece: a view of flat)
        self.pieces = [(members[k], start, stop, position,
                        self.flat[offsets[k] + start:offsets[k] + stop])
                       for k, start, stop, position in shards.pieces(rank, [p.numel() for p in params])]

    def gather(self, comm: MPI.Intracomm, rank: int) -> None:
        """Bring every rank's updated blocks into ``flat`` (in place, chunk by chunk; collective)."""
        for (start, stop), (low, high, _) in zip(self.shards.chunks, self.shards.blocks(rank)):
            _comm.allgather(self.flat[start:stop], self.flat[low:high], comm=comm)


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """An optimizer whose state is sharded across the ranks (ZeRO stage 1, or 2 with a DDP).

    torch's ``ZeroRedundancyOptimizer`` interface: ``step()``, ``zero_grad()``,
    ``state_dict()`` after ``consolidate_state_dict(to)``, ``load_state_dict()``
    of a whole (torch-format) state dict on every rank, ``add_param_group()``,
    ``param_groups`` that LR schedulers can change. Construction,
    ``step``, ``consolidate_state_dict``, ``add_param_group``,
    ``clip_grad_norm_`` and the sharded save and load are collective.

    Args:
        params: tensors or param groups, as for any torch optimizer; all on one
            device (the CPU or this rank's GPU), identical on every rank.
        optimizer_class: the ``torch.optim.Optimizer`` subclass each rank runs
            on its shard; its update must be elementwise (checked).
        process_group: an mpi4py communicator (the same as ``comm``).
        parameters_as_bucket_view: accepted; mpidp always makes the parameters
            views into flat buffers.
        overlap_with_ddp: not supported (True raises); ``stage=2`` is mpidp's
            way of joining the optimizer to the DDP's backward pass.
        stage: 1 shards the optimizer state; 2 also the gradients: ``params``
            must then be the trainable parameters of one
            ``mpidp.DistributedDataParallel`` (``ddp.parameters()``), whose
            reducer then reduce-scatters the gradients (no ``param.grad`` is
            left after the backward; use ``clip_grad_norm_`` of this
            optimizer, not torch's). ``step()`` consumes the gradient shards:
            the next backward starts from zero, whether ``zero_grad()`` of the
            optimizer, of the module, or none was called.
        comm: the mpi4py communicator (default ``MPI.COMM_WORLD``; in stage 2,
            the DDP's).
        bucket_cap_mb: size of the flat buffers the parameters are laid out in
            (stage 1; stage 2 uses the DDP's buckets).
        chunk_mb: largest single allgather (stage 2: the DDP's ``chunk_mb``).
        **defaults: the arguments of ``optimizer_class`` (``lr``...).
    """

    def __init__(self, params, optimizer_class: type, process_group=None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, *,
                 stage: int = 1, comm: MPI.Intracomm | None = None, bucket_cap_mb: float = 25,
                 chunk_mb: float = 4, **defaults):
        from .ddp import _base_comm  # noqa: PLC0415 (ddp imports the reducer, which is fine)

        self._ready = False
        self._buckets: list[_Bucket] = []
        error, ddp = None, None
        base = _base_comm(comm, process_group)  # where the ranks agree on errors
        try:
            super().__init__(params, defaults)  # torch's checks: empty, duplicates, leaves...
            if stage not in (1, 2) or isinstance(stage, bool):
                raise ValueError(f"stage must be 1 (optimizer state sharded) or 2 (gradients "
                                 f"too), got {stage!r}")
            if overlap_with_ddp is not False:
                raise ValueError(f"overlap_with_ddp is not supported by mpidp, got "
                                 f"{overlap_with_ddp!r}; pass stage=2 to reduce-scatter the "
                                 f"gradients into the optimizer's shards during the backward")
            if not isinstance(parameters_as_bucket_view, bool):
                raise TypeError(f"parameters_as_bucket_view must be a bool, got "
                                f"{parameters_as_bucket_view!r}")
            for name, value in (("bucket_cap_mb", bucket_cap_mb), ("chunk_mb", chunk_mb)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    raise ValueError(f"{name} must be a number > 0, got {value!r}")
            if not (isinstance(optimizer_class, type)
                    and issubclass(optimizer_class, torch.optim.Optimizer)):
                raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got "
                                f"{optimizer_class!r}")
            if issubclass(optimizer_class, ZeroRedundancyOptimizer):
                raise TypeError("optimizer_class must be the optimizer to shard, not "
                                "ZeroRedundancyOptimizer itself")
            self._check_devices()
            if stage == 2:
                if comm is not None or process_group is not None:
                    raise ValueError("with stage=2 the optimizer uses the communicator of the "
                                     "DistributedDataParallel it joins; leave comm and "
                                     "process_group None")
                ddp = self._find_ddp()
                base = ddp.control
                chunk_mb = ddp._options["chunk_mb"]
            first = self._params()[0]
            self._sharded_keys = _elementwise_keys(optimizer_class, defaults, first.dtype,
                                                   first.device)
        except (TypeError, ValueError) as caught:
            error = caught
        # Every rank decides the same: a rank that raised alone would leave the
        # others in the collectives below.
        _agree(base, error)
        _agree(base, self._mismatch(base.allgather(self._signature(optimizer_class, stage))))
        self._comm = base.Dup()
        self.rank, self.world = self._comm.Get_rank(), self._comm.Get_size()
        self.stage = stage
        self.optimizer_class = optimizer_class
        self._chunk_mb = chunk_mb
        self._cap_bytes = int(bucket_cap_mb * _MB)
        self._defaults = defaults
        params = self._params()
        self._index = {id(p): i for i, p in enumerate(params)}
        # Per parameter, whether it has a gradient for the coming step in stage 2
        # (torch: .grad is not None), and whether it had one at the last step.
        self._has = [False] * len(params)
        self._had = [False] * len(params)
        self._ddp = None
        self._by_reducer: list[int] = []
        if ddp is not None:
            reducer = ddp._shard_gradients(self)
            self._ddp = weakref.ref(ddp)
            self._by_reducer = [self._index[id(p)] for p in reducer.params]
            for bucket, members in zip(reducer.buckets, reducer.layout):
                self._add_bucket([self._by_reducer[i] for i in members], bucket.shards, True)
        placed = {i for bucket in self._buckets for i in bucket.members}
        self._lay_out([i for i in range(len(params)) if i not in placed])
        self.optim = optimizer_class(
            [dict(self._hyper(group), params=[]) for group in self.param_groups], **defaults)
        for bucket in self._buckets:
            self._add_pieces(bucket)
        self._sync_back()
        self._consolidated: dict | None = None
        self._ready = True

    # -- construction -----------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _group_of(self) -> list[int]:
        return [g for g, group in enumerate(self.param_groups) for _ in group["params"]]

    @staticmethod
    def _hyper(group: dict) -> dict:
        return {key: value for key, value in group.items() if key != "params"}

    def _check_devices(self) -> None:
        params = self._params()
        first = params[0]
        for k, param in enumerate(params):
            if param.device != first.device:
                raise ValueError(f"ZeroRedundancyOptimizer needs all parameters on one device, "
                                 f"but parameter {k} ({tuple(param.shape)}) is on "
                                 f"{param.device} and parameter 0 ({tuple(first.shape)}) is on "
                                 f"{first.device}")
            if param.is_sparse or param.layout != torch.strided:
                raise ValueError(f"parameter {k} has layout {param.layout}; ZeroRedundancy"
                                 f"Optimizer shards dense (strided) parameters only")

    def _find_ddp(self):
        from .ddp import owner  # noqa: PLC0415

        params = self._params()
        owners = {owner(p) for p in params if p.requires_grad}
        if len(owners) != 1 or None in owners:
            raise ValueError(
                "stage=2 needs the parameters of one mpidp.DistributedDataParallel (pass "
                "ddp.parameters()), built before the optimizer; found parameters "
                + ("that no DistributedDataParallel reduces" if None in owners
                   else f"of {len(owners)} different ones"))
        ddp = owners.pop()
        problem = ddp._stage2_problem()
        if problem is not None:
            raise ValueError(problem)
        mine = {id(p) for p in params}
        missing = [name for name, p in ddp._named_params(ddp.module) if id(p) not in mine]
        if missing:
            raise ValueError(
                f"stage=2: parameter(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} of "
                f"the DistributedDataParallel are not in the optimizer; their gradients "
                f"would be reduce-scattered and dropped. Pass all of ddp.parameters()")
        return ddp

    def _signature(self, optimizer_class, stage) -> tuple:
        return (getattr(optimizer_class, "__qualname__", repr(optimizer_class)), stage,
                [[(tuple(p.shape), str(p.dtype)) for p in group["params"]]
                 for group in self.param_groups])

    @staticmethod
    def _mismatch(signatures: list) -> ValueError | None:
        for rank, signature in enumerate(signatures):
            if signature != signatures[0]:
                fields = ("optimizer_class", "stage", "param_groups (shapes, dtypes)")
                which = [name for name, a, b in zip(fields, signature, signatures[0]) if a != b]
                return ValueError(f"ZeroRedundancyOptimizer: {', '.join(which)} differ between "
                                  f"rank 0 and rank {rank}; every rank must build the same "
                                  f"optimizer over the same model")
        return None

    def _add_bucket(self, members: list[int], shards: Shards, sharded: bool) -> None:
        params = self._params()
        self._buckets.append(_Bucket(members, [params[i] for i in members], shards, self.rank,
                                     sharded))

    def _lay_out(self, indices: list[int]) -> None:
        """Stage-1 buckets for ``indices`` (their gradients are read from ``.grad``)."""
        if not indices:
            return
        params = self._params()
        sizes = [params[i].numel() * params[i].element_size() for i in indices]
        keys = [(params[i].dtype, params[i].device) for i in indices]
        for local in assign_buckets(sizes, keys, self._cap_bytes, self._cap_bytes,
                                    order=range(len(indices))):
            members = [indices[k] for k in local]
            first = params[members[0]]
            chunk = max(1, int(self._chunk_mb * _MB) // first.element_size())
            self._add_bucket(members, Shards(sum(params[i].numel() for i in members),
                                             self.world, chunk), False)

    def _add_pieces(self, bucket: _Bucket) -> None:
        group_of = self._group_of()
        for member, _, _, _, piece in bucket.pieces:
            self.optim.param_groups[group_of[member]]["params"].append(piece)

    def _sync_back(self) -> None:
        """Copy the inner optimizer's filled-in hyperparameters into ``param_groups``."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            outer.update(self._hyper(inner))

    # -- the stage-2 reducer's sink ---------------------------------------------------

    def grad_target(self, position: int) -> torch.Tensor:
        """Where the DDP's bucket ``position`` reduce-scatters this rank's shard to."""
        bucket = self._buckets[position]
        if bucket.grad is None:
            bucket.grad = torch.empty(bucket.shards.shard_numel, dtype=bucket.flat.dtype,
                                      device=bucket.flat.device)
            bucket.clean = True
        if bucket.clean:
            return bucket.grad
        bucket.scratch = torch.empty_like(bucket.grad)  # accumulated in reduced()
        return bucket.scratch

    def reduced(self, used: Sequence[bool]) -> None:
        """A synced backward's shards are in (``used``: per DDP parameter, has a gradient)."""
        for bucket in self._buckets:
            if bucket.scratch is not None:
                bucket.grad.add_(bucket.scratch)
                bucket.scratch = None
            if bucket.sharded and bucket.grad is not None:
                bucket.clean = False
        for index, flag in zip(self._by_reducer, used):
            self._has[index] = self._has[index] or flag

    # -- stepping ---------------------------------------------------------------------

    def _owned_grads(self):
        """(bucket, piece, gradient of the piece or None) for each piece this rank owns."""
        params = self._params()
        for bucket in self._buckets:
            for member, start, stop, position, piece in bucket.pieces:
                if bucket.sharded:
                    grad = None
                    # zeros after zero_grad(set_to_none=False) when not reduced since
                    if self._has[member] and bucket.grad is not None:
                        grad = bucket.grad[position:position + stop - start]
                else:
                    grad = params[member].grad
                    if grad is not None:
                        if grad.is_sparse:
                            raise RuntimeError(
                                f"ZeroRedundancyOptimizer: parameter {member} has a sparse "
                                f"gradient; it shards dense gradients only")
                        grad = grad.reshape(-1)[start:stop]
                yield bucket, piece, grad

    def _check_storage(self) -> None:
        params = self._params()
        for bucket in self._buckets:
            for member, view in zip(bucket.members, bucket.views):
                param = params[member]
                if param.data_ptr() != view.data_ptr() or param.shape != view.shape:
                    raise RuntimeError(
                        f"ZeroRedundancyOptimizer: parameter {member} "
                        f"({tuple(param.shape)}, {param.dtype}, {param.device}) no longer lies "
                        f"in the optimizer's flat buffer: it was converted or replaced after "
                        f"the optimizer was built (module.to(), .double(), load_state_dict "
                        f"with assign=True...). Convert the model first, then build the "
                        f"optimizer")

    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's shard with the inner optimizer, then allgather the parameters (collective)."""
        loss, pieces, error = None, [], None
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._check_storage()
            for outer, inner in zip(self.param_groups, self.optim.param_groups):
                inner.update(self._hyper(outer))
            for _, piece, grad in self._owned_grads():
                piece.grad = grad
                pieces.append(piece)
            self.optim.step()
        except Exception as caught:  # on one rank, it would leave the others in the allgathers
            error = caught
        finally:
            for piece in pieces:
                piece.grad = None
        _agree(self._comm, error)
        # Stage 2 consumes the gradient shards, as DeepSpeed's engine does: the
        # next backward starts from zero even if only module.zero_grad() was
        # called (it cannot reach the shards), not on top of this step's.
        for bucket in self._buckets:
            if bucket.sharded:
                bucket.clean = True
        self._had, self._has = self._has, [False] * len(self._has)
        for bucket in self._buckets:
            bucket.gather(self._comm, self.rank)
        self._sync_back()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients: the parameters' ``.grad`` and (stage 2) this rank's shards."""
        for param in self._params():
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.requires_grad_(False)
                param.grad.zero_()
        for bucket in self._buckets:
            if bucket.grad is not None:
                if set_to_none:
                    bucket.grad = None
                else:
                    bucket.grad.zero_()
                bucket.clean = True
        if set_to_none:
            self._has, self._had = [False] * len(self._has), [False] * len(self._had)
        else:  # as torch: a parameter that had a gradient has a zero one, and is stepped
            self._has = [has or had for has, had in zip(self._has, self._had)]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale the gradients so that their norm over all ranks' shards is at most ``max_norm``.

        ``torch.nn.utils.clip_grad_norm_`` sees only this rank's ``.grad``,
        which stage 2 has released: use this instead (in stage 1 both agree).
        Every element is counted once, on the rank that owns it. Collective.

        Returns:
            The total norm before clipping (a float32 tensor on the parameters' device).
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
        grads = [grad for _, _, grad in self._owned_grads() if grad is not None]
        infinite = norm_type == float("inf")
        local = torch.zeros(1, dtype=torch.float64)
        for grad in grads:
            value = torch.linalg.vector_norm(grad, norm_type, dtype=torch.float64).cpu()
            local = torch.maximum(local, value) if infinite else local + value ** norm_type
        _comm.allreduce(local, "max" if infinite else "sum", comm=self._comm)
        total = local[0].item() if infinite else local[0].item() ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(torch.tensor(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               f"{total}, so they cannot be clipped (error_if_nonfinite=True)")
        coefficient = max_norm / (total + 1e-6)
        if coefficient < 1.0:
            for bucket in self._buckets:
                if bucket.sharded and bucket.grad is not None:
                    bucket.grad.mul_(coefficient)
            params = self._params()
            for bucket in self._buckets:
                if not bucket.sharded:
                    for member in bucket.members:
                        if params[member].grad is not None:
                            params[member].grad.mul_(coefficient)
        return torch.tensor(total, dtype=torch.float32, device=self._params()[0].device)

    # -- param groups -----------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (collective once the optimizer is built: the new parameters are sharded too)."""
        if not self._ready:
            super().add_param_group(param_group)
            return
        before, groups, error = len(self._params()), len(self.param_groups), None
        try:
            super().add_param_group(param_group)
            self._check_devices()
        except (TypeError, ValueError) as caught:
            error = caught
        try:
            _agree(self._comm, error)
            _agree(self._comm, self._mismatch(self._comm.allgather(
                self._signature(self.optimizer_class, self.stage))))
        except (TypeError, ValueError):
            del self.param_groups[groups:]  # as before, on every rank
            raise
        params = self._params()
        self._index = {id(p): i for i, p in enumerate(params)}
        self._has += [False] * (len(params) - before)
        self._had += [False] * (len(params) - before)
        first = len(self._buckets)
        self._lay_out(list(range(before, len(params))))
        self.optim.add_param_group(dict(self._hyper(self.param_groups[-1]), params=[]))
        for bucket in self._buckets[first:]:
            self._add_pieces(bucket)
        self._sync_back()

    # -- checkpoints ------------------------------------------------------------------

    def _piece_states(self) -> list[tuple[int, int, int, dict]]:
        return [(member, start, stop, self.optim.state[piece])
                for bucket in self._buckets for member, start, stop, _, piece in bucket.pieces
                if piece in self.optim.state and self.optim.state[piece]]

    def _merge(self, pieces: Iterable[tuple[int, int, int, dict]], member: int, low: int,
               high: int) -> dict | None:
        """The state of elements ``low:high`` of parameter ``member``, from saved pieces."""
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
            if key not in self._sharded_keys:
                merged[key] = value.clone() if isinstance(value, torch.Tensor) else value
                continue
            parts = []
            for start, stop, state in found:
                a, b = max(start, low), min(stop, high)
                if a < b:
                    parts.append(state[key].reshape(-1)[a - start:b - start])
            merged[key] = torch.cat(parts)
        return merged

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` for ``state_dict()`` (collective)."""
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self.world:
            raise ValueError(f"to must be a rank from 0 to {self.world - 1}, got {to!r}")
        local = [(member, start, stop, {key: value.detach().cpu()
                                        if isinstance(value, torch.Tensor) else value
                                        for key, value in state.items()})
                 for member, start, stop, state in self._piece_states()]
        gathered = self._comm.gather(local, root=to)
        self._consolidated = None
        if self.rank != to:
            return
        pieces = [piece for part in gathered for piece in part]
        params = self._params()
        state = {}
        for index, param in enumerate(params):
            merged = self._merge(pieces, index, 0, param.numel())
            if merged is None:
                continue
            state[index] = {key: value.view(param.shape) if key in self._sharded_keys else value
                            for key, value in merged.items()}
        groups, start = [], 0
        for group in self.param_groups:
            groups.append(dict(self._hyper(group), params=list(range(start, start + len(group["params"])))))
            start += len(group["params"])
        self._consolidated = {"state": state, "param_groups": groups}

    def state_dict(self) -> dict:
        """The whole state, in the inner optimizer's format, after ``consolidate_state_dict``.

        Raises:
            RuntimeError: on a rank that did not receive the consolidated state (as torch's).
        """
        if self._consolidated is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict() on rank {self.rank}: the optimizer state "
                f"has not been consolidated on this rank; call consolidate_state_dict(to=rank) "
                f"on every rank first (or save sharded with save_sharded())")
        return self._consolidated

    def _load_pieces(self, pieces: list, groups: list[dict]) -> None:
        """Load this rank's pieces' state from saved ``pieces`` (any layout), and ``groups``' hyperparameters."""
        error = None
        try:
            if len(groups) != len(self.param_groups):
                raise ValueError(f"the state dict has {len(groups)} param group(s), the optimizer "
                                 f"{len(self.param_groups)}")
            inner_state, order = {}, []
            for bucket in self._buckets:
                for member, start, stop, _, piece in bucket.pieces:
                    merged = self._merge(pieces, member, start, stop)
                    if merged is not None:
                        inner_state[id(piece)] = merged
            for group in self.optim.param_groups:
                order.extend(group["params"])
            loaded = {"state": {k: inner_state[id(p)] for k, p in enumerate(order)
                                if id(p) in inner_state},
                      "param_groups": []}
            start = 0
            for group, inner in zip(groups, self.optim.param_groups):
                count = len(inner["params"])
                loaded["param_groups"].append(dict(self._hyper(group),
                                                   params=list(range(start, start + count))))
                start += count
        except (ValueError, KeyError, RuntimeError) as caught:
            error = caught
        _agree(self._comm, error)
        # The inner optimizer has checks of its own: if they fail on some rank,
        # every rank raises and keeps the state it had.
        previous = self.optim.state_dict()
        try:
            self.optim.load_state_dict(loaded)
        except Exception as caught:
            error = caught
        try:
            _agree(self._comm, error)
        except Exception:
            if error is None:
                self.optim.load_state_dict(previous)
            raise
        for outer, group in zip(self.param_groups, groups):
            outer.update(self._hyper(group))
        self._sync_back()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state dict (``state_dict()`` of this class or of a plain torch optimizer
        over the same parameters), given on every rank; each keeps its shard (collective)."""
        error, pieces = None, []
        try:
            params = self._params()
            counts = [len(group["params"]) for group in state_dict["param_groups"]]
            mine = [len(group["params"]) for group in self.param_groups]
            if counts != mine:
                raise ValueError(f"the state dict's param groups hold {counts} parameters, the "
                                 f"optimizer's {mine}")
            ids = [i for group in state_dict["param_groups"] for i in group["params"]]
            for position, saved in enumerate(ids):
                if saved in state_dict["state"]:
                    param = params[position]
                    state = {key: value.reshape(-1) if key in self._sharded_keys else value
                             for key, value in state_dict["state"][saved].items()}
                    pieces.append((position, 0, param.numel(), state))
        except (ValueError, KeyError, TypeError) as caught:
            error = caught
        _agree(self._comm, error)
        self._load_pieces(pieces, state_dict["param_groups"])

    def sharded_state_dict(self) -> dict:
        """This rank's part of the state, with where each piece lies in its parameter.

        Any number of ranks can load the set of all ranks' dicts with
        ``load_sharded_state_dict`` (local; see ``save_sharded``).
        """
        return {"format": _FORMAT, "rank": self.rank, "world": self.world,
                "numels": [p.numel() for p in self._params()],
                "param_groups": [self._hyper(group) | {"count": len(group["params"])}
                                 for group in self.param_groups],
                "pieces": [(member, start, stop, dict(state))
                           for member, start, stop, state in self._piece_states()]}

    def load_sharded_state_dict(self, shards: Sequence[dict]) -> None:
        """Load from every saved rank's ``sharded_state_dict()`` (any number of ranks; collective)."""
        error = None
        try:
            if not shards:
                raise ValueError("shards is empty: pass every saved rank's sharded_state_dict()")
            numels = [p.numel() for p in self._params()]
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
            if counts != [len(group["params"]) for group in self.param_groups]:
                raise ValueError(f"the saved param groups hold {counts} parameters, the "
                                 f"optimizer's {[len(g['params']) for g in self.param_groups]}")
        except (ValueError, KeyError, TypeError) as caught:
            error = caught
        _agree(self._comm, error)
        pieces = [piece for shard in shards for piece in shard["pieces"]]
        self._load_pieces(pieces, [{k: v for k, v in g.items() if k != "count"} for g in groups])

    def save_sharded(self, directory: str) -> None:
        """Write this rank's ``sharded_state_dict()`` to ``directory`` (collective).

        One file per rank, ``zero-rank{r}-of-{N}.pt``; ``load_sharded`` reads them
        back at any number of ranks. The directory must be shared by the ranks
        that will load it.
        """
        error = None
        try:
            os.makedirs(directory, exist_ok=True)
            for old in glob.glob(os.path.join(directory, "zero-rank*-of-*.pt")):
                match = _FILE.search(old)
                if match and int(match.group(2)) != self.world and self.rank == 0:
                    os.remove(old)  # another world size's save would mix in at load
        except OSError as caught:
            error = caught
        _agree(self._comm, error)  # also the barrier: the old files are gone before any write
        try:
            torch.save(self.sharded_state_dict(),
                       os.path.join(directory, f"zero-rank{self.rank:05d}-of-{self.world:05d}.pt"))
        except (OSError, RuntimeError) as caught:  # torch's writer raises RuntimeError too
            error = caught
        _agree(self._comm, error)  # and every file is written when any rank returns

    def load_sharded(self, directory: str) -> None:
        """Load what ``save_sharded`` wrote, at any number of ranks (collective)."""
        error, shards = None, []
        try:
            files = sorted(glob.glob(os.path.join(directory, "zero-rank*-of-*.pt")))
            if not files:
                raise FileNotFoundError(f"no zero-rank*-of-*.pt file in {directory!r}")
            shards = [torch.load(path, mmap=True, weights_only=True) for path in files]
        except (OSError, RuntimeError) as caught:
            error = caught
        _agree(self._comm, error)
        self.load_sharded_state_dict(shards)

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer(stage={self.stage}, rank {self.rank} of {self.world}, "
                f"{self.optim!r})")
